"""Run an untrusted Python program in a throw-away sandbox (Linux only; no Ray, no new packages).

Every run is a fresh `python -I -S` (isolated mode, no site: no user site, no venv packages, no
PYTHON* variables) started in its own session and process group, with an empty environment (only
PATH and LANG), a new temporary directory as cwd (deleted afterwards), and resource limits set
before the program starts: RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_FSIZE (largest file written),
RLIMIT_NPROC (processes of the sandbox's uid) and RLIMIT_NOFILE. A wall-clock timeout SIGKILLs
the whole process group.

Isolation, from strongest to weakest; `mode="auto"` takes the first that works here:

* `"namespaces"`: the launcher calls unshare(2) (through ctypes: os.unshare is Python 3.12+) for
  new network, PID, mount, IPC and UTS namespaces, plus a user namespace when not running as root.
  The network namespace has only a loopback that is down: no connection can leave it, not even to
  127.0.0.1 on the host. The launcher forks a reaper that is PID 1 of the new PID namespace and
  dies with the launcher (PR_SET_PDEATHSIG); when PID 1 exits the kernel kills every process in
  the namespace, so nothing survives a run, even a child that called setsid() to leave the process
  group. In the private mount namespace every mount is remounted read-only, and /tmp, /var/tmp and
  /dev/shm get small private tmpfs mounts (Limits.tmpfs_kb each) that vanish with the run; the
  program runs in a copy of the run directory on the private /tmp, so all it can write is bounded
  by those sizes. When the launcher runs as root, the program itself runs under a uid of its own
  (100000 + the launcher's pid, no groups), so RLIMIT_NPROC binds (root is exempt from it) and the
  program can neither signal nor ptrace anything else on the machine; without root the user
  namespace maps the caller's own uid (checked on this machine as uid 65534: the same guarantees
  hold, with the caller's uid in place of one of the run's own).
* `"hook"`: no namespaces (unshare fails: a container without CAP_SYS_ADMIN and with user
  namespaces off). The same limits, the uid switch when root, and a `sys.addaudithook` hook
  installed before the program runs that refuses sockets (connect, bind, sendto, ...), starting
  processes (subprocess, os.system, os.exec*, os.posix_spawn, os.fork), ctypes and opening files
  for writing outside the run's directory (and more than 64 opens for writing: with
  RLIMIT_FSIZE, at most 64 x file_mb on disk). This stops ordinary code and the accidental damage a
  model's solution does; it is NOT a security boundary: a Python-level hook can be got round
  (say, through a C extension already in the stdlib), so against deliberately hostile code only
  the rlimits, the uid switch and the process-group kill hold.

Other options considered: bubblewrap (`bwrap`) would give the same namespaces plus a clean root
filesystem but is not installed here and is a system package; `unshare(1)` from util-linux exists
and `unshare -rn true` works on this machine, but calling unshare(2) directly avoids another exec
and lets the launcher set up mounts and the reaper in one place. seccomp filters would need
libseccomp or a hand-written BPF program: left out.

PID 1 mounts a read-only /proc of the new PID namespace, so the program sees only its own
processes (where the container allows it; else the host's /proc stays, read-only). What `"namespaces"` does not cover: reads (the program can read any file its uid may:
world-readable files, and without root the caller's own files; it has no channel to send them
anywhere but its own output, which the verifier reduces to a verdict); CPU time is bounded per
process by RLIMIT_CPU and overall by the wall timeout; memory per process by RLIMIT_AS (a fork
bomb's processes are bounded by RLIMIT_NPROC, so memory is at most NPROC x AS); no cgroup and no
seccomp filter are used, so the kernel's whole syscall surface is reachable.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

__all__ = ["Limits", "SandboxResult", "available_mode", "run_python"]

MODES = ("auto", "namespaces", "hook")
log = logging.getLogger(__name__)

# The launcher: runs as `python -I -S -c _LAUNCHER <json config>` in the run's directory. It sets
# up isolation, then execs the program (hook mode) or forks a PID-1 reaper that forks the program.
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = (
    0x00020000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
work = os.getcwd()
root = os.geteuid() == 0

def fail(msg):
    os.write(2, ("sandbox: " + msg + "\n").encode())
    os._exit(125)

def mount(src, dst, fstype, flags, data):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        return ctypes.get_errno()
    return 0

def isolate():
    flags = NEWNET | NEWPID | NEWNS | NEWIPC | NEWUTS
    uid, gid = os.getuid(), os.getgid()
    if not root:
        flags |= NEWUSER
    if libc.unshare(flags) != 0:
        fail("unshare failed: errno %d" % ctypes.get_errno())
    if not root:
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write("%d %d 1" % (uid, uid))
        with open("/proc/self/gid_map", "w") as f:
            f.write("%d %d 1" % (gid, gid))
    if mount(None, "/", None, MS_REC | MS_PRIVATE, None):
        fail("cannot make / private")
    with open("main.py", "rb") as f:
        program = f.read()
    opt_flags = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
                 "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        point = fields[4].encode().decode("unicode_escape")
        extra = 0
        for opt in fields[5].split(","):
            extra |= opt_flags.get(opt, 0)
        # Mounts under a path we cannot reach (hidden by another mount) may refuse: the ones that
        # matter are the visible ones, checked below.
        mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra, None)
    for point in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(point):
            err = mount("tmpfs", point, "tmpfs", MS_NOSUID | MS_NODEV, "size=%dk,mode=1777" % cfg["tmpfs_kb"])
            if err:
                fail("cannot mount a tmpfs on %s: errno %d" % (point, err))
    # The program runs in a fresh directory of the new size-limited /tmp, gone with the namespace;
    # the host's run directory stays as it is.
    inner = "/tmp/" + os.path.basename(work)
    os.makedirs(inner, mode=0o700)
    os.chdir(inner)
    with open("main.py", "wb") as f:
        f.write(program)
    for path in ("/", os.path.dirname(sys.executable), os.path.dirname(work.rstrip("/"))):
        if path not in ("/tmp", "/var/tmp") and os.access(path, os.W_OK):
            fail("%s is still writable" % path)

def limit():
    lim = cfg["limits"]
    for name, value in (("RLIMIT_CPU", lim["cpu_s"]), ("RLIMIT_AS", lim["memory_mb"] << 20),
                        ("RLIMIT_FSIZE", lim["file_mb"] << 20), ("RLIMIT_NPROC", lim["nproc"]),
                        ("RLIMIT_NOFILE", lim["nofile"]), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    if root:
        sandbox_uid = cfg["uid"]
        os.chown(".", sandbox_uid, sandbox_uid)  # the run directory (cwd)
        os.setgroups([])
        os.setgid(sandbox_uid)
        os.setuid(sandbox_uid)

def run_program(argv):
    limit()
    os.execv(argv[0], argv)

base = [cfg["python"], "-I", "-S"]
if cfg["mode"] == "hook":
    run_program(base + ["-c", cfg["hook"], "main.py"])
isolate()
reaper = os.fork()
if reaper == 0:
    # PID 1 of the new namespace: dies with the launcher; its exit kills the whole namespace.
    libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    # (Killed before the prctl, the launcher still takes the reaper with it: both are in the process
    # group that the caller SIGKILLs after every run.)
    # A /proc of this PID namespace: the program sees its own processes, not the host's. Some
    # containers refuse it (a /proc with masked paths); the host's /proc then stays, read-only.
    mount("proc", "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    child = os.fork()
    if child == 0:
        run_program(base + ["main.py"])
    while True:
        pid, status = os.wait()
        if pid == child:
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status)
                     else 128 + os.WTERMSIG(status))
_, status = os.waitpid(reaper, 0)
os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
"""

# Hook mode: installed before the program runs; see the module docstring for what it guarantees.
_HOOK = r"""
import os, sys
_work = os.getcwd()
_blocked = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.__new__",
            "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
            "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
            "os.kill", "os.killpg", "os.chdir", "os.symlink", "os.link", "os.rename",
            "os.remove", "os.rmdir", "os.chmod", "os.chown", "shutil.rmtree", "os.truncate",
            "os.mkdir", "sys.addaudithook", "os.putenv", "os.unsetenv", "mmap.__new__"}
def _inside(path):
    try:
        path = os.fsdecode(path) if not isinstance(path, int) else None
    except Exception:
        return False
    if path is None:
        return True
    real = os.path.realpath(os.path.join(_work, path))
    return real == _work or real.startswith(_work + os.sep)
_writes = [0]
def _hook(event, args):
    if event in _blocked:
        if event in ("os.remove", "os.mkdir", "os.rmdir", "os.chmod", "os.truncate") and args \
                and _inside(args[0]):
            return
        raise PermissionError("sandbox: %s is not allowed" % event)
    if event == "open" and len(args) >= 2:
        path, mode = args[0], args[1]
        flags = args[2] if len(args) > 2 else 0
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
        if writing and not _inside(path):
            raise PermissionError("sandbox: writing outside the run directory is not allowed")
        if writing:
            _writes[0] += 1
            if _writes[0] > 64:
                raise PermissionError("sandbox: too many files opened for writing")
sys.addaudithook(_hook)
del _hook
_path = sys.argv[1]
sys.argv = [_path]
with open(_path, "rb") as _f:
    _code = compile(_f.read(), _path, "exec")
exec(_code, {"__name__": "__main__", "__file__": _path, "__builtins__": __builtins__})
"""


@dataclass(frozen=True)
class Limits:
    """Per-run resource limits of the program and everything it starts."""

    cpu_s: int = 10
    memory_mb: int = 512
    file_mb: int = 16
    nproc: int = 32
    nofile: int = 64
    tmpfs_kb: int = 16 * 1024


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None
    """The program's exit status; None when it was killed at the timeout."""
    stdout: str
    stderr: str
    timed_out: bool
    mode: str
    seconds: float


_MAX_OUTPUT = 1 << 20
_mode_cache: str | None = None


def _world_executable(path: str) -> bool:
    """Whether any uid can run the interpreter at `path` (every directory on the way o+x)."""
    path = os.path.realpath(path)
    try:
        if os.stat(path).st_mode & 0o005 != 0o005:
            return False
        parent = os.path.dirname(path)
        while True:
            if not os.stat(parent).st_mode & 0o001:
                return False
            if parent == "/":
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


def program_python() -> str:
    """The interpreter that runs the program: this one, unless the sandbox's own uid (when
    running as root) cannot reach it (say, a pyenv build under /root), then the system python3.
    The program runs with -I -S, so only the standard library matters."""
    if os.geteuid() != 0 or _world_executable(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if _world_executable(candidate):
            return candidate
    raise RuntimeError("no Python interpreter that the sandbox user can run")


def available_mode() -> str:
    """The strongest isolation that works on this machine: "namespaces" or "hook" (cached)."""
    global _mode_cache
    if _mode_cache is None:
        probe = _run("print('ok')", "", 30.0, Limits(), "namespaces")
        _mode_cache = (
            "namespaces" if probe.returncode == 0 and probe.stdout.strip() == "ok" else "hook"
        )
        if _mode_cache == "hook":
            log.warning(
                "code sandbox: no namespaces here (%s); falling back to the audit-hook mode, "
                "which is no security boundary against deliberately hostile code",
                probe.stderr.strip()[-300:] or f"exit status {probe.returncode}",
            )
    return _mode_cache


def run_python(
    code: str, stdin: str = "", timeout: float = 5.0, limits: Limits | None = None, mode="auto"
) -> SandboxResult:
    """Run `code` as `main.py` in a fresh sandbox; returns within about `timeout` seconds.

    stdout and stderr are each cut to their first MiB. A result with `timed_out` was SIGKILLed
    (with its whole process group, and in "namespaces" mode its whole PID namespace).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    if sys.platform != "linux":
        raise RuntimeError("the code sandbox needs Linux")
    return _run(
        code, stdin, timeout, limits or Limits(), available_mode() if mode == "auto" else mode
    )


def _run(code: str, stdin: str, timeout: float, limits: Limits, mode: str) -> SandboxResult:
    start = time.monotonic()
    work = tempfile.mkdtemp(prefix="rlvr-sandbox-")
    try:
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        cfg = {
            "mode": mode,
            "hook": _HOOK,
            "tmpfs_kb": limits.tmpfs_kb,
            "limits": {
                "cpu_s": limits.cpu_s,
                "memory_mb": limits.memory_mb,
                "file_mb": limits.file_mb,
                "nproc": limits.nproc,
                "nofile": limits.nofile,
            },
            "python": program_python(),
            "uid": -1,  # set by _LAUNCHER_PREFIX from the launcher's own pid
        }
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _LAUNCHER_PREFIX + _LAUNCHER, json.dumps(cfg)],
            cwd=work,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
        )
        timed_out = False
        try:
            out, err = proc.communicate(stdin.encode("utf-8"), timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            try:
                out, err = proc.communicate(timeout=5.0)
            except subprocess.TimeoutExpired:  # a stray process still holds the pipes
                out, err = b"", b""
        finally:
            _kill_group(proc.pid)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return SandboxResult(
            returncode=None if timed_out else proc.returncode,
            stdout=out[:_MAX_OUTPUT].decode("utf-8", "replace"),
            stderr=err[:_MAX_OUTPUT].decode("utf-8", "replace"),
            timed_out=timed_out,
            mode=mode,
            seconds=time.monotonic() - start,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


# Fills in the sandbox uid from the launcher's own pid (unique while the run lives).
_LAUNCHER_PREFIX = "import os as _o, sys as _s, json as _j\n" + (
    "_c = _j.loads(_s.argv[1]); _c['uid'] = 100000 + _o.getpid(); _s.argv[1] = _j.dumps(_c)\n"
)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
