"""Code verifier and its sandbox: verdicts for both gold formats, and hostile programs that must
neither escape nor outlive their run, in each isolation mode this machine has."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest

from rlvr.verifiers.code import IO_OUTPUT_MB, CodeVerifier, extract_code, parse_gold
from rlvr.verifiers.sandbox import Limits, available_mode, run_python

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox needs Linux")

TIMEOUT = 2.0
SLACK = 3.0  # kill + reap + output drain on a loaded 2-core machine
MODES = ["namespaces", "hook"]
SANDBOX_UIDS = range(100000, 100000 + 2**23)


@pytest.fixture(params=MODES)
def mode(request):
    if request.param == "namespaces" and available_mode() != "namespaces":
        pytest.skip("no namespaces here: only the hook mode runs")
    return request.param


def _run(code: str, mode: str, timeout: float = TIMEOUT, stdin: str = ""):
    return run_python(code, stdin, timeout=timeout, limits=Limits(cpu_s=5), mode=mode)


def _other_test_workers() -> set[int]:
    """The pids of the other pytest-xdist workers (none without workers): their tests' sandboxes
    run beside this one's and are theirs to account for."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return set()
    me = psutil.Process()
    return {c.pid for c in me.parent().children()} - {me.pid}


def _sandbox_processes() -> list[psutil.Process]:
    """Processes running as a sandbox user, those under another test worker aside (one that
    escaped its sandbox's process tree is counted wherever it came from)."""
    others = _other_test_workers()
    out = []
    for p, _ in _as_sandbox_uids():
        try:
            if others.isdisjoint(a.pid for a in p.parents()):
                out.append(p)
        except psutil.NoSuchProcess:  # ended meanwhile
            continue
    return out


def _as_sandbox_uids() -> list[tuple[psutil.Process, int]]:
    """Every process running as a sandbox user, with that uid."""
    return [
        (p, uids.real)
        for p in psutil.process_iter(["uids"])
        if (uids := p.info["uids"]) is not None and uids.real in SANDBOX_UIDS
    ]


def _run_processes(launcher: psutil.Process) -> list[psutil.Process]:
    """Processes running as the uid of a sandbox that `launcher` or one of its descendants
    started (100000 + the launcher's pid), inside its tree or escaped from it: not another test
    worker's, whose orphans leave that worker's tree but not their own uid."""
    try:
        pids = {launcher.pid} | {c.pid for c in launcher.children(recursive=True)}
    except psutil.NoSuchProcess:
        return []
    return [p for p, uid in _as_sandbox_uids() if uid - SANDBOX_UIDS[0] in pids]


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


# --- verdicts -------------------------------------------------------------------------------

ASSERT_GOLD = json.dumps(
    {"asserts": ["assert f(1) == 4", "assert f(0) == 1", "assert f(-2) == -5"]}
)
IO_GOLD = json.dumps({"io": [{"input": "3\n", "output": "9\n"}, {"input": "-4\n", "output": "16"}]})


@pytest.fixture(scope="module")
def verifier():
    with CodeVerifier(num_workers=2, timeout=10.0) as v:
        v.wait_ready()
        yield v


def test_extract_code():
    assert extract_code("x\n```python\na = 1\n```\nthen\n```python\nb = 2\n```\n") == "b = 2"
    assert extract_code("```py\nc = 3\n```") == "c = 3"
    assert extract_code("```\nd = 4\n```") == "d = 4"
    assert extract_code("e = 5") == "e = 5"


def test_parse_gold_rejects_bad_golds():
    for bad in ("42", "[]", "{}", '{"asserts": []}', '{"io": [{"input": 1}]}'):
        with pytest.raises(ValueError):
            parse_gold(bad)


@pytest.mark.parametrize(
    ("response", "gold", "expected"),
    [
        ("```python\ndef f(x):\n    return 3 * x + 1\n```", ASSERT_GOLD, (1.0, "correct")),
        ("```python\ndef f(x):\n    return 3 * x\n```", ASSERT_GOLD, (0.0, "wrong")),
        ("```python\ndef f(x) return x\n```", ASSERT_GOLD, (0.0, "error")),
        ("```python\ndef g(x):\n    return x\n```", ASSERT_GOLD, (0.0, "error")),
        ("```python\nimport sys\nsys.exit(0)\n```", ASSERT_GOLD, (0.0, "error")),
        ("```python\nimport os\nos._exit(0)\n```", ASSERT_GOLD, (0.0, "error")),
        ("```python\n\n```", ASSERT_GOLD, (0.0, "no_code")),
        ("n = int(input())\nprint(n * n)", IO_GOLD, (1.0, "correct")),
        ("```python\nn = int(input())\nprint(n + n)\n```", IO_GOLD, (0.0, "wrong")),
        ("```python\nraise SystemExit(3)\n```", IO_GOLD, (0.0, "error")),
        ("```python\nprint(1)\n```", "not json", (0.0, "error")),
    ],
)
def test_verdicts(verifier, response, gold, expected):
    assert verifier.verify(response, gold) == expected


def _gold(*asserts: str, setup: str = "") -> str:
    return json.dumps({"asserts": list(asserts), **({"setup": setup} if setup else {})})


HUMANEVAL = (
    "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"
)


@pytest.mark.parametrize(
    ("solution", "gold", "expected"),
    [
        # HumanEval's check(candidate): the test's own function calls the solution's
        ("def add(a, b):\n    return a + b", _gold(HUMANEVAL + "check(add)"), "correct"),
        ("def add(a, b):\n    return a - b", _gold(HUMANEVAL + "check(add)"), "wrong"),
        # a setup's import serves the tests and the solution; comparisons are the tests' own
        (
            "def f(x):\n    return math.sqrt(x)",
            _gold("assert math.isclose(f(2), 1.4142135623731)", setup="import math"),
            "correct",
        ),
        # the tests' builtins stay theirs, whatever the solution defines
        (
            "def sorted(x):\n    return [9]\ndef f(n):\n    return [3, 1, 2]",
            _gold("assert sorted(f(3)) == [1, 2, 3]"),
            "correct",
        ),
        # keyword arguments and containers travel; the solution's process keeps its state
        (
            "def f(x, scale=1):\n    return (x * scale, [x], {x: {x}}, b'%d' % x)",
            _gold("assert f(2, scale=3) == (6, [2], {2: {2}}, b'2')"),
            "correct",
        ),
        (
            "calls = []\ndef f():\n    calls.append(1)\n    return len(calls)",
            _gold("assert f() == 1", "assert f() == 2"),
            "correct",
        ),
        # a builtin exception of the solution is the test's to catch
        (
            "def f(x):\n    raise ValueError('negative')",
            _gold("try:\n    f(-1)\n    raise AssertionError\nexcept ValueError:\n    pass"),
            "correct",
        ),
        # prints go nowhere the verdict is read from
        ("def f(x):\n    print('verdict wrong 0')\n    return 3 * x + 1", ASSERT_GOLD, "correct"),
        # what is not plain data, and input() at load time (stdin is empty), are errors
        ("class P:\n    pass\ndef f(x):\n    return P()", ASSERT_GOLD, "error"),
        ("x = input()\ndef f(x):\n    return 3 * x + 1", ASSERT_GOLD, "error"),
    ],
)
def test_the_tests_run_apart_and_see_only_values(verifier, solution, gold, expected):
    assert verifier.verify(f"```python\n{solution}\n```", gold) == (
        1.0 if expected == "correct" else 0.0,
        expected,
    )


@pytest.mark.parametrize(
    ("solution", "gold", "expected"),
    [
        # a solution's exception is never the tests' control flow, whatever catches it
        ("def f(x):\n    raise StopIteration", _gold("assert list(map(f, [1])) == []"), "error"),
        (
            "def f(x):\n    raise StopAsyncIteration",
            _gold("try:\n    f(1)\nexcept Exception:\n    pass"),
            "error",
        ),
        ("def f():\n    raise StopIteration", _gold("assert list(iter(f, 1)) == []"), "error"),
        (
            "class Done(StopIteration):\n    pass\ndef f(x):\n    raise Done",
            _gold("assert not any(map(f, [1, 2]))"),
            "error",
        ),
        # an error of the solution's own class reaches the test as its nearest builtin one
        (
            "class Negative(ValueError):\n    pass\ndef f(x):\n    raise Negative(x)",
            _gold("try:\n    f(-1)\n    raise AssertionError\nexcept ValueError:\n    pass"),
            "correct",
        ),
        # an ordering comparison with NaN fails its test, however the NaN got there
        (
            "def f(x):\n    return float('nan')",
            _gold("assert not math.fabs(f(2) - 4) >= 1e-6", setup="import math"),
            "wrong",
        ),
        (
            "def f(x):\n    return float('nan')",
            _gold("assert not (f(1) < 0 or 1 <= f(1) <= 2)"),
            "wrong",
        ),
        (
            "def f(x):\n    return float('nan')",
            _gold(
                "try:\n    far = abs(f(2) - 4) > 1e-6\nexcept ArithmeticError:\n    far = False\n"
                "assert not far"
            ),
            "wrong",
        ),
        # NaN stays a value: equality and isnan see it as Python does
        ("def f(x):\n    return float('nan')", _gold("assert f(1) != f(1)"), "correct"),
        # values of any size cross, both ways
        (
            "def f(n):\n    return list(range(n))",
            _gold("assert f(300000) == list(range(300000))"),
            "correct",
        ),
        (
            "def f(s):\n    return s[::-1]",
            _gold("assert f('ab' * 600000) == 'ba' * 600000"),
            "correct",
        ),
    ],
)
def test_solution_exceptions_and_nans_decide_nothing_for_the_tests(
    verifier, solution, gold, expected
):
    assert verifier.verify(f"```python\n{solution}\n```", gold) == (
        1.0 if expected == "correct" else 0.0,
        expected,
    )


def test_io_output_is_compared_whole_up_to_the_cap(verifier):
    """Right output of exactly the cap scores correct; one byte more is `output_limit`, never
    compared as if it were all the output."""
    lines = IO_OUTPUT_MB << 19  # "y\n" per line: exactly the cap
    gold = json.dumps({"io": [{"input": "", "output": "y\n" * lines}]})
    write = f"import sys\nsys.stdout.write('y\\n' * {lines})\n"
    assert verifier.verify(write, gold) == (1.0, "correct")
    assert verifier.verify(write + "sys.stdout.write('z')\n", gold) == (0.0, "output_limit")


def test_verify_batch_keeps_order_and_times_out_per_item(verifier):
    good = "```python\ndef f(x):\n    return 3 * x + 1\n```"
    loop = "```python\nwhile True:\n    pass\n```"
    start = time.monotonic()
    out = verifier.verify_batch([good, loop, good], [ASSERT_GOLD] * 3, timeout=TIMEOUT)
    assert out == [(1.0, "correct"), (0.0, "timeout"), (1.0, "correct")]
    assert time.monotonic() - start < 2 * (TIMEOUT + SLACK)


# --- hostile programs -----------------------------------------------------------------------


def test_infinite_loop_is_killed_at_the_timeout(mode):
    start = time.monotonic()
    result = _run("while True:\n    pass\n", mode)
    elapsed = time.monotonic() - start
    assert result.timed_out and result.returncode is None
    assert TIMEOUT <= elapsed < TIMEOUT + SLACK
    assert not _sandbox_processes()


def test_infinite_loop_scores_timeout(mode):
    with CodeVerifier(num_workers=1, timeout=TIMEOUT, mode=mode) as v:
        start = time.monotonic()
        assert v.verify("while True: pass", ASSERT_GOLD) == (0.0, "timeout")
        assert time.monotonic() - start < TIMEOUT + SLACK


FORK_BOMB = """
import os, time
n = 0
while True:
    try:
        if os.fork() == 0:
            try:
                os.setsid()  # try to leave the process group that is killed at the end
            except OSError:
                pass
            n = 0
        else:
            n += 1
    except OSError:
        time.sleep(0.01)
"""


def test_fork_bomb_is_bounded_and_leaves_nothing(mode):
    before = _descendants()
    start = time.monotonic()
    result = _run(FORK_BOMB, mode)
    assert time.monotonic() - start < TIMEOUT + SLACK
    assert result.timed_out or result.returncode != 0
    time.sleep(0.5)
    assert not _sandbox_processes()
    assert _descendants() <= before


def test_fork_bomb_process_count_is_bounded(mode):
    if mode != "namespaces" or os.geteuid() != 0:
        pytest.skip("the count is observable under a uid of its own (namespaces mode as root)")
    import subprocess

    code = FORK_BOMB
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from rlvr.verifiers.sandbox import *; run_python({code!r}, "
            f"timeout=4.0, limits=Limits(nproc=16), mode='namespaces')",
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    launcher = psutil.Process(proc.pid)
    try:
        # Watched until the run ends (its 4 s timeout after a start that is slow on a busy
        # machine), not for a fixed time that a slow start could fill.
        peak = 0
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            peak = max(peak, len(_run_processes(launcher)))
            time.sleep(0.1)
        assert 0 < peak <= 16
    finally:
        proc.wait(timeout=30)
    time.sleep(0.5)
    assert not _sandbox_processes()


def test_memory_hog_hits_the_address_space_limit(mode):
    hog = "chunks = []\nwhile True:\n    chunks.append(bytearray(50 << 20))\n"
    before = psutil.virtual_memory().available
    result = run_python(hog, timeout=10.0, limits=Limits(memory_mb=256), mode=mode)
    assert not result.timed_out and result.returncode != 0
    assert "MemoryError" in result.stderr
    assert psutil.virtual_memory().available > before - (1 << 30)


def test_memory_hog_scores_error(mode):
    with CodeVerifier(num_workers=1, timeout=10.0, memory_limit_mb=256, mode=mode) as v:
        hog = "def f(x):\n    return x\nbig = bytearray(1 << 33)\n"
        assert v.verify(hog, ASSERT_GOLD) == (0.0, "error")


def test_writes_outside_the_run_directory_do_not_land(mode):
    escape = Path(f"/tmp/escape-{uuid.uuid4().hex}")
    # A world-writable directory outside /tmp: only the read-only remount (or the hook) stops it.
    shared = Path(__file__).resolve().parents[2] / f".escape-{uuid.uuid4().hex}"
    shared.mkdir()
    shared.chmod(0o777)
    try:
        code = (
            "import os\n"
            f"for path in ({str(escape)!r}, {str(shared / 'x')!r}):\n"
            "    try:\n"
            "        with open(path, 'w') as f:\n"
            "            f.write('escaped')\n"
            "        print('wrote', path)\n"
            "    except OSError as err:\n"
            "        print('refused', path, type(err).__name__)\n"
            "open('inside.txt', 'w').write('fine')\n"
            "print(open('inside.txt').read())\n"
        )
        result = _run(code, mode)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[-1] == "fine"
        assert not escape.exists()
        assert list(shared.iterdir()) == []
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        escape.unlink(missing_ok=True)


def test_os_system_has_no_effect(mode):
    marker = Path(f"/tmp/escape-system-{uuid.uuid4().hex}")
    code = (
        "import os, subprocess\n"
        "try:\n"
        f"    os.system('touch {marker}')\n"
        "except Exception as err:\n"
        "    print(type(err).__name__)\n"
        "try:\n"
        f"    subprocess.run(['touch', '{marker}'])\n"
        "except Exception as err:\n"
        "    print(type(err).__name__)\n"
    )
    try:
        _run(code, mode)
        assert not marker.exists()
    finally:
        marker.unlink(missing_ok=True)


def test_no_network_to_a_host_listener(mode):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = (
        "import socket\n"
        "for host in ('127.0.0.1', 'localhost'):\n"
        "    try:\n"
        f"        socket.create_connection((host, {port}), timeout=1).sendall(b'escaped')\n"
        "        print('connected')\n"
        "    except Exception as err:\n"
        "        print('refused', type(err).__name__)\n"
    )
    try:
        result = _run(code, mode)
        assert "connected" not in result.stdout
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


def test_parent_environment_secret_is_not_visible(mode, monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("RLVR_TEST_SECRET", secret)
    code = (
        "import os\n"
        f"found = [k for k, v in os.environ.items() if v == {secret!r}]\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n"
        f"        if {secret!r}.encode() in open('/proc/%s/environ' % pid, 'rb').read():\n"
        "            found.append(pid)\n"
        "    except OSError:\n"
        "        pass\n"
        "print('found', found)\n"
        "print(sorted(os.environ))\n"
    )
    result = _run(code, mode)
    assert result.returncode == 0, result.stderr
    assert "found []" in result.stdout
    assert "RLVR_TEST_SECRET" not in result.stdout
    assert secret not in result.stdout + result.stderr


def test_run_directory_is_removed(mode):
    result = _run("import os\nprint(os.getcwd())\n", mode)
    assert result.returncode == 0, result.stderr
    assert not os.path.exists(result.stdout.strip())


UNPRIVILEGED_PROBE = """
import json, os, sys, time, uuid
sys.path.insert(0, {root!r})
from rlvr.verifiers.sandbox import Limits, available_mode, run_python
escape = "/tmp/escape-" + uuid.uuid4().hex
code = '''
import os, socket
out = {{"uid": os.getuid(), "pids": sorted(p for p in os.listdir("/proc") if p.isdigit())}}
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1)
    out["net"] = "connected"
except OSError as err:
    out["net"] = type(err).__name__
for path in (%r, {shared!r}):
    try:
        open(path, "w").write("x")
    except OSError:
        pass
print(__import__("json").dumps(out))
''' % escape
result = run_python(code, timeout=5.0, mode="namespaces")
start = time.monotonic()
loop = run_python("while True: pass", timeout=1.0, mode="namespaces")
print(json.dumps({{"mode": available_mode(), "stdout": result.stdout, "stderr": result.stderr,
                  "escape": os.path.exists(escape), "loop": loop.timed_out,
                  "loop_s": time.monotonic() - start}}))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or not os.path.exists("/usr/bin/python3"),
    reason="needs root and setpriv to run the sandbox as an unprivileged user",
)
def test_unprivileged_caller_gets_a_user_namespace(tmp_path):
    """The sandbox started by an ordinary user (uid 65534): user + network + PID + mount
    namespaces, where this kernel allows unprivileged user namespaces."""
    import subprocess

    # The unprivileged user reads the package from a world-readable copy: the checkout (and
    # pytest's tmp_path) may sit under a directory only its owner can enter.
    copy = Path(tempfile.mkdtemp(prefix="rlvr-sandbox-test-"))
    copy.chmod(0o755)
    shutil.copytree(
        Path(__file__).resolve().parents[2] / "rlvr",
        copy / "rlvr",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    root = str(copy)
    shared = copy / f".escape-{uuid.uuid4().hex}"
    shared.mkdir()
    shared.chmod(0o777)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.5)
    try:
        probe = UNPRIVILEGED_PROBE.format(
            root=root, port=server.getsockname()[1], shared=str(shared / "x")
        )
        done = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
            + ["/usr/bin/python3", "-I", "-c", probe],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
        )
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout.splitlines()[-1])
        if report["mode"] != "namespaces":
            pytest.skip("no unprivileged user namespaces on this kernel")
        out = json.loads(report["stdout"])
        assert out["uid"] == 65534
        assert out["pids"] == ["1", "2"]  # its own PID namespace, seen through its own /proc
        assert out["net"] != "connected"
        assert not report["escape"]
        assert list(shared.iterdir()) == []
        assert report["loop"] and report["loop_s"] < 1.0 + SLACK
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
        shutil.rmtree(copy, ignore_errors=True)


def test_disk_writes_are_bounded(mode):
    """Many big files: each capped by RLIMIT_FSIZE, their total by the private tmpfs (namespaces)
    or the hook's count of files opened for writing."""
    before = shutil.disk_usage("/tmp").free
    code = (
        "import os\n"
        "written = 0\n"
        "for i in range(200):\n"
        "    try:\n"
        "        with open('f%d' % i, 'wb') as f:\n"
        "            f.write(b'x' * (32 << 20))\n"
        "    except (OSError, PermissionError):\n"
        "        pass\n"
        "    try:\n"
        "        written += os.path.getsize('f%d' % i)\n"
        "    except OSError:\n"
        "        pass\n"
        "print(written)\n"
    )
    result = run_python(code, timeout=20.0, limits=Limits(file_mb=4, tmpfs_kb=8192), mode=mode)
    assert not result.timed_out, result.stderr
    written = int(result.stdout.split()[-1]) if result.stdout.strip() else 0
    assert written <= (8 << 20 if mode == "namespaces" else 64 * (4 << 20))
    assert shutil.disk_usage("/tmp").free > before - (512 << 20)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_nested_namespaces_do_not_make_the_filesystem_writable():
    """The program tries a user + mount namespace of its own to remount / read-write."""
    if available_mode() != "namespaces":
        pytest.skip("namespaces mode only")
    marker = Path(__file__).resolve().parents[2] / f".escape-remount-{uuid.uuid4().hex}"
    code = (
        "import subprocess\n"
        f"cmd = 'mount -o remount,rw / ; mount -o remount,rw,bind / ; touch {marker}'\n"
        "r = subprocess.run(['unshare', '-rm', 'sh', '-c', cmd], capture_output=True, text=True)\n"
        "print(r.returncode, r.stderr[-300:])\n"
    )
    try:
        result = _run(code, "namespaces", timeout=10.0)
        assert result.returncode == 0, result.stderr
        assert not marker.exists(), result.stdout
    finally:
        marker.unlink(missing_ok=True)
