"""rlvr.memory: freed heap pages go back to the system, allocated ones stay as they are; the
controller process stays free of the heavy libraries."""

import subprocess
import sys

import pytest
import torch

from rlvr.memory import release_free_heap


def test_release_free_heap_keeps_live_tensors():
    live = torch.arange(1 << 20, dtype=torch.float32)
    freed = [torch.ones(1 << 16) for _ in range(64)]
    del freed
    release_free_heap()
    assert torch.equal(live, torch.arange(1 << 20, dtype=torch.float32))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_free_heap_runs_on_linux():
    assert release_free_heap() is True


def test_the_controller_process_imports_neither_torch_nor_scikit_learn():
    """The ControllerActor plans steps and hosts CSA streams from numpy alone: importing torch
    and scikit-learn there took its import from 33 to 356 MB."""
    code = "import sys, actors.controller; print(sorted({'torch', 'sklearn'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_policy_trainer_keeps_mlflow_out_of_deepspeeds_import():
    """DeepSpeed's autotuner imports mlflow whenever it is installed: 105 MiB more in every policy
    rank. The trainer imports DeepSpeed without it, and mlflow still imports afterwards."""
    pytest.importorskip("mlflow")
    code = (
        "import sys, rlvr.training.policy_trainer; print('mlflow' in sys.modules); "
        "import mlflow; print(mlflow.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # DeepSpeed prints its accelerator note to stdout first
    assert out.stdout.splitlines()[-2:] == ["False", "mlflow"]
