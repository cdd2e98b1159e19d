"""`rlvr plot RUN_DIR`: PNG curves of reward, held-out accuracy, length and the step-time split."""

from __future__ import annotations

from pathlib import Path

from rlvr.run.views import load_run, plot_overview


def plot_run(run_path: Path) -> list[Path]:
    """Write training.png (the same overview the inspection notebook shows) into the run directory."""
    view = load_run(run_path)
    if view.metrics.empty:
        raise FileNotFoundError(f"{run_path} has no metrics yet")
    out = Path(run_path) / "training.png"
    plot_overview(view.metrics, view.evals).savefig(out, dpi=110)
    return [out]
