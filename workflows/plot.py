"""`rlvr plot RUN_DIR`: PNG curves of reward, held-out accuracy, length and the step-time split."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rlvr.rundir import RunDir  # noqa: E402

TIME_PARTS = ("time_generate", "time_verify", "time_train", "time_sync", "time_overhead")


def plot_run(run_path: Path) -> list[Path]:
    """Write training.png (reward, accuracy, length, time split) into the run directory."""
    run = RunDir(run_path)
    metrics = run.read_metrics()
    evals = run.read_eval()
    if not metrics:
        raise FileNotFoundError(f"{run_path} has no metrics yet")
    steps = [m["step"] for m in metrics]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))

    ax = axes[0, 0]
    ax.plot(steps, [m["reward_mean"] for m in metrics], label="train reward")
    ax.set(title="reward", xlabel="step")
    ax.legend()

    ax = axes[0, 1]
    if evals:
        ax.plot(
            [e["step"] for e in evals], [e["eval_accuracy"] for e in evals], "o-", label="held-out"
        )
    ax.plot(steps, [m["accuracy"] for m in metrics], alpha=0.6, label="train rollouts")
    ax.set(title="accuracy", xlabel="step", ylim=(0, 1))
    ax.legend()

    ax = axes[1, 0]
    ax.plot(steps, [m["length_mean"] for m in metrics], label="mean")
    ax.plot(steps, [m["length_p90"] for m in metrics], label="p90")
    ax.set(title="response length (tokens)", xlabel="step")
    ax.legend()

    ax = axes[1, 1]
    bottom = [0.0] * len(steps)
    for part in TIME_PARTS:
        vals = [max(m.get(part, 0.0), 0.0) for m in metrics]
        ax.bar(steps, vals, bottom=bottom, label=part.removeprefix("time_"))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set(title="step time split (s)", xlabel="step")
    ax.legend(fontsize=8)

    fig.tight_layout()
    out = run.path / "training.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return [out]
