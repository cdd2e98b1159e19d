"""RunDir: atomic step checkpoints, pruning, and log truncation on resume."""

import pytest

from rlvr.run.rundir import RunDir


def test_checkpoint_commit_is_atomic(tmp_path):
    run = RunDir(tmp_path / "r")
    run.create({"a": 1})
    assert run.load_config_dict() == {"a": 1}
    with run.writing_checkpoint(0) as d:
        (d / "x").write_text("0")
    with pytest.raises(RuntimeError), run.writing_checkpoint(1) as d:
        (d / "x").write_text("1")
        raise RuntimeError("crash mid-write")
    assert run.completed_steps() == [0]
    assert (run.step_dir(0) / "x").read_text() == "0"


def test_prune_keeps_last_and_best(tmp_path):
    run = RunDir(tmp_path)
    run.create({})
    for s in range(5):
        with run.writing_checkpoint(s) as d:
            (d / "x").write_text(str(s))
    run.prune(keep_last=2, keep={1})
    assert run.completed_steps() == [1, 3, 4]


def test_truncate_logs_and_torn_line(tmp_path):
    run = RunDir(tmp_path)
    run.create({})
    for s in range(4):
        run.append_metrics({"step": s, "reward": s / 10})
    with open(run.metrics_file, "a") as f:
        f.write('{"step": 4, "rew')  # torn write from a crash
    assert [r["step"] for r in run.read_metrics()] == [0, 1, 2, 3]
    run.truncate_logs_after(1)
    assert [r["step"] for r in run.read_metrics()] == [0, 1]
    run.append_metrics({"step": 2, "reward": 0.2})
    assert [r["step"] for r in run.read_metrics()] == [0, 1, 2]


def test_not_a_run_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        RunDir(tmp_path).load_config_dict()
