"""rlvr.memory: freed heap pages go back to the system, allocated ones stay as they are; the
controller process stays free of the heavy libraries."""

import os
import subprocess
import sys

import pytest
import torch

from rlvr.config import DEFAULT_JEMALLOC_CONF, ConfigError, ResourcesConfig
from rlvr.memory import (
    MAX_MMAP_THRESHOLD,
    pin_mmap_threshold,
    preload_jemalloc,
    release_free_heap,
)
from workflows.components import allocator_env, jemalloc_library


def test_release_free_heap_keeps_live_tensors():
    live = torch.arange(1 << 20, dtype=torch.float32)
    freed = [torch.ones(1 << 16) for _ in range(64)]
    del freed
    release_free_heap()
    assert torch.equal(live, torch.arange(1 << 20, dtype=torch.float32))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_free_heap_runs_on_linux():
    assert release_free_heap() is True


@pytest.mark.parametrize("actor", ["actors.controller", "actors.streams"])
def test_the_controller_processes_import_neither_torch_nor_scikit_learn(actor):
    """The ControllerActor plans steps and the StreamsActor hosts CSA streams from numpy alone:
    importing torch and scikit-learn there took its import from 33 to 356 MB."""
    code = f"import sys, {actor}; print(sorted({{'torch', 'sklearn'}} & set(sys.modules)))"
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


def test_preloading_jemalloc_names_the_library_and_its_conf(tmp_path):
    library = tmp_path / "libjemalloc.so"
    library.write_bytes(b"")
    assert preload_jemalloc(library) == {"LD_PRELOAD": str(library)}
    assert preload_jemalloc(library, "dirty_decay_ms:0") == {
        "LD_PRELOAD": str(library),
        "MALLOC_CONF": "dirty_decay_ms:0",
    }
    with pytest.raises(FileNotFoundError, match="no jemalloc library"):
        preload_jemalloc(tmp_path / "missing.so")


# Run in a process started on jemalloc: whether jemalloc allocates, and the resident MiB that
# 256 MiB of touched 64 KiB blocks leave behind once freed, before and after release_free_heap.
FREED_UNDER_JEMALLOC = """
import ctypes
from rlvr.memory import jemalloc_active, release_free_heap
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
base = rss()
blocks = [libc.malloc(64 << 10) for _ in range(4096)]
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
for b in blocks:
    libc.free(b)
kept = rss() - base
released = release_free_heap()
print(jemalloc_active(), kept, released, rss() - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD and /proc")
def test_a_process_started_on_jemalloc_returns_what_it_freed_on_release():
    """With decay off, jemalloc keeps every freed page for reuse until `release_free_heap` purges
    its arenas; the 256 MiB come back to within 32 MiB (jemalloc's metadata and page rounding)."""
    env = {**os.environ, **preload_jemalloc(jemalloc_library(), "dirty_decay_ms:-1")}
    out = subprocess.run(
        [sys.executable, "-c", FREED_UNDER_JEMALLOC],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    active, kept, released, after = out.stdout.split()
    assert active == "True" and released == "True"
    assert int(kept) > 200, "jemalloc returned the pages before the release: nothing to test"
    assert int(after) < 32


def test_the_allocator_setting_gives_the_model_actors_their_environment(monkeypatch, tmp_path):
    glibc = ResourcesConfig()
    jemalloc = ResourcesConfig(allocator="jemalloc", jemalloc_conf="dirty_decay_ms:1000")
    assert allocator_env(glibc) == {}
    assert allocator_env(ResourcesConfig(allocator="jemalloc"))["MALLOC_CONF"] == (
        DEFAULT_JEMALLOC_CONF
    )
    assert allocator_env(jemalloc) == {
        "LD_PRELOAD": str(jemalloc_library()),
        "MALLOC_CONF": "dirty_decay_ms:1000",
    }
    monkeypatch.setenv("RAY_JEMALLOC_LIB_PATH", str(tmp_path / "missing.so"))
    with pytest.raises(ConfigError, match=r"resources\.allocator: jemalloc: no jemalloc library"):
        allocator_env(jemalloc)


@pytest.mark.ray
def test_an_actor_started_with_the_jemalloc_environment_allocates_with_jemalloc(ray_cluster):
    """Ray applies an actor's runtime_env variables before its worker process starts, so the
    preload takes effect there (and in the processes it spawns, such as vLLM's engine core)."""

    @ray_cluster.remote(num_cpus=0)
    class Probe:
        def allocator(self) -> tuple[bool, str, bool]:
            from rlvr.memory import jemalloc_active, release_free_heap

            return jemalloc_active(), os.environ.get("MALLOC_CONF", ""), release_free_heap()

    env = allocator_env(ResourcesConfig(allocator="jemalloc", jemalloc_conf="dirty_decay_ms:500"))
    probe = Probe.options(runtime_env={"env_vars": env}).remote()
    assert ray_cluster.get(probe.allocator.remote()) == (True, "dirty_decay_ms:500", True)
    plain = Probe.remote()
    assert ray_cluster.get(plain.allocator.remote())[:2] == (False, "")
