"""Read-only views of a run directory for notebooks: metrics, evals and rollouts as DataFrames,
the newest checkpointed controller state, and one overview figure of the training curves.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rlvr.run.rundir import RunDir

ROLLOUT_COLUMNS = (
    "step",
    "prompt_id",
    "response",
    "gold",
    "reward",
    "status",
    "length",
    "finish_reason",
)
TIME_PARTS = ("time_generate", "time_verify", "time_train", "time_sync", "time_overhead")
PIPELINED_TIME_PARTS = ("time_wait_rollouts", "time_train", "time_sync", "time_overhead")
"""A run under `run.max_staleness` collects in the background: its step waits for rollouts."""


@dataclass
class RunView:
    """A snapshot of one run directory; `controller` is the newest checkpoint's controller state."""

    path: Path
    config: dict[str, Any]
    metrics: pd.DataFrame
    evals: pd.DataFrame
    rollouts: pd.DataFrame
    checkpoint_step: int | None
    controller: dict[str, Any] | None

    @property
    def name(self) -> str:
        """The run's name, which also names its live ControllerActor."""
        return self.config["run"]["name"]


def metrics_frame(records: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Per-step records (metrics.jsonl lines or the controller's history) as a frame sorted by step."""
    df = pd.DataFrame(list(records))
    if df.empty:
        return pd.DataFrame({"step": pd.Series(dtype="int64")})
    return df.sort_values("step", kind="stable").reset_index(drop=True)


def rollouts_frame(records: Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Rollout records as a frame with the known columns first, in a fixed order.

    Fixed columns keep notebook tables stable whether the records come from rollouts.jsonl, a
    checkpoint or the live actor, and an empty list still yields a frame that can be indexed.
    """
    df = pd.DataFrame(list(records))
    extra = [c for c in df.columns if c not in ROLLOUT_COLUMNS]
    return df.reindex(columns=[*ROLLOUT_COLUMNS, *extra])


def load_run(run_dir: str | Path) -> RunView:
    """Load everything a notebook shows about a run; safe to call while the run is writing.

    Torn last log lines are skipped (RunDir's reader) and only committed checkpoints are read.
    """
    run = RunDir(run_dir)
    config = run.load_config_dict()
    step = run.last_completed_step()
    controller = (
        json.loads((run.step_dir(step) / "controller.json").read_text())
        if step is not None
        else None
    )
    return RunView(
        path=run.path,
        config=config,
        metrics=metrics_frame(run.read_metrics()),
        evals=metrics_frame(run.read_eval()),
        rollouts=rollouts_frame(run.read_rollouts()),
        checkpoint_step=step,
        controller=controller,
    )


def plot_overview(metrics: pd.DataFrame, evals: pd.DataFrame) -> Figure:
    """2x2 figure: reward, accuracy (train and held-out), response length, stacked step-time split;
    a multi-turn run's (agent_* metrics) has a row more: turns and tool calls per trajectory, and
    the tool-error share beside the share of trajectories each end reason ended; a run with stale
    rollouts (`run.max_staleness`) one more: the engines' and policy's busy shares and MFU beside
    each step's rollout staleness and the batches ready when it took its own.

    Columns a frame lacks are left out, so a run with no steps yet gives empty panels, not an error.
    Built on `Figure` directly (no pyplot), so nothing stays registered in a global figure list.
    """
    agents = "agent_turns_mean" in metrics.columns
    pipelined = "rollout_staleness" in metrics.columns and metrics["rollout_staleness"].max() > 0
    n_rows = 2 + agents + pipelined
    fig = Figure(figsize=(11, 3.5 * n_rows), layout="constrained")
    rows = fig.subplots(n_rows, 2)
    (ax_reward, ax_acc), (ax_len, ax_time) = rows[:2]

    def line(ax: Any, df: pd.DataFrame, column: str, label: str, marker: str = ".") -> None:
        # markers keep a run's first step visible, when each line is a single point
        if column in df.columns and not df.empty:
            ax.plot(df["step"], df[column], label=label, marker=marker)

    line(ax_reward, metrics, "reward_mean", "train rollouts")
    line(ax_reward, evals, "eval_reward", "held-out", marker="o")
    ax_reward.set(title="reward", xlabel="step")

    line(ax_acc, metrics, "accuracy", "train rollouts")
    line(ax_acc, evals, "eval_accuracy", "held-out", marker="o")
    ax_acc.set(title="accuracy", xlabel="step", ylim=(0, 1))

    line(ax_len, metrics, "length_mean", "mean")
    line(ax_len, metrics, "length_p90", "p90")
    ax_len.set(title="response length (tokens)", xlabel="step")

    bottom = pd.Series(0.0, index=metrics.index)
    for part in PIPELINED_TIME_PARTS if pipelined else TIME_PARTS:
        if part in metrics.columns and not metrics.empty:
            # overhead is total minus the timed phases; clock jitter can make it slightly negative
            seconds = metrics[part].fillna(0.0).clip(lower=0.0)
            ax_time.bar(metrics["step"], seconds, bottom=bottom, label=part.removeprefix("time_"))
            bottom = bottom + seconds
    ax_time.set(title="step time split (s)", xlabel="step")

    if agents:
        ax_turns, ax_shares = rows[2]
        line(ax_turns, metrics, "agent_turns_mean", "turns")
        line(ax_turns, metrics, "agent_tool_calls_per_trajectory", "tool calls")
        ax_turns.set(title="per trajectory", xlabel="step")
        line(ax_shares, metrics, "agent_tool_error_share", "tool errors (of calls)")
        for column in sorted(c for c in metrics.columns if c.startswith("agent_end_")):
            line(ax_shares, metrics, column, f"ended: {column.removeprefix('agent_end_')}")
        ax_shares.set(title="shares", xlabel="step", ylim=(0, 1.05))

    if pipelined:
        ax_busy, ax_stale = rows[-1]
        line(ax_busy, metrics, "busy_share_engines", "engines busy")
        line(ax_busy, metrics, "busy_share_policy", "policy busy")
        line(ax_busy, metrics, "mfu_generate", "MFU generate", marker="x")
        line(ax_busy, metrics, "mfu_train", "MFU train", marker="x")
        ax_busy.set(title="utilisation (share)", xlabel="step", ylim=(0, 1.05))
        line(ax_stale, metrics, "rollout_staleness", "rollout staleness (versions)")
        line(
            ax_stale, metrics, "token_staleness_mean", "trained tokens' mean staleness", marker="x"
        )
        line(ax_stale, metrics, "pipeline_ready_batches", "batches ready")
        ax_stale.set(title="pipeline", xlabel="step")

    for ax in fig.axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return fig
