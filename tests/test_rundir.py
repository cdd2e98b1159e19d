"""RunDir: atomic step checkpoints, pruning, and log truncation on resume."""

import json

import pytest

from rlvr.run.rundir import MANIFEST, RunDir


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


def test_a_damaged_latest_checkpoint_is_moved_aside(tmp_path, caplog):
    run = RunDir(tmp_path)
    run.create({})
    for s in range(3):
        with run.writing_checkpoint(s) as d:
            (d / "policy").mkdir()
            (d / "policy" / "weights.bin").write_bytes(bytes(100 + s))
            (d / "progress.json").write_text("{}")
    manifest = json.loads((run.step_dir(2) / MANIFEST).read_text())
    assert manifest == {"step": 2, "files": {"policy/weights.bin": 102, "progress.json": 2}}
    assert run.last_intact_step() == 2
    # A machine that lost unsynced writes: the latest checkpoint's weights came back short.
    (run.step_dir(2) / "policy" / "weights.bin").write_bytes(bytes(10))
    (run.step_dir(1) / "progress.json").unlink()
    with caplog.at_level("WARNING"):
        assert run.last_intact_step() == 0
    assert "weights.bin holds 10 bytes, the manifest says 102" in caplog.text
    assert "progress.json is missing" in caplog.text
    assert run.completed_steps() == [0]
    assert sorted(p.name for p in run.checkpoints.iterdir()) == [
        "damaged_step_000001",
        "damaged_step_000002",
        "step_000000",
    ]
    (run.step_dir(0) / MANIFEST).write_text("{not json")
    assert run.checkpoint_damage(0).startswith("unreadable manifest")
    # A checkpoint written before manifests existed is taken as it is.
    (run.step_dir(0) / MANIFEST).unlink()
    assert run.checkpoint_damage(0) is None
