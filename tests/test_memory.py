"""rlvr.memory: freed heap pages go back to the system, allocated ones stay as they are."""

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
