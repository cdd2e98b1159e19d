"""The sandbox's bounds on what a run takes from its host: output read in bounded chunks, memory
for all of its processes together (cgroup, or rlimits where none can be made), one deadline for
everything; the conversation API; the root filesystem it sees; and its refusal of the audit-hook
mode unless a caller accepts that mode's risk."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tracemalloc
import uuid
from pathlib import Path

import psutil
import pytest

from rlvr.config import config_from_dict
from rlvr.verifiers import cgroup, sandbox
from rlvr.verifiers.code import CodeVerifier
from rlvr.verifiers.factory import make_verifier
from rlvr.verifiers.sandbox import (
    Limits,
    Sandbox,
    SandboxUnavailable,
    available_mode,
    memory_control,
    run_python,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")

FLOOD = "import os\nchunk = b'x' * (1 << 20)\nfor _ in range({n}):\n    os.write({fd}, chunk)\n"
CHILDREN = """
import os, select, struct
ready_r, ready_w = os.pipe()
go_r, go_w = os.pipe()
children = set()
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(go_w)
        try:
            block = bytearray(100 << 20)
            for i in range(0, len(block), 4096):
                block[i] = 1
        except MemoryError:
            os._exit(1)
        os.write(ready_w, struct.pack("i", os.getpid()))
        os.read(go_r, 1)  # the barrier: every child still alive holds its block at once
        os.write(1, b"held\\n")
        os._exit(0)
    children.add(pid)
os.close(ready_w)
os.close(go_r)
settled = set()
while children - settled:
    if select.select([ready_r], [], [], 0.05)[0]:
        data = os.read(ready_r, 4096)
        settled.update(struct.unpack(f"{len(data) // 4}i", data))
    for pid in children - settled:
        if os.waitpid(pid, os.WNOHANG)[0]:
            children.discard(pid)
            break
os.close(go_w)
for pid in children:
    os.waitpid(pid, 0)
"""


@pytest.fixture(params=["namespaces", "hook"])
def mode(request):
    if request.param == "namespaces" and available_mode() != "namespaces":
        pytest.skip("no namespaces here: only the hook mode runs")
    return request.param


@pytest.mark.parametrize("fd", [1, 2])
def test_output_is_cut_and_the_callers_memory_does_not_grow_with_it(mode, fd):
    tracemalloc.start()
    try:
        result = run_python(FLOOD.format(n=128, fd=fd), timeout=30.0, mode=mode)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.returncode == 0 and not result.timed_out and result.truncated
    assert len(result.stdout if fd == 1 else result.stderr) == Limits().output_kb << 10
    assert peak < 8 << 20  # 128 MiB went through; a few MiB of it were ever held here


def test_a_flood_past_the_deadline_is_a_timeout(mode):
    flood = "import os\nwhile True:\n    os.write(1, b'x' * 65536)\n"
    result = run_python(flood, timeout=1.0, mode=mode)
    assert result.timed_out and result.returncode is None and result.truncated
    assert len(result.stdout) == Limits().output_kb << 10


def _held(limits: Limits) -> int:
    result = run_python(CHILDREN, timeout=20.0, limits=limits)
    assert not result.timed_out, result.stderr
    return result.stdout.count("held")


@pytest.mark.parametrize("control", ["cgroup", "rlimit"])
def test_memory_is_bounded_for_all_processes_together(control, monkeypatch):
    """Four children of 100 MB each that, past a barrier, hold their blocks at once: all four
    under 1024 MB, at most two under 256 MB (an OOM kill before the barrier drops a child)."""
    if control == "cgroup" and memory_control() == "rlimit":
        pytest.skip("no memory cgroup can be made here")
    if control == "rlimit":
        monkeypatch.setattr(sandbox, "hierarchy", lambda: None)
    assert _held(Limits(memory_mb=1024, nproc=6)) == 4
    assert _held(Limits(memory_mb=256, nproc=6)) <= 2


def test_runs_leave_no_cgroup_behind():
    where = cgroup.hierarchy()
    if where is None:
        pytest.skip("no memory cgroup can be made here")
    result = run_python(CHILDREN, timeout=20.0, limits=Limits(memory_mb=256))
    assert not result.timed_out
    mine = f"{cgroup.PREFIX}{os.getpid()}-"
    assert not [d for d in os.listdir(where.path) if d.startswith(mine)]


ECHO = "import sys\nfor line in sys.stdin:\n    print(line.strip().upper(), flush=True)\n"


def test_a_conversation_on_stdin_and_stdout(mode):
    with Sandbox(ECHO, timeout=20.0, mode=mode) as box:
        for word in ("one", "two", "three"):
            assert box.send(word.encode() + b"\n")
            assert box.read_line() == word.upper().encode()
        result = box.wait()
    assert result.returncode == 0 and result.stdout == "" and not result.timed_out


def test_read_line_gives_up_at_the_deadline_and_past_its_length(mode):
    program = "import time\nprint('x' * 5000, flush=True)\ntime.sleep(60)\n"
    with Sandbox(program, timeout=3.0, mode=mode) as box:
        assert box.read_line(max_bytes=100) is None  # a line longer than allowed
        assert not box.expired()
        assert box.read_line() == b"x" * 5000  # kept: a longer line is allowed now
        assert box.read_line() is None and box.expired()
        assert box.wait().timed_out


def test_nothing_outlives_a_caller_that_is_killed(mode):
    """The caller dies mid-run (SIGKILL: no cleanup of its own runs): the run dies with it."""
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nfrom rlvr.verifiers.sandbox import Sandbox\n"
            f"box = Sandbox('import time\\ntime.sleep(120)', timeout=120.0, mode={mode!r})\n"
            "box.send(b'')\nprint('started', flush=True)\ntime.sleep(120)\n",
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        stdout=subprocess.PIPE,
    )
    try:
        assert caller.stdout.readline() == b"started\n"
        time.sleep(0.5)  # the launcher has started the program by now
        run = psutil.Process(caller.pid).children(recursive=True)
        assert run
    finally:
        caller.kill()
        caller.wait()
    _, alive = psutil.wait_procs(run, timeout=10)
    for proc in alive:  # a failure leaves nothing behind either
        proc.kill()
    assert not alive
    where = cgroup.hierarchy()
    if where is not None:  # its cgroup, which it had no time to remove, goes at the next sweep
        left = f"{cgroup.PREFIX}{caller.pid}-"
        assert [d for d in os.listdir(where.path) if d.startswith(left)]
        cgroup.sweep(where)
        assert not [d for d in os.listdir(where.path) if d.startswith(left)]


def test_the_program_sees_the_system_directories_and_nothing_of_the_hosts_own():
    if available_mode() != "namespaces":
        pytest.skip("namespaces mode only")
    secret = Path(__file__).resolve().parents[2] / f".secret-{uuid.uuid4().hex}"
    secret.write_text("x")
    secret.chmod(0o644)
    try:
        code = (
            "import os, sys\n"
            "print(sorted(os.listdir('/')))\n"
            f"print(os.path.exists({str(secret)!r}), os.path.exists({str(Path.cwd())!r}))\n"
            "print(os.getcwd(), os.access('/usr', os.W_OK), os.access('/', os.W_OK))\n"
        )
        result = run_python(code, mode="namespaces")
        assert result.returncode == 0, result.stderr
        top, seen, where = result.stdout.splitlines()
        assert set(eval(top)) <= {
            "bin",
            "dev",
            "etc",
            "lib",
            "lib32",
            "lib64",
            "libx32",
            "proc",
            "root",
            "sbin",
            "tmp",
            "usr",
            "opt",
            "home",
        }
        assert seen == "False False"
        assert where == "/tmp/run False False"
    finally:
        secret.unlink()


@pytest.fixture
def no_namespaces(monkeypatch):
    """This machine as one where unshare(2) is refused."""
    monkeypatch.setattr(sandbox, "_mode_cache", {"mode": "hook", "why": "unshare failed: errno 1"})


def test_without_namespaces_code_is_refused_unless_the_hook_mode_is_accepted(no_namespaces):
    with pytest.raises(SandboxUnavailable, match="verifier.unsafe_hook_sandbox: true"):
        run_python("print(1)")
    with pytest.raises(SandboxUnavailable, match="unshare failed"):
        CodeVerifier(num_workers=1).wait_ready()
    result = run_python("print(1)", unsafe_hook=True)
    assert (result.mode, result.stdout) == ("hook", "1\n")
    assert run_python("print(2)", mode="hook").stdout == "2\n"  # named by the caller
    with CodeVerifier(num_workers=1, unsafe_hook=True) as verifier:
        verifier.wait_ready()
        assert verifier.mode == "hook"
        assert verifier.verify("def f(x):\n    return x", '{"asserts": ["assert f(2) == 2"]}') == (
            1.0,
            "correct",
        )


def test_the_config_key_reaches_the_code_verifier():
    assert config_from_dict({}).verifier.unsafe_hook_sandbox is False
    cfg = config_from_dict({"verifier": {"kind": "code", "unsafe_hook_sandbox": True}})
    kwargs = cfg.verifier.verifier_kwargs()
    assert kwargs["unsafe_hook_sandbox"] is True
    with make_verifier(**kwargs) as verifier:
        assert verifier.unsafe_hook is True
    weighted = [{"kind": "code", "weight": 1.0}]
    with make_verifier(rewards=weighted, unsafe_hook_sandbox=True) as verifier:
        assert verifier.components[0].verifier.unsafe_hook is True
