"""rlvr.run.views on a synthetic run directory: loading (torn lines, newest checkpoint) and the plot."""

from __future__ import annotations

import json

import pytest

from rlvr.run.rundir import RunDir
from rlvr.run.views import ROLLOUT_COLUMNS, load_run, metrics_frame, plot_overview, rollouts_frame

TIMES = {"time_generate": 2.0, "time_verify": 0.5, "time_train": 1.0, "time_sync": 0.25}


def _rollout(step: int, pid: str, reward: float) -> dict:
    return {
        "step": step,
        "prompt_id": pid,
        "response": f"\\boxed{{{int(reward)}}}",
        "gold": "1",
        "reward": reward,
        "status": "correct" if reward else "wrong",
        "length": 5,
        "finish_reason": "stop",
    }


@pytest.fixture
def run_dir(tmp_path):
    """Two committed steps, an abandoned staging dir for step 2 and a torn last metrics line."""
    run = RunDir(tmp_path / "demo")
    run.create({"run": {"name": "demo", "steps": 3}})
    run.append_eval({"step": -1, "eval_accuracy": 0.25, "eval_reward": 0.25})
    for step, (reward, acc, overhead) in enumerate([(0.5, 0.5, -0.01), (0.75, 0.75, 0.5)]):
        run.append_metrics(
            {
                "step": step,
                "reward_mean": reward,
                "accuracy": acc,
                "length_mean": 10.0 + step,
                "length_p90": 20.0 + step,
                **TIMES,
                "time_overhead": overhead,
            }
        )
        run.append_rollouts([_rollout(step, "p0", 1.0), _rollout(step, "p1", 0.0)])
        with run.writing_checkpoint(step) as d:
            state = {"last_applied_step": step, "history": [{"step": s} for s in range(step + 1)]}
            (d / "controller.json").write_text(json.dumps(state))
    run.append_eval({"step": 1, "eval_accuracy": 0.5, "eval_reward": 0.5})
    staging = run.checkpoints / ".staging_000002"
    staging.mkdir()
    (staging / "controller.json").write_text('{"last_applied_step": 2')
    with open(run.metrics_file, "a") as f:
        f.write('{"step": 2, "reward_')
    return run.path


def test_load_run_reads_committed_state(run_dir):
    view = load_run(run_dir)
    assert view.name == "demo"
    assert view.path == run_dir
    assert view.metrics["step"].tolist() == [0, 1]
    assert view.metrics["reward_mean"].tolist() == [0.5, 0.75]
    assert view.evals["step"].tolist() == [-1, 1]
    assert view.evals["eval_accuracy"].tolist() == [0.25, 0.5]
    assert list(view.rollouts.columns) == list(ROLLOUT_COLUMNS)
    assert view.rollouts["prompt_id"].tolist() == ["p0", "p1", "p0", "p1"]
    assert view.checkpoint_step == 1
    assert view.controller == {"last_applied_step": 1, "history": [{"step": 0}, {"step": 1}]}


def test_load_run_before_first_checkpoint(tmp_path):
    RunDir(tmp_path).create({"run": {"name": "fresh"}})
    view = load_run(tmp_path)
    assert view.checkpoint_step is None
    assert view.controller is None
    assert view.metrics.empty and list(view.metrics.columns) == ["step"]
    assert view.rollouts.empty and list(view.rollouts.columns) == list(ROLLOUT_COLUMNS)


def test_load_run_rejects_a_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        load_run(tmp_path)


def test_metrics_frame_sorts_by_step():
    df = metrics_frame([{"step": 2, "x": 1.0}, {"step": 0, "x": 3.0}, {"step": 1, "x": 2.0}])
    assert df["step"].tolist() == [0, 1, 2]
    assert df["x"].tolist() == [3.0, 2.0, 1.0]


def test_rollouts_frame_orders_known_columns_first():
    rec = {"reward": 1.0, "extra": "x", "step": 3, "prompt_id": "p"}
    df = rollouts_frame([rec])
    assert list(df.columns) == [*ROLLOUT_COLUMNS, "extra"]
    assert df.loc[0, "step"] == 3 and df.loc[0, "reward"] == 1.0 and df.loc[0, "extra"] == "x"
    assert df["response"].isna().all()


def test_plot_overview_draws_each_panel(run_dir):
    view = load_run(run_dir)
    fig = plot_overview(view.metrics, view.evals)
    reward, acc, length, times = fig.axes
    assert [ln.get_label() for ln in reward.get_lines()] == ["train rollouts", "held-out"]
    assert reward.get_lines()[0].get_ydata().tolist() == [0.5, 0.75]
    assert acc.get_lines()[1].get_xdata().tolist() == [-1, 1]
    assert acc.get_lines()[1].get_ydata().tolist() == [0.25, 0.5]
    assert [ln.get_ydata().tolist() for ln in length.get_lines()] == [[10.0, 11.0], [20.0, 21.0]]
    # bars are added phase by phase, two steps each: generate, verify, train, sync, overhead
    bars = [(p.get_x() + p.get_width() / 2, p.get_y(), p.get_height()) for p in times.patches]
    assert bars[0::2] == [(0, 0.0, 2.0), (0, 2.0, 0.5), (0, 2.5, 1.0), (0, 3.5, 0.25), (0, 3.75, 0)]
    assert bars[1::2][-1] == (1, 3.75, 0.5)
    assert [t.get_text() for t in times.get_legend().get_texts()] == [
        "generate",
        "verify",
        "train",
        "sync",
        "overhead",
    ]


def test_a_multi_turn_run_gets_the_agent_panels():
    rows = [
        {
            "step": 0,
            "agent_turns_mean": 2.0,
            "agent_tool_calls_per_trajectory": 1.5,
            "agent_tool_error_share": 0.25,
            "agent_end_done": 0.75,
            "agent_end_max_turns": 0.25,
        },
        {
            "step": 1,
            "agent_turns_mean": 1.5,
            "agent_tool_calls_per_trajectory": 0.5,
            "agent_tool_error_share": 0.0,
            "agent_end_done": 1.0,
        },
    ]
    fig = plot_overview(metrics_frame(rows), metrics_frame([]))
    assert len(fig.axes) == 6
    turns, shares = fig.axes[4:]
    assert [ln.get_ydata().tolist() for ln in turns.get_lines()] == [[2.0, 1.5], [1.5, 0.5]]
    assert [ln.get_label() for ln in shares.get_lines()] == [
        "tool errors (of calls)",
        "ended: done",
        "ended: max_turns",
    ]
    assert shares.get_lines()[2].get_ydata()[0] == 0.25


def test_a_run_with_stale_rollouts_gets_the_pipeline_panels():
    """Its step waits for rollouts collected in the background: the time split stacks that wait
    (not the generation, which ran during earlier steps), and a last row shows the busy shares,
    MFU, staleness and ready batches."""
    rows = [
        {
            "step": s,
            "time_generate": 9.0,
            "time_wait_rollouts": wait,
            "time_train": 1.0,
            "time_sync": 0.5,
            "time_overhead": 0.0,
            "rollout_staleness": s,
            "pipeline_ready_batches": s,
            "busy_share_engines": 0.5,
            "busy_share_policy": 0.75,
            "mfu_train": 0.2,
            "token_staleness_mean": s * 0.75,
        }
        for s, wait in ((0, 2.0), (1, 0.0))
    ]
    fig = plot_overview(metrics_frame(rows), metrics_frame([]))
    assert len(fig.axes) == 6
    times = fig.axes[3]
    assert [t.get_text() for t in times.get_legend().get_texts()] == [
        "wait_rollouts",
        "train",
        "sync",
        "overhead",
    ]
    assert times.patches[0].get_height() == 2.0  # step 0 waited; generation is not stacked
    busy, stale = fig.axes[4:]
    assert [ln.get_label() for ln in busy.get_lines()] == [
        "engines busy",
        "policy busy",
        "MFU train",
    ]
    assert stale.get_lines()[0].get_ydata().tolist() == [0, 1]
    assert stale.get_lines()[1].get_label() == "trained tokens' mean staleness"
    assert stale.get_lines()[1].get_ydata().tolist() == [0, 0.75]  # partial rollouts
    synchronous = [{**r, "rollout_staleness": 0} for r in rows]
    assert len(plot_overview(metrics_frame(synchronous), metrics_frame([])).axes) == 4


def test_plot_overview_of_a_run_without_steps():
    fig = plot_overview(metrics_frame([]), metrics_frame([]))
    assert len(fig.axes) == 4
    assert all(not ax.get_lines() and not ax.patches for ax in fig.axes)
