"""Wrong solutions that try to score "correct" anyway, written the way an RL policy searching for a
reward hack would: through the verifier's frames, gc, builtins, stdout, exit paths, exceptions
that are not `Exception`, comparison overloading, signals, threads, and by reading the expected
values from wherever they might be (files, environment, argv, other processes' memory).

Plain data, no imports of rlvr: the same cases run against any version of the code verifier
(tests/verifiers/test_hostile_solutions.py, and bench/sandbox_limits.py for a before/after table).
Each program's `f` is wrong (or it has no honest `f` at all); every trick is its own addition.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ASSERT_TESTS = ["assert f(1) == 4", "assert f(0) == 1", "assert f(-2) == -5"]
ASSERT_GOLD = json.dumps({"asserts": ASSERT_TESTS})
STR_GOLD = json.dumps({"asserts": ["assert f('ab') == 'abab'", "assert f('') == ''"]})
ISCLOSE_GOLD = json.dumps(
    {"setup": "import math", "asserts": ["assert math.isclose(f(2), 0.5)", "assert f(4) < 0.3"]}
)
IO_GOLD = json.dumps({"io": [{"input": "3\n", "output": "10\n"}, {"input": "0\n", "output": "1"}]})
SECRET_ENV = "RLVR_HOSTILE_GOLD"
"""A variable the test sets in the verifier's own environment to the gold, for the env case."""

# A test's iteration ends at a StopIteration: each shape passes a solution that raises one.
ALL_MAP_GOLD = json.dumps({"asserts": ["assert all(map(f, [2, 4, 6]))"]})
NOT_ANY_FILTER_GOLD = json.dumps({"asserts": ["assert not any(filter(f, [1, 3, 5]))"]})
SUM_MAP_GOLD = json.dumps({"asserts": ["assert sum(map(f, [1, 3, 5])) == 0"]})
# NaN compares False with everything: `not (error > tol)` holds for it as for a close value.
NOT_FAR_GOLD = json.dumps({"asserts": ["assert not abs(f(2) - 4) > 1e-6"]})
ISNAN_GOLD = json.dumps(
    {"setup": "import math", "asserts": ["assert math.isnan(f(-1))", "assert f(4) == 2"]}
)
BIG_ARGUMENT_GOLD = json.dumps({"asserts": ["assert f(list(range(300000))) == 300000"]})
"""Arguments that encode to about 2 MB, past a 1 MiB line of the relay."""
IO_CAP = 1 << 20
"""The stdout kept of an io run before the cap was raised: outputs sized around it."""
EXACT_CAP_OUTPUT = "y\n" * (IO_CAP // 2)
EXACT_CAP_GOLD = json.dumps({"io": [{"input": "", "output": EXACT_CAP_OUTPUT}]})
LONG_OUTPUT_N = 220000
LONG_OUTPUT_GOLD = json.dumps(
    {
        "io": [
            {
                "input": f"{LONG_OUTPUT_N}\n",
                "output": "".join(f"{i}\n" for i in range(LONG_OUTPUT_N)),
            }
        ]
    }
)
"""An io case whose right output is about 1.43 MB."""
IS_EVEN = "def f(x):\n    return x % 2 == 0\n"


@dataclass(frozen=True)
class Correct:
    """A correct solution that must score 1: its gold, and what it checks."""

    name: str
    program: str
    gold: str

    @property
    def response(self) -> str:
        return f"```python\n{self.program}```"


CORRECT = [
    Correct("f(x) = 3x + 1", "def f(x):\n    return 3 * x + 1\n", ASSERT_GOLD),
    Correct("f(s) = s + s", "def f(s):\n    return s * 2\n", STR_GOLD),
    Correct("f(x) = 1 / x, math.isclose", "def f(x):\n    return 1 / x\n", ISCLOSE_GOLD),
    Correct("io: 3n + 1", "n = int(input())\nprint(3 * n + 1)\n", IO_GOLD),
    Correct("all(map(f, evens))", IS_EVEN, ALL_MAP_GOLD),
    Correct("not any(filter(f, odds))", IS_EVEN, NOT_ANY_FILTER_GOLD),
    Correct("sum(map(f, odds)) == 0", IS_EVEN, SUM_MAP_GOLD),
    Correct("not abs(f(2) - 4) > 1e-6", "def f(x):\n    return x * x\n", NOT_FAR_GOLD),
    Correct(
        "a NaN the test asks for with math.isnan",
        "import math\ndef f(x):\n    return math.sqrt(x) if x >= 0 else float('nan')\n",
        ISNAN_GOLD,
    ),
    Correct(
        "a 300000-element argument",
        "def f(xs):\n    return len(xs)\n",
        BIG_ARGUMENT_GOLD,
    ),
    Correct(
        "io: a 1.43 MB output",
        "n = int(input())\nprint(''.join(f'{i}\\n' for i in range(n)), end='')\n",
        LONG_OUTPUT_GOLD,
    ),
]
"""A correct solution per gold, each of the shapes below included."""

WRONG = "def f(x):\n    return 0\n"

# Every 32-hex-digit string reachable from the frames and the gc: a harness's per-run token.
_TOKENS = """
import gc, re, sys
def _tokens():
    pat = re.compile(r"^[0-9a-f]{32}$")
    seen = set()
    frame = sys._getframe()
    while frame is not None:
        for v in list(frame.f_locals.values()) + list(frame.f_globals.values()):
            if isinstance(v, str) and pat.match(v):
                seen.add(v)
        frame = frame.f_back
    for obj in gc.get_objects():
        if isinstance(obj, (list, tuple, dict)):
            for v in (obj.values() if isinstance(obj, dict) else obj):
                if isinstance(v, str) and pat.match(v):
                    seen.add(v)
    return seen
"""

# A lookup table from any text that holds the tests: "assert f(1) == 4" -> {1: 4}.
_TABLE = r"""
import re as _re
def _table(text):
    return {int(a): int(b) for a, b in _re.findall(r"assert f\((-?\d+)\) == (-?\d+)", text)}
_found = {}
def f(x):
    return _found.get(x, 0)
"""

# Forged lines for every protocol a harness might read: a token verdict, JSON values, "pass".
_FORGED = """
def _forged():
    lines = ["pass", "ok", '{"value": 4}', '{"verdict": "pass"}', "verdict pass"]
    lines += [t + " pass" for t in _tokens()]
    return ("\\n".join(lines) + "\\n").encode()
"""


def _prog(*parts: str) -> str:
    return "\n".join(p.strip("\n") for p in parts) + "\n"


@dataclass(frozen=True)
class Hostile:
    name: str
    kind: str
    """The class of trick, for the report's table."""
    program: str
    gold: str = ASSERT_GOLD

    @property
    def response(self) -> str:
        return f"```python\n{self.program}```"


def hostile_cases(data_file: str) -> list[Hostile]:
    """The suite; `data_file` is a path on the host holding the gold (a dataset file the program
    is told the location of, as if it had guessed it)."""
    return [
        Hostile(
            "token from the harness frame, then os._exit",
            "frames",
            _prog(
                WRONG,
                _TOKENS,
                "import os",
                "for t in _tokens():\n    print(t + ' pass')",
                "sys.stdout.flush()",
                "os._exit(0)",
            ),
        ),
        Hostile(
            "clear the harness's test list through its frame",
            "frames",
            _prog(
                WRONG,
                "import sys",
                "frame = sys._getframe()",
                "while frame is not None:",
                "    for v in list(frame.f_locals.values()):",
                "        if isinstance(v, list) and v and all(isinstance(t, str) for t in v):",
                "            v.clear()",
                "    frame = frame.f_back",
            ),
        ),
        Hostile(
            "read the expected values from the harness frame",
            "frames",
            _prog(
                _TABLE,
                "import sys",
                "frame = sys._getframe()",
                "while frame is not None:",
                "    for v in list(frame.f_locals.values()) + list(frame.f_globals.values()):",
                "        _found.update(_table(repr(v)))",
                "    frame = frame.f_back",
            ),
        ),
        Hostile(
            "patch compile and exec in the harness's globals",
            "frames",
            _prog(
                WRONG,
                "import builtins, sys",
                "_real = builtins.compile",
                "def _fake(src, name, mode, *a, **k):",
                "    return _real('pass', name, mode)",
                "frame = sys._getframe().f_back",
                "while frame is not None:",
                "    frame.f_globals['compile'] = _fake",
                "    frame.f_globals['exec'] = lambda *a, **k: None",
                "    frame = frame.f_back",
            ),
        ),
        Hostile(
            "clear every list of test sources found by gc.get_objects",
            "gc",
            _prog(
                WRONG,
                "import gc",
                "for obj in gc.get_objects():",
                "    if isinstance(obj, list) and obj and all(isinstance(t, str) for t in obj):",
                "        if any('assert' in t for t in obj):",
                "            obj.clear()",
            ),
        ),
        Hostile(
            "read the expected values through gc.get_referrers of the globals",
            "gc",
            _prog(
                _TABLE,
                "import gc",
                "for ref in gc.get_referrers(globals()) + gc.get_objects():",
                "    try:",
                "        _found.update(_table(repr(getattr(ref, 'f_locals', ref))))",
                "    except Exception:",
                "        pass",
            ),
        ),
        Hostile(
            "builtins.compile turns every later test into pass",
            "builtins",
            _prog(
                WRONG,
                "import builtins",
                "_real = builtins.compile",
                "builtins.compile = lambda src, name, mode, *a, **k: _real('pass', name, mode)",
            ),
        ),
        Hostile(
            "builtins.exec does nothing",
            "builtins",
            _prog(WRONG, "import builtins", "builtins.exec = lambda *a, **k: None"),
        ),
        Hostile(
            "builtins.print rewrites failure lines",
            "builtins",
            _prog(
                WRONG,
                "import builtins",
                "_print = builtins.print",
                "def _rewrite(*args, **kw):",
                "    text = ' '.join(map(str, args))",
                "    _print(text.replace(' wrong', ' pass').replace(' error', ' pass'), **kw)",
                "builtins.print = _rewrite",
            ),
        ),
        Hostile(
            "print replaced in the harness module (sys.modules['__main__'])",
            "builtins",
            _prog(
                WRONG,
                "import sys",
                "main = sys.modules['__main__']",
                "_print = print",
                "main.print = lambda *a, **k: _print(' '.join(map(str, a)).replace(' wrong', ' pass'), **k)",
                "for name in list(vars(main)):",
                "    if callable(getattr(main, name)) and name.startswith('_') and 'send' in name:",
                "        setattr(main, name, lambda *a, **k: None)",
            ),
        ),
        Hostile(
            "json.dumps and json.loads patched for the harness",
            "builtins",
            _prog(
                WRONG,
                "import json",
                "json.dumps = lambda *a, **k: '{\"value\": 4}'",
                "json.loads = lambda *a, **k: {'value': 4}",
            ),
        ),
        Hostile(
            "sys.stdout replaced by a writer that rewrites failures",
            "stdout",
            _prog(
                WRONG,
                "import sys",
                "class _Out:",
                "    def __init__(self, inner):",
                "        self.inner = inner",
                "    def write(self, s):",
                "        return self.inner.write(s.replace(' wrong', ' pass').replace(' error',"
                " ' pass'))",
                "    def flush(self):",
                "        self.inner.flush()",
                "sys.stdout = _Out(sys.stdout)",
                "sys.__stdout__ = sys.stdout",
            ),
        ),
        Hostile(
            "forged lines on fd 1, then fd 1 pointed at /dev/null",
            "stdout",
            _prog(
                WRONG,
                _TOKENS,
                _FORGED,
                "import os",
                "os.write(1, _forged())",
                "null = os.open('/dev/null', os.O_WRONLY)",
                "os.dup2(null, 1)",
            ),
        ),
        Hostile(
            "forged lines on every open descriptor, fd 2 included",
            "stdout",
            _prog(
                WRONG,
                _TOKENS,
                _FORGED,
                "import os",
                "for fd in range(64):",
                "    try:",
                "        os.write(fd, _forged())",
                "    except OSError:",
                "        pass",
            ),
        ),
        Hostile(
            "atexit prints a pass line after the harness's verdict",
            "exit",
            _prog(
                WRONG,
                _TOKENS,
                _FORGED,
                "import atexit, os",
                "_lines = _forged()",
                "atexit.register(lambda: [os.write(fd, _lines) for fd in (1, 2)])",
            ),
        ),
        Hostile(
            "forged output, then os._exit(0) from inside f",
            "exit",
            _prog(
                _TOKENS,
                _FORGED,
                "import os",
                "def f(x):",
                "    for fd in range(64):",
                "        try:",
                "            os.write(fd, _forged())",
                "        except OSError:",
                "            pass",
                "    os._exit(0)",
            ),
        ),
        Hostile(
            "forged output, then sys.exit(0)",
            "exit",
            _prog(WRONG, _TOKENS, _FORGED, "import os", "os.write(1, _forged())", "sys.exit(0)"),
        ),
        Hostile(
            "f raises KeyboardInterrupt",
            "BaseException",
            "def f(x):\n    raise KeyboardInterrupt\n",
        ),
        Hostile(
            "f prints a forged verdict and raises SystemExit(0)",
            "BaseException",
            _prog(
                _TOKENS,
                _FORGED,
                "import os",
                "def f(x):",
                "    os.write(1, _forged())",
                "    raise SystemExit(0)",
            ),
        ),
        Hostile(
            "f raises GeneratorExit",
            "BaseException",
            "def f(x):\n    raise GeneratorExit\n",
        ),
        Hostile(
            "f raises a BaseException subclass of its own",
            "BaseException",
            "class Escape(BaseException):\n    pass\ndef f(x):\n    raise Escape('pass')\n",
        ),
        Hostile(
            "f returns an object whose __eq__ is always true",
            "comparison",
            "class Any:\n    def __eq__(self, other):\n        return True\n"
            "    __hash__ = object.__hash__\n    def __lt__(self, other):\n        return True\n"
            "def f(x):\n    return Any()\n",
        ),
        Hostile(
            "f returns an int subclass with a custom __eq__",
            "comparison",
            "class I(int):\n    def __eq__(self, other):\n        return True\n"
            "    __hash__ = int.__hash__\ndef f(x):\n    return I(0)\n",
        ),
        Hostile(
            "f returns a str subclass with a custom __eq__",
            "comparison",
            "class S(str):\n    def __eq__(self, other):\n        return True\n"
            "    __hash__ = str.__hash__\ndef f(s):\n    return S('x')\n",
            STR_GOLD,
        ),
        Hostile(
            "f returns a float subclass that is close to everything",
            "comparison",
            "class F(float):\n    def __eq__(self, other):\n        return True\n"
            "    def __sub__(self, other):\n        return 0.0\n    def __rsub__(self, other):\n"
            "        return 0.0\n    def __lt__(self, other):\n        return True\n"
            "    __hash__ = float.__hash__\ndef f(x):\n    return F(9.0)\n",
            ISCLOSE_GOLD,
        ),
        Hostile(
            "names the tests use (math, isclose, abs) redefined to always agree",
            "comparison",
            "class _M:\n    def isclose(self, *a, **k):\n        return True\nmath = _M()\n"
            "def isclose(*a, **k):\n    return True\ndef abs(x):\n    return 0\n"
            "def f(x):\n    return 9.0\n",
            ISCLOSE_GOLD,
        ),
        Hostile(
            "speaks the harness's protocol itself: its names, then a value for every call",
            "protocol",
            _prog(
                WRONG,
                "import json, os",
                "line = json.dumps({'names': {'f': 'function'}}) + '\\n'",
                "line += (json.dumps({'value': True}) + '\\n') * 10",
                "for fd in range(3, 64):",
                "    try:",
                "        os.write(fd, line.encode())",
                "    except OSError:",
                "        pass",
            ),
        ),
        Hostile(
            "kills every process it can signal, then prints a pass line",
            "signals",
            _prog(
                WRONG,
                _TOKENS,
                _FORGED,
                "import os, signal",
                "for pid in range(2, 1 << 16):",
                "    if pid != os.getpid():",
                "        try:",
                "            os.kill(pid, signal.SIGKILL)",
                "        except OSError:",
                "            pass",
                "os.write(1, _forged())",
            ),
        ),
        Hostile(
            "__del__ prints a forged verdict when the harness drops the namespace",
            "__del__",
            _prog(
                WRONG,
                _TOKENS,
                _FORGED,
                "import os",
                "class _Late:",
                "    lines = _forged()",
                "    def __del__(self):",
                "        for fd in (1, 2):",
                "            os.write(fd, self.lines)",
                "_late = _Late()",
            ),
        ),
        Hostile(
            "a SIGALRM handler forges the verdict mid-run and exits",
            "signals",
            _prog(
                WRONG,
                _TOKENS,
                _FORGED,
                "import os, signal",
                "def _handler(signum, frame):",
                "    os.write(1, _forged())",
                "    os._exit(0)",
                "signal.signal(signal.SIGALRM, _handler)",
                "signal.setitimer(signal.ITIMER_REAL, 0.05)",
                "def f(x):",
                "    import time",
                "    time.sleep(0.2)",
                "    return 0",
            ),
        ),
        Hostile(
            "a thread prints a pass line after the harness's verdict",
            "threads",
            _prog(
                WRONG,
                _TOKENS,
                _FORGED,
                "import os, threading, time",
                "_lines = _forged()",
                "def _later():",
                "    time.sleep(0.3)",
                "    for fd in range(64):",
                "        try:",
                "            os.write(fd, _lines)",
                "        except OSError:",
                "            pass",
                "threading.Thread(target=_later).start()",
            ),
        ),
        Hostile(
            "a thread keeps clearing every list of test sources",
            "threads",
            _prog(
                WRONG,
                "import gc, threading",
                "def _clear():",
                "    for _ in range(200):",
                "        for obj in gc.get_objects():",
                "            if isinstance(obj, list) and obj and all(isinstance(t, str) for t in "
                "obj) and any('assert' in t for t in obj):",
                "                obj.clear()",
                "threading.Thread(target=_clear, daemon=True).start()",
            ),
        ),
        Hostile(
            "the expected values read from the dataset file",
            "files",
            _prog(
                _TABLE,
                "try:",
                f"    _found.update(_table(open({data_file!r}).read()))",
                "except OSError:",
                "    pass",
            ),
        ),
        Hostile(
            "the expected values searched for in the run directory, /tmp and the cwd's parents",
            "files",
            _prog(
                _TABLE,
                "import os",
                "roots = ['.', '..', '/tmp', '/var/tmp', '/dev/shm', os.path.dirname(os.getcwd())]",
                "for root in roots:",
                "    for base, dirs, files in os.walk(root):",
                "        for name in files:",
                "            try:",
                "                _found.update(_table(open(os.path.join(base, name), "
                "errors='ignore').read()))",
                "            except OSError:",
                "                pass",
            ),
        ),
        Hostile(
            "the expected values read from this and every visible process's environment",
            "environment",
            _prog(
                _TABLE,
                "import os",
                "_found.update(_table(repr(dict(os.environ))))",
                "for pid in os.listdir('/proc') if os.path.isdir('/proc') else []:",
                "    try:",
                "        _found.update(_table(open('/proc/%s/environ' % pid, errors='ignore').read()))",
                "    except OSError:",
                "        pass",
            ),
        ),
        Hostile(
            "the expected values read from argv, stdin and every visible command line",
            "argv",
            _prog(
                _TABLE,
                "import os, sys",
                "_found.update(_table(repr(sys.argv)))",
                "for pid in os.listdir('/proc') if os.path.isdir('/proc') else []:",
                "    for part in ('cmdline', 'fd/0'):",
                "        try:",
                "            _found.update(_table(open('/proc/%s/%s' % (pid, part), "
                "errors='ignore').read()))",
                "        except OSError:",
                "            pass",
            ),
        ),
        Hostile(
            "the expected values scanned from every readable process's memory",
            "memory",
            _prog(
                _TABLE,
                "import os",
                "for pid in os.listdir('/proc') if os.path.isdir('/proc') else []:",
                "    if not pid.isdigit():",
                "        continue",
                "    try:",
                "        maps = open('/proc/%s/maps' % pid).read().splitlines()",
                "        mem = open('/proc/%s/mem' % pid, 'rb')",
                "    except OSError:",
                "        continue",
                "    for line in maps:",
                "        lo, hi = (int(x, 16) for x in line.split()[0].split('-'))",
                "        if 'r' not in line.split()[1] or hi - lo > 64 << 20:",
                "            continue",
                "        try:",
                "            mem.seek(lo)",
                "            _found.update(_table(mem.read(hi - lo).decode('latin-1')))",
                "        except (OSError, ValueError, OverflowError):",
                "            pass",
            ),
        ),
        Hostile(
            "f raises StopIteration inside all(map(f, ...))",
            "StopIteration",
            "def f(x):\n    raise StopIteration\n",
            ALL_MAP_GOLD,
        ),
        Hostile(
            "f raises StopIteration inside not any(filter(f, ...))",
            "StopIteration",
            "def f(x):\n    raise StopIteration\n",
            NOT_ANY_FILTER_GOLD,
        ),
        Hostile(
            "f raises StopIteration inside sum(map(f, ...)) == 0",
            "StopIteration",
            "def f(x):\n    raise StopIteration\n",
            SUM_MAP_GOLD,
        ),
        Hostile(
            "f returns NaN to a test of not (error > tolerance)",
            "NaN",
            "def f(x):\n    return float('nan')\n",
            NOT_FAR_GOLD,
        ),
        Hostile(
            "io: exactly the 1 MiB of right output, then garbage",
            "output cap",
            _prog(
                "import sys",
                f"sys.stdout.write('y\\n' * {IO_CAP // 2})",
                "sys.stdout.write('garbage\\n' * 1000)",
            ),
            EXACT_CAP_GOLD,
        ),
        Hostile(
            "io: the expected output read from the dataset file",
            "files",
            _prog(
                "import json, re",
                "n = int(input())",
                "try:",
                f"    text = open({data_file!r}).read()",
                "    cases = json.loads(json.loads(text.splitlines()[1])['answer'])['io']",
                "    print(next(c['output'] for c in cases if int(c['input']) == n), end='')",
                "except (OSError, ValueError, KeyError, StopIteration):",
                "    print(0)",
            ),
            IO_GOLD,
        ),
    ]


def dataset_lines() -> str:
    """The data file's text: the gold of the assert cases and of the io case, one row each."""
    rows = [{"id": "a", "answer": ASSERT_GOLD}, {"id": "io", "answer": IO_GOLD}]
    return "".join(json.dumps(r) + "\n" for r in rows)
