"""Shared fixtures: one Ray cluster per test session, bound to 127.0.0.1, an isolated model cache,
the tiny model (and a junior for Tandem), the TCP addresses a process listens on, and readers of the logger stores."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["WANDB_MODE"] = "offline"  # a test run never reaches W&B's servers, keys or not
# Ray starts its workers (every actor) at nice 15 so that its own daemons stay responsive; beside
# any other process at nice 0 they then get a thirtieth of its CPU share, and the suite, whose
# work is its actors, crawls on a machine that is merely busy. The tests' clusters run them at 0.
os.environ.setdefault("RAY_worker_niceness", "0")
# Idle OpenMP threads sleep at once instead of spinning first (GNU OpenMP's default): beside the
# other test worker on 2 cores, a team that spins between parallel regions takes the cores the
# other's work needs (tests/training/test_policy_trainer.py twice side by side: 86-96 CPU s each
# spinning, 72-75 passive). Set before torch loads its OpenMP runtime, which reads it then.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# The files whose tests share the session's finished tiny run (`tiny_run_dir`): under `make
# test`'s workers (pytest-xdist, `--dist loadfile`) they run on one worker, so it runs once.
SHARED_RUN_FILES = frozenset(
    f"tests/integration/{name}.py"
    for name in ("test_train_workflow", "test_recovery", "test_notebook")
)
# Where the runs are: these folders' files are handed to the workers first, the longest work
# first, so no worker is left alone with a long test at the end.
FIRST = ("tests/integration/", "tests/actors/", "tests/models/", "tests/generation/")


def file_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile`, each file's tests on one worker, with the shared run's files as one."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedRunScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = file_of(nodeid)
            return "tiny_run_dir" if path in SHARED_RUN_FILES else path

    return SharedRunScheduling(config, log)


def worker_rank(item: pytest.Item) -> int:
    """Where a test's file goes in the workers' order: the shared run's files, then `FIRST`'s."""
    path = file_of(item.nodeid)
    if path in SHARED_RUN_FILES:
        return 0
    return next((i + 1 for i, p in enumerate(FIRST) if path.startswith(p)), len(FIRST) + 1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist workers, the tests in `worker_rank` order (each worker orders them
    alike, and the workers take them in this order). Tests marked `gpu` are skipped, with the
    reason, where no CUDA device is visible, and those marked `two_ranks` where exactly one is
    (NCCL refuses two ranks on one GPU)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=worker_rank)  # stable: a file's tests keep their order
    skip_without_devices(items)


def skip_without_devices(items: list[pytest.Item]) -> None:
    """Skip `gpu` tests without a CUDA device and `two_ranks` tests with exactly one."""
    import torch

    devices = torch.cuda.device_count()
    skips = {
        "gpu": (devices == 0, "needs a CUDA device"),
        "two_ranks": (devices == 1, "two ranks on one GPU: NCCL refuses two ranks on one device"),
    }
    for item in items:
        for marker, (skipped, reason) in skips.items():
            if skipped and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's Ray cluster (started once: each start costs seconds)."""
    import ray

    from actors.controller import NAMESPACE

    if not ray.is_initialized():
        ray.init(
            address="local",  # never another process's cluster (a run started from a test)
            num_cpus=os.cpu_count() or 2,
            namespace=NAMESPACE,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's tiny Qwen2 (head_dim 64, float32, byte-level BPE), built once per session."""
    from rlvr.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def junior_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tandem's junior in tests: a second tiny model, the same tokenizer, weights from another
    seed."""
    from rlvr.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("junior") / "tiny1", seed=1)


def _proc_address(hex_address: str, family: socket.AddressFamily) -> str:
    """An address as /proc/net/tcp{,6} writes it (32-bit words in host order) in text."""
    raw = bytes.fromhex(hex_address)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, raw)


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on, read from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.append((_proc_address(address, family), int(port, 16)))
    return found


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1, or 127.x as an IPv4-mapped IPv6 address."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


@pytest.fixture
def listening() -> Callable[[int], list[tuple[str, int]]]:
    """`listening(pid)`: the (address, port) pairs process ``pid`` listens on."""
    return listening_addresses


def kill_and_await_death(handle: Any, timeout_s: float = 60.0) -> None:
    """Kill a Ray actor and return once a call to it fails as on a dead actor. `ray.kill` only
    asks the GCS to end the process, so a call made at once can still run on the live actor,
    and a test that means to meet a dead one would race its death."""
    import time

    import ray
    from ray.exceptions import RayActorError

    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=timeout_s)
        except RayActorError:
            return
        assert time.monotonic() < deadline, f"{handle} still answers {timeout_s} s after its kill"
        time.sleep(0.05)


@pytest.fixture
def kill_actor() -> Callable[[Any], None]:
    """`kill_actor(handle)`: kill a Ray actor and wait until calls to it fail."""
    return kill_and_await_death


@pytest.fixture
def loopback() -> Callable[[str], bool]:
    """`loopback(address)`: whether a listening address is reachable from this node only."""
    return is_loopback


Series = dict[str, dict[int, float]]
"""Metric name -> {step: value}, as a logger store holds them (the last value of a step)."""


class LoggerStores:
    """Read back, from disk alone, what `run.loggers` wrote into a run directory."""

    @staticmethod
    def tensorboard(run_dir: Path) -> Series:
        """Every scalar in tb/, after TensorBoard's own purge of steps a resumed run redid."""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(run_dir / "tb"))
        acc.Reload()
        return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"]}

    @staticmethod
    def wandb_records(path: Path) -> list:
        """The records of a .wandb file: W&B's LevelDB-log framing (a 7-byte file header, 32 KiB
        blocks of chunks with a 7-byte header: CRC, length, type full/first/middle/last) around
        `wandb_internal_pb2.Record` messages."""
        from wandb.proto import wandb_internal_pb2

        data, pos, block, records, parts = path.read_bytes(), 7, 32768, [], b""
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header is padding
                pos += block - pos % block
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if kind == 0:
                break
            chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
            parts = chunk if kind in (1, 2) else parts + chunk
            if kind in (1, 4):
                records.append(wandb_internal_pb2.Record.FromString(parts))
        return records

    @classmethod
    def wandb(cls, run_dir: Path) -> list[tuple[str, Series]]:
        """(run id, metrics against our `step`) of each W&B attempt in wandb/, oldest first."""
        attempts = []
        for path in sorted(run_dir.glob("wandb/*run-*/run-*.wandb")):
            run_id, series = "", {}
            for record in cls.wandb_records(path):
                if record.HasField("run"):
                    run_id = record.run.run_id
                elif record.HasField("history"):
                    row = {
                        i.key or "/".join(i.nested_key): i.value_json for i in record.history.item
                    }
                    for k, v in row.items():
                        if not k.startswith("_") and k != "step":
                            series.setdefault(k, {})[int(row["step"])] = float(v)
            attempts.append((run_id, series))
        return attempts

    @staticmethod
    def mlflow(run_dir: Path, experiment: str) -> list[tuple[Any, Series]]:
        """(run, every metric's history) of each MLflow run of `experiment` in mlruns/."""
        from mlflow.tracking import MlflowClient

        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # as rlvr.run.loggers opens the store
        client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
        exp = client.get_experiment_by_name(experiment)
        found = []
        for run in client.search_runs([exp.experiment_id]):
            series = {
                k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)}
                for k in run.data.metrics
            }
            found.append((run, series))
        return found


@pytest.fixture(scope="session")
def logger_stores() -> type[LoggerStores]:
    """Readers of the TensorBoard, W&B (offline files) and MLflow (file store) stores."""
    return LoggerStores


_START_COUNTER = None


def pytest_configure(config: pytest.Config) -> None:
    """With RLVR_TEST_STARTS set, count each test's time and driver and engine starts
    (tests/start_counts.py)."""
    global _START_COUNTER
    from tests.start_counts import counter_from_env

    _START_COUNTER = counter_from_env()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if _START_COUNTER is None:
        yield
        return
    before = _START_COUNTER.snapshot()
    item.phase_seconds = {}
    yield
    _START_COUNTER.record(item.nodeid, item.phase_seconds, before)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    yield
    if _START_COUNTER is not None:
        item.phase_seconds[call.when] = call.duration
