"""The notebooks run headless, as a user runs them: inspect_run.ipynb against a finished tiny run,
and quickstart.ipynb, which trains from Python with a reward function of its own, plots the run
while it trains, inspects its live actors and evaluates it."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from rlvr.run.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "inspect_run.ipynb"
QUICKSTART = ROOT / "notebooks" / "quickstart.ipynb"

pytestmark = pytest.mark.ray


def _text(cell: nbformat.NotebookNode) -> str:
    """Everything a code cell printed or displayed as plain text or HTML."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("display_data", "execute_result"):
            parts.append(out.data.get("text/html", "") + out.data.get("text/plain", ""))
    return "".join(parts)


def test_notebook_inspects_a_finished_run(tiny_run_dir, ray_cluster, monkeypatch):
    run_dir = Path(tiny_run_dir)
    png = run_dir / "inspect.png"
    png.unlink(missing_ok=True)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "commit the notebook with its outputs cleared"
    )
    monkeypatch.setenv("RLVR_RUN_DIR", str(run_dir))
    # The cluster it looks on for the run's controller: this session's, which holds none. Left to
    # "auto" it would take the newest cluster on the machine, another test's live run maybe.
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.get_runtime_context().gcs_address)

    # raises CellExecutionError if any cell fails
    NotebookClient(
        nb,
        kernel_name="python3",
        timeout=600,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    ).execute()

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = "".join(_text(c) for c in nb.cells if c.cell_type == "code")
    run = RunDir(run_dir)
    step = run.last_completed_step()
    name = run.load_config_dict()["run"]["name"]
    assert f"run {name!r} in {run_dir}" in out
    # the training process has exited, so the state comes from its newest checkpoint
    assert f"the run is not live: state of the checkpoint of step {step}" in out
    assert f"last applied step {step}," in out
    kept = json.loads((run.step_dir(step) / "controller.json").read_text())["recent_rollouts"]
    table = next(c for c in nb.cells if "rollouts_frame(recent)" in c.source)
    assert kept[-1]["prompt_id"] in _text(table)


def test_quickstart_trains_watches_inspects_and_evaluates(tmp_path, monkeypatch, driver_env):
    nb = nbformat.read(QUICKSTART, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "commit the notebook with its outputs cleared"
    )
    monkeypatch.setenv("RLVR_OUTPUT_DIR", str(tmp_path))
    monkeypatch.setenv("RLVR_STEPS", "2")
    NotebookClient(
        nb,
        kernel_name="python3",
        timeout=900,
        resources={"metadata": {"path": str(QUICKSTART.parent)}},
    ).execute()

    (run_dir,) = tmp_path.iterdir()
    run = RunDir(run_dir)
    name = run.load_config_dict()["run"]["name"]
    out = {i: _text(c) for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    text = "".join(out.values())
    # the live actors, the controller found by its name, while the run trained
    assert f"rlvr/rlvr-controller-{name}" in text and f"rlvr/rlvr-policy-{name}" in text
    assert "'last_applied_step'" in text
    # the figure was drawn while the run went on, and saved
    assert (run_dir / "quickstart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [m["step"] for m in run.read_metrics()] == [0, 1]
    assert f"TrainingRun('{name}', finished, 2/2 steps committed" in text
    # the notebook's own reward scored the rollouts: 0.1 is its bonus for a wrong boxed answer
    rewards = {r["reward"] for r in run.read_rollouts()}
    assert rewards <= {0.0, 0.1, 1.0} and 0.1 in rewards
    evaluation = json.loads(next((run_dir).glob("eval-*/evaluation.json")).read_text())
    assert f"accuracy {evaluation['accuracy']:.3f}" in text
