"""Run an untrusted Python program in a throw-away sandbox with bounded time, memory and output
(Linux only; no Ray, no new packages). `run_python` runs one to completion; `Sandbox` keeps one
running for a conversation on its stdin and stdout (the code verifier's tests talk to a solution
that way, and tools can). Both give back a `SandboxResult`: exit status, bounded stdout and
stderr, whether it timed out.

Every run is a fresh `python -I -S` (isolated mode, no site: no user site, no venv packages, no
PYTHON* variables) in its own session and process group, with an empty environment (only PATH and
LANG), a new temporary directory as cwd (deleted afterwards), and resource limits (`Limits`):

* Time: one deadline for the whole run, start to last byte read. At the deadline every process of
  the run is SIGKILLed and the result is `timed_out`, whatever it was doing (a program flooding
  its output included); each process also has RLIMIT_CPU. The run also dies with the thread
  that started it (PR_SET_PDEATHSIG): a caller killed mid-run leaves nothing running.
* Output: stdout and stderr are read in 64 KiB chunks as they come; the first `output_kb` of each
  is kept and the rest read and dropped (`truncated`), so the caller's memory does not grow with
  what the program writes.
* Memory, for all of the run's processes together: a memory cgroup of `memory_mb` per run where
  one can be made (rlvr.verifiers.cgroup; the launcher's own ~10 MB count too), plus RLIMIT_AS of
  `memory_mb` per process, so that one big allocation is a MemoryError rather than a kill. Where
  no cgroup can be made, the processes share `memory_mb` through rlimits: at most
  n = min(nproc, memory_mb // MIN_PROCESS_MB) processes (RLIMIT_NPROC; threads count) of
  memory_mb / n address space each (RLIMIT_AS). `memory_control()` says which holds here.
* Disk: RLIMIT_FSIZE per file; in namespaces mode all writes land on two private tmpfs mounts
  of `tmpfs_kb` each (memory, so counted by the cgroup too), in hook mode at most 64 files are
  opened for writing. Processes: RLIMIT_NPROC (under root the program runs as a uid of its own,
  100000 + the launcher's pid, so the count is the run's alone); open files: RLIMIT_NOFILE.

Isolation, `mode`:

* `"namespaces"`: the launcher calls unshare(2) (through ctypes: os.unshare is Python 3.12+) for
  new network, PID, mount, IPC and UTS namespaces, plus a user namespace when not running as root.
  The network namespace has only a loopback that is down: no connection can leave it, not even to
  127.0.0.1 on the host. A reaper is PID 1 of the new PID namespace and dies with the launcher
  (PR_SET_PDEATHSIG); when it exits the kernel kills every process in the namespace, so nothing
  survives a run. The program sees a root filesystem of its own: a tmpfs holding read-only binds
  of the system directories (/usr, /etc, /bin, /lib*, /sbin) and of the interpreter's prefix,
  /dev/null, zero, full, random and urandom, private tmpfs mounts on /tmp (its directory) and
  /dev/shm, and a /proc of its own PID namespace (where the container allows one; else none). The
  launcher pivots into it and detaches the old root, so no path leads back to the host's files
  (not through a nested user namespace either, which a chroot would allow): the run directories
  of other runs, the user's data and datasets, the verifier's own files are not there to read.
* `"hook"`: no namespaces (unshare fails: a container without CAP_SYS_ADMIN and with user
  namespaces off). The same rlimits, cgroup and uid switch, and an audit hook
  (`sys.addaudithook`) in the program's own interpreter that refuses sockets, new processes,
  ctypes and writes outside its directory. That hook is NOT a boundary against a program that
  means to get round it: it lives in the interpreter the program controls (its state can be
  reached from `sys.modules['__main__']`; `os.open(..., dir_fd=)` and
  `_posixsubprocess.fork_exec` raise no event it checks), and the program sees the host's files
  and, through /proc, every host process's command line. Hardening it piece by piece would only
  move the bypass. So it is never chosen silently: `mode="auto"` (the default) takes namespaces
  and raises `SandboxUnavailable` where they do not work, unless the caller passes
  `unsafe_hook=True` (`verifier.unsafe_hook_sandbox: true` in a training config), or names
  `mode="hook"` itself.

Other options considered: bubblewrap (`bwrap`) would give the same namespaces but is a system
package not installed here; seccomp filters would need libseccomp or a hand-written BPF program:
left out, so the kernel's whole syscall surface stays reachable from inside the namespaces.
What `"namespaces"` does not hide: the system directories listed above (world-readable files of
the OS and the Python install), and the CPU (bounded per process by RLIMIT_CPU and overall by
the deadline; no CPU share is set).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from rlvr.verifiers.cgroup import MemoryCgroup, hierarchy

__all__ = [
    "Limits",
    "Sandbox",
    "SandboxResult",
    "SandboxUnavailable",
    "available_mode",
    "memory_control",
    "run_python",
]

MODES = ("auto", "namespaces", "hook")
MIN_PROCESS_MB = 64
"""Address space each process keeps where rlimits alone share the memory: Python starts in ~32."""
CHUNK = 1 << 16
EXIT_GRACE_S = 1.0
"""After the program exits, how long output still in the pipes is read (within the deadline)."""
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
"""What the namespaces mode's root holds of the host, read-only (with the interpreter's prefix)."""

log = logging.getLogger(__name__)

# The launcher: runs as `python -I -S -c _LAUNCHER <json config>` in the run's directory. It joins
# the run's cgroup, sets up isolation, then execs the program (hook mode) or forks a PID-1 reaper
# that moves into the new root and forks the program.
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = (
    0x00020000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH, PR_SET_PDEATHSIG = 2, 1
# Dies with the thread that started it, so nothing outlives a caller that is killed.
libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
if os.getppid() != cfg["parent"]:
    os._exit(125)
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
OPT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
             "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
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

def join_cgroup():
    if cfg["cgroup"]:
        with open(cfg["cgroup"], "w") as f:
            f.write(str(os.getpid()))

def readonly_below(top, keep):
    # Remounts keep the flags a user namespace locks (nosuid, nodev, ...), else they are refused.
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        point = fields[4].encode().decode("unicode_escape")
        if point in keep or not (point == top or point.startswith(top + "/")):
            continue
        extra = 0
        for opt in fields[5].split(","):
            extra |= OPT_FLAGS.get(opt, 0)
        err = mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra, None)
        if err:
            fail("cannot make %s read-only: errno %d" % (point, err))

def build_root(new):
    # A tmpfs over the run directory (in this mount namespace only) becomes the program's root.
    if mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1024k,mode=755"):
        fail("cannot mount the new root")
    for path in cfg["binds"]:
        target = new + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(path):
            os.symlink(os.readlink(path), target)
        elif os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
            err = mount(path, target, None, MS_BIND | MS_REC, None)
            if err:
                fail("cannot bind %s: errno %d" % (path, err))
    os.makedirs(new + "/dev/shm")
    for name in ("null", "zero", "full", "random", "urandom"):
        open(new + "/dev/" + name, "w").close()
        if mount("/dev/" + name, new + "/dev/" + name, None, MS_BIND, None):
            fail("cannot bind /dev/" + name)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink("/proc/self/fd/%d" % i, new + "/dev/" + name)
    os.symlink("/proc/self/fd", new + "/dev/fd")
    os.makedirs(new + "/proc")
    writable = []
    for point in ("/tmp", "/dev/shm"):
        os.makedirs(new + point, exist_ok=True)
        size = "size=%dk,mode=1777" % cfg["tmpfs_kb"]
        err = mount("tmpfs", new + point, "tmpfs", MS_NOSUID | MS_NODEV, size)
        if err:
            fail("cannot mount a tmpfs on %s: errno %d" % (point, err))
        writable.append(new + point)
    readonly_below(new, writable)

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
    build_root(work)

def enter_root(program):
    # In the reaper, PID 1 of the new namespace: a /proc of this namespace (some containers refuse
    # one: then there is none), then the new root with the old one detached.
    mount("proc", work + "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        fail("no pivot_root number for " + os.uname().machine)
    os.chdir(work)
    if libc.syscall(number, b".", b".") != 0:
        fail("pivot_root failed: errno %d" % ctypes.get_errno())
    if libc.umount2(b".", MNT_DETACH) != 0:
        fail("cannot detach the old root: errno %d" % ctypes.get_errno())
    os.chdir("/")
    os.mkdir("/tmp/run", 0o700)
    os.chdir("/tmp/run")
    with open("main.py", "wb") as f:
        f.write(program)
    for path in ("/", os.path.dirname(cfg["python"])):
        if os.access(path, os.W_OK):
            fail("%s is still writable" % path)

def limit():
    lim = cfg["limits"]
    for name, value in (("RLIMIT_CPU", lim["cpu_s"]), ("RLIMIT_AS", lim["as_bytes"]),
                        ("RLIMIT_FSIZE", lim["file_mb"] << 20), ("RLIMIT_NPROC", lim["nproc"]),
                        ("RLIMIT_NOFILE", lim["nofile"]), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))
    if root:
        sandbox_uid = cfg["uid"]
        os.chown(".", sandbox_uid, sandbox_uid)  # the run directory (cwd)
        os.setgroups([])
        os.setgid(sandbox_uid)
        os.setuid(sandbox_uid)
        libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # a change of uid cleared it

def run_program(argv):
    limit()
    os.execv(argv[0], argv)

join_cgroup()
base = [cfg["python"], "-I", "-S"]
if cfg["mode"] == "hook":
    run_program(base + ["-c", cfg["hook"], "main.py"])
with open("main.py", "rb") as f:
    program = f.read()
isolate()
reaper = os.fork()
if reaper == 0:
    # Dies with the launcher; its exit kills the whole namespace. (Killed before the prctl, the
    # launcher still takes the reaper with it: both are in the process group the caller kills.)
    libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    enter_root(program)
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

# Fills in the sandbox uid from the launcher's own pid (unique while the run lives).
_LAUNCHER_PREFIX = "import os as _o, sys as _s, json as _j\n" + (
    "_c = _j.loads(_s.argv[1]); _c['uid'] = 100000 + _o.getpid(); _s.argv[1] = _j.dumps(_c)\n"
)

# Hook mode: installed before the program runs; see the module docstring for what it does not stop.
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


class SandboxUnavailable(RuntimeError):
    """No isolation a run may use here: namespaces do not work and the audit-hook mode, which
    does not stop a determined program, was not allowed."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one run: the program and every process it starts."""

    cpu_s: int = 10
    """CPU seconds of each process (RLIMIT_CPU); the run's timeout bounds it as a whole."""
    memory_mb: int = 512
    """Memory of all the run's processes together (see the module docstring for how)."""
    file_mb: int = 16
    """Largest file the program writes (RLIMIT_FSIZE)."""
    nproc: int = 32
    """Processes and threads (RLIMIT_NPROC; fewer where rlimits alone bound memory)."""
    nofile: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    tmpfs_kb: int = 16 * 1024
    """Size of each private tmpfs (/tmp, /dev/shm) in namespaces mode."""
    output_kb: int = 1024
    """The most of stdout, and of stderr, that is kept; the rest is read and dropped."""


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None
    """The program's exit status; None when it was killed at the timeout."""
    stdout: str
    stderr: str
    timed_out: bool
    mode: str
    seconds: float
    truncated: bool = False
    """The program wrote more than `Limits.output_kb` on stdout or stderr (the rest dropped)."""
    stdout_truncated: bool = False
    """The program wrote more than `Limits.output_kb` on stdout: `stdout` is not all of it."""


_mode_cache: dict[str, str] = {}


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
    """The interpreter that runs the program (a real path, no symlink): this one, unless the
    sandbox's own uid (when running as root) cannot reach it (say, a pyenv build under /root),
    then the system python3. The program runs with -I -S, so only the standard library matters."""
    if os.geteuid() != 0 or _world_executable(sys.executable):
        return os.path.realpath(sys.executable)
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if _world_executable(candidate):
            return os.path.realpath(candidate)
    raise RuntimeError("no Python interpreter that the sandbox user can run")


def _binds(python: str) -> list[str]:
    """The host paths the namespaces mode's root holds: SYSTEM_DIRS and the interpreter's
    prefix (and this interpreter's base prefix when it runs the program: a venv's home)."""
    paths = [p for p in SYSTEM_DIRS if os.path.lexists(p)]
    prefixes = [os.path.dirname(os.path.dirname(python))]
    if python == os.path.realpath(sys.executable):
        prefixes.append(os.path.realpath(sys.base_prefix))
    for prefix in prefixes:
        covered = any(prefix == p or prefix.startswith(p + "/") for p in paths)
        if prefix not in ("", "/") and not covered:
            paths.append(prefix)
    return paths


def available_mode() -> str:
    """The strongest isolation that works on this machine: "namespaces" or "hook" (cached)."""
    if "mode" not in _mode_cache:
        with Sandbox("print('ok')", 30.0, mode="namespaces") as box:
            probe = box.wait()
        works = probe.returncode == 0 and probe.stdout.strip() == "ok"
        _mode_cache["mode"] = "namespaces" if works else "hook"
        _mode_cache["why"] = probe.stderr.strip()[-300:] or f"exit status {probe.returncode}"
    return _mode_cache["mode"]


def resolve_mode(mode: str, unsafe_hook: bool = False) -> str:
    """The isolation a run in `mode` gets: "auto" is namespaces, or the audit hook only when
    `unsafe_hook` allows it (else SandboxUnavailable)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    if mode != "auto":
        return mode
    if available_mode() == "namespaces":
        return "namespaces"
    if not unsafe_hook:
        raise SandboxUnavailable(
            f"code sandbox: namespaces do not work here ({_mode_cache['why']}); the only other "
            "isolation, an audit hook inside the program's own interpreter, does not stop a "
            "program that means to get round it (a policy under training does). Run where "
            "unshare(2) works (root, or unprivileged user namespaces), or accept the risk with "
            "verifier.unsafe_hook_sandbox: true (docs/guides/bring-your-own.md, 'Code rewards')"
        )
    log.warning(
        "code sandbox: no namespaces here (%s); running code under the audit-hook mode, "
        "which is no boundary against deliberately hostile code",
        _mode_cache["why"],
    )
    return "hook"


def memory_control() -> str:
    """How a run's memory is bounded here: "cgroup v1" / "cgroup v2" or "rlimit"."""
    where = hierarchy()
    return "rlimit" if where is None else f"cgroup v{where.version}"


class Sandbox:
    """`code` running as `main.py` in a fresh sandbox until `timeout` seconds from now: `send`
    writes to its stdin, `read_line` takes a line of its stdout, `wait` lets it finish. Every
    call returns by the deadline; leaving the `with` block (or `close`) kills what is left, and
    so does the end of the thread that started it (its process's death included): use it from
    that thread. `mode` and `unsafe_hook`: see the module docstring."""

    def __init__(
        self,
        code: str,
        timeout: float = 5.0,
        limits: Limits | None = None,
        mode: str = "auto",
        unsafe_hook: bool = False,
    ):
        if sys.platform != "linux":
            raise RuntimeError("the code sandbox needs Linux")
        self.limits = limits or Limits()
        self.mode = resolve_mode(mode, unsafe_hook)
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.truncated = False
        self.stdout_truncated = False
        self._work = tempfile.mkdtemp(prefix="rlvr-sandbox-")
        self._cgroup: MemoryCgroup | None = None
        self._proc: subprocess.Popen | None = None
        self._pidfd: int | None = None
        self._returncode: int | None = None
        self._exited_at = 0.0
        self._pending = bytearray()
        try:
            with open(os.path.join(self._work, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            where = hierarchy()
            if where is not None:
                self._cgroup = MemoryCgroup(where, self.limits.memory_mb << 20)
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _LAUNCHER_PREFIX + _LAUNCHER, self._config()],
                cwd=self._work,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            self.close()
            raise
        self._stdin: int | None = self._proc.stdin.fileno()
        self._stdout = self._proc.stdout.fileno()
        self._out = {self._stdout: bytearray(), self._proc.stderr.fileno(): bytearray()}
        self._open = set(self._out)
        for fd in (self._stdin, *self._out):
            os.set_blocking(fd, False)
        with contextlib.suppress(OSError, AttributeError):  # pidfds: Linux 5.3+
            self._pidfd = os.pidfd_open(self._proc.pid)

    def _config(self) -> str:
        lim = self.limits
        if self._cgroup is not None:
            as_bytes, nproc = lim.memory_mb << 20, lim.nproc
        else:
            nproc = max(1, min(lim.nproc, lim.memory_mb // MIN_PROCESS_MB))
            as_bytes = (lim.memory_mb << 20) // nproc
        python = program_python()
        return json.dumps(
            {
                "mode": self.mode,
                "hook": _HOOK,
                "python": python,
                "binds": _binds(python),
                "cgroup": None if self._cgroup is None else self._cgroup.procs,
                "tmpfs_kb": lim.tmpfs_kb,
                "limits": {
                    "cpu_s": lim.cpu_s,
                    "as_bytes": as_bytes,
                    "file_mb": lim.file_mb,
                    "nproc": nproc,
                    "nofile": lim.nofile,
                },
                "uid": -1,  # set by _LAUNCHER_PREFIX from the launcher's own pid
                "parent": os.getpid(),
            }
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def _step(self, wait_s: float) -> None:
        """One round of moving bytes: write pending stdin, read what stdout and stderr hold,
        notice the exit; waits at most `wait_s` for something to happen."""
        poller = select.poll()
        for fd in self._open:
            poller.register(fd, select.POLLIN)
        if self._pending and self._stdin is not None:
            poller.register(self._stdin, select.POLLOUT)
        if self._pidfd is not None and self._returncode is None:
            poller.register(self._pidfd, select.POLLIN)
        else:
            wait_s = min(wait_s, 0.05)  # no pidfd: notice the exit by polling
        for fd, _ in poller.poll(max(0.0, wait_s) * 1000):
            if fd == self._stdin:
                self._write()
            elif fd in self._open:
                self._read(fd)
        if self._returncode is None and self._proc.poll() is not None:
            self._returncode = self._proc.returncode
            self._exited_at = time.monotonic()
            self._kill()  # whatever it left behind (hook mode: a process that left the group)

    def _read(self, fd: int) -> None:
        try:
            chunk = os.read(fd, CHUNK)
        except BlockingIOError:
            return
        if not chunk:
            self._open.discard(fd)
            return
        kept = self._out[fd]
        room = (self.limits.output_kb << 10) - len(kept)
        if room > 0:
            kept += chunk[:room]
        if len(chunk) > room:
            self.truncated = True
            self.stdout_truncated = self.stdout_truncated or fd == self._stdout

    def _write(self) -> None:
        try:
            written = os.write(self._stdin, self._pending[:CHUNK])
        except BlockingIOError:
            return
        except OSError:  # the program closed its stdin or exited
            self._pending.clear()
            self.close_stdin()
            return
        del self._pending[:written]

    def send(self, data: bytes) -> bool:
        """Write `data` to the program's stdin (reading its output meanwhile); False when it
        closed its stdin or the deadline came first."""
        if self._stdin is None:
            return False
        self._pending += data
        while self._pending and self._stdin is not None and not self.expired():
            self._step(self.deadline - time.monotonic())
        return not self._pending and self._stdin is not None

    def read_line(self, max_bytes: int | None = None) -> bytes | None:
        """The next line of stdout without its newline; None at the end of stdout, the deadline,
        or past `max_bytes` (default: `Limits.output_kb`) without a newline."""
        limit = self.limits.output_kb << 10 if max_bytes is None else max_bytes
        kept = self._out[self._stdout]
        while True:
            end = kept.find(b"\n", 0, limit + 1)
            if end >= 0:
                line = bytes(kept[:end])
                del kept[: end + 1]
                return line
            if len(kept) >= limit or self._stdout not in self._open or self.expired():
                return None
            self._step(self.deadline - time.monotonic())

    def close_stdin(self) -> None:
        """Give the program end-of-file on stdin (what is not written yet is dropped)."""
        if self._stdin is not None:
            self._stdin = None
            self._pending.clear()
            with contextlib.suppress(OSError):
                self._proc.stdin.close()

    def wait(self) -> SandboxResult:
        """Let the program finish (stdin closed) and return its result; at the deadline it is
        killed and the result `timed_out`. The sandbox is closed afterwards."""
        self.close_stdin()
        while True:
            now = time.monotonic()
            if self._returncode is not None and (
                not self._open or now >= self._exited_at + EXIT_GRACE_S
            ):
                break
            if now >= self.deadline:
                break
            until = self.deadline
            if self._returncode is not None:
                until = min(until, self._exited_at + EXIT_GRACE_S)
            self._step(until - now)
        timed_out = self._returncode is None
        self.close()
        out, err = self._out.values()
        return SandboxResult(
            returncode=self._returncode,
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            timed_out=timed_out,
            mode=self.mode,
            seconds=time.monotonic() - self.started,
            truncated=self.truncated,
            stdout_truncated=self.stdout_truncated,
        )

    def _kill(self) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        if self._cgroup is not None:
            self._cgroup.kill()

    def close(self) -> None:
        """Kill every process of the run and delete its directory and cgroup (idempotent)."""
        self._kill()
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
                with contextlib.suppress(OSError):
                    pipe.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        if self._cgroup is not None:
            self._cgroup.remove()
            self._cgroup = None
        shutil.rmtree(self._work, ignore_errors=True)
        self._stdin = None


def run_python(
    code: str,
    stdin: str = "",
    timeout: float = 5.0,
    limits: Limits | None = None,
    mode: str = "auto",
    unsafe_hook: bool = False,
) -> SandboxResult:
    """Run `code` as `main.py` in a fresh sandbox with `stdin` as its input; returns within about
    `timeout` seconds. A result with `timed_out` was SIGKILLed with every process it started."""
    with Sandbox(code, timeout, limits, mode, unsafe_hook) as box:
        box.send(stdin.encode("utf-8"))
        return box.wait()
