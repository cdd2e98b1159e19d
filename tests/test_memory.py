"""rlvr.memory: freed heap pages go back to the system, allocated ones stay as they are; the
controller process stays free of the heavy libraries."""

import subprocess
import sys

import pytest
import torch

from rlvr.memory import MAX_MMAP_THRESHOLD, pin_mmap_threshold, release_free_heap


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


# Run in a fresh process (its own malloc state): reports whether an 8 MiB block allocated right
# after an 8 MiB block was freed got a mapping of its own (mallinfo2's hblkhd, glibc >= 2.33).
SECOND_BLOCK_MAPPED = """
import ctypes, sys
from rlvr.memory import pin_mmap_threshold
libc = ctypes.CDLL("libc.so.6")
fields = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in fields.split()]
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "pin":
    assert pin_mmap_threshold(1 << 20)
libc.free(libc.malloc(8 << 20))
block = libc.malloc(8 << 20)
print(libc.mallinfo2().hblkhd >= 8 << 20)
libc.free(block)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")
@pytest.mark.parametrize(("mode", "mapped"), [("pin", "True"), ("default", "False")])
def test_a_pinned_threshold_keeps_freed_blocks_off_the_heap(mode, mapped):
    """glibc's default raises its threshold to the size of a mapped block once that is freed, so
    the next block of that size comes from the heap (and stays resident when freed); pinned at
    1 MiB it gets a mapping again."""
    out = subprocess.run(
        [sys.executable, "-c", SECOND_BLOCK_MAPPED, mode], capture_output=True, text=True
    )
    if "mallinfo2" in out.stderr:
        pytest.skip("glibc older than 2.33 (no mallinfo2)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == mapped


@pytest.mark.parametrize("nbytes", [0, -1, MAX_MMAP_THRESHOLD + 1])
def test_an_mmap_threshold_out_of_glibcs_range_is_refused(nbytes):
    with pytest.raises(ValueError, match="mmap threshold"):
        pin_mmap_threshold(nbytes)
