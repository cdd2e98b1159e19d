"""Where the suite's time goes: each test's phases and the drivers and engines it started.

Opt-in (`RLVR_TEST_STARTS=starts.jsonl pytest ...`): one JSON line per test with its setup, call
and teardown seconds, the Ray clusters started meanwhile (a driver's `ray.init`, or the session
fixture's: one new `session_*` folder under Ray's temp root each) and the engines started
(`ray::GeneratorActor` worker processes seen by a poller, plus engines built in the test process).
`python tests/start_counts.py starts.jsonl` prints the tables docs/development.md keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from collections import defaultdict
from pathlib import Path

ENV = "RLVR_TEST_STARTS"
RAY_ROOTS = (Path("/tmp/ray"),)
ENGINE_TITLE = "ray::GeneratorActor"


class StartCounter:
    """Counts Ray sessions and engine processes started while each test runs."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.engine_pids: set[int] = set()
        self.sessions: set[str] = set()
        # sessions present before (another run's) and those already looked at
        self.seen_sessions: set[str] = self._all_sessions()
        self.in_process_engines = 0
        self._lock = threading.Lock()
        self._scan_lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._poll, daemon=True).start()
        self._patch_backends()

    def _patch_backends(self) -> None:
        """Count engines built in this process (the generation tests' own engines)."""
        try:
            from rlvr.generation.hf_backend import HFBackend
            from rlvr.generation.vllm_backend import VLLMBackend
        except ImportError:  # vLLM absent: HF engines still count
            from rlvr.generation.hf_backend import HFBackend

            VLLMBackend = None
        for cls in (HFBackend, VLLMBackend):
            if cls is None:
                continue
            init = cls.__init__

            def counted(self_, *args, __init=init, **kwargs):
                with self._lock:
                    self.in_process_engines += 1
                __init(self_, *args, **kwargs)

            cls.__init__ = counted

    def _poll(self) -> None:
        """Note the engines and Ray sessions this process started (itself or through a child):
        under pytest-xdist the other worker's starts are its own to count."""
        while not self._stop.wait(0.25):
            self._scan()

    def _scan(self) -> None:
        import psutil

        with self._scan_lock:  # the poller's and a test's end's scans, one at a time
            for proc in psutil.process_iter(["pid", "cmdline"]):
                pid, cmd = proc.info["pid"], proc.info["cmdline"] or []
                engine = cmd[:1] and cmd[0].startswith(ENGINE_TITLE)
                if engine and pid not in self.engine_pids and self._ours(pid):
                    with self._lock:
                        self.engine_pids.add(pid)
            for session in self._all_sessions() - self.seen_sessions:
                # a session's name ends with the pid of the process that started it
                if self._ours(int(session.rsplit("_", 1)[1])):
                    with self._lock:
                        self.sessions.add(session)
                self.seen_sessions.add(session)

    @staticmethod
    def _ours(pid: int) -> bool:
        import psutil

        try:
            proc = psutil.Process(pid)
            return pid == os.getpid() or os.getpid() in {p.pid for p in proc.parents()}
        except psutil.Error:  # gone before it was seen: not counted
            return False

    @staticmethod
    def _all_sessions() -> set[str]:
        return {p.name for root in RAY_ROOTS for p in root.glob("session_2*")}

    def snapshot(self) -> tuple[set[str], set[int], int]:
        with self._lock:
            return set(self.sessions), set(self.engine_pids), self.in_process_engines

    def record(self, nodeid: str, phases: dict[str, float], before: tuple) -> None:
        """Append the test's row, counting what started since `before` (a `snapshot()`)."""
        self._scan()  # a start in the test's last moments is its own
        after = self.snapshot()
        row = {
            "test": nodeid,
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            **{k: round(v, 3) for k, v in phases.items()},
            "drivers": len(after[0] - before[0]),
            "engines": len(after[1] - before[1]) + (after[2] - before[2]),
        }
        with self.out.open("a") as f:
            f.write(json.dumps(row) + "\n")


def summarize(path: Path, top: int = 25) -> str:
    """A Markdown table of the slowest tests, and the suite's totals."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r["total"] = r.get("setup", 0) + r.get("call", 0) + r.get("teardown", 0)
    by_file: dict[str, float] = defaultdict(float)
    for r in rows:
        by_file[r["test"].split("::")[0]] += r["total"]
    lines = [
        f"{len(rows)} tests, {sum(r['total'] for r in rows) / 60:.1f} min of test time, "
        f"{sum(r['drivers'] for r in rows)} drivers (Ray clusters) started, "
        f"{sum(r['engines'] for r in rows)} engines started",
        "",
        "| test | setup s | call s | teardown s | drivers | engines |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: -r["total"])[:top]:
        lines.append(
            f"| `{r['test']}` | {r.get('setup', 0):.0f} | {r.get('call', 0):.0f} | "
            f"{r.get('teardown', 0):.0f} | {r['drivers']} | {r['engines']} |"
        )
    lines += ["", "| file | s |", "|---|---|"]
    for name, total in sorted(by_file.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| `{name}` | {total:.0f} |")
    return "\n".join(lines)


def counter_from_env() -> StartCounter | None:
    """The counter when RLVR_TEST_STARTS names its output file, else None."""
    path = os.environ.get(ENV)
    return StartCounter(Path(path)) if path else None


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The slowest tests of a RLVR_TEST_STARTS file.")
    parser.add_argument("starts", type=Path, help="the JSON lines a suite run wrote")
    parser.add_argument("--top", type=int, default=25, help="how many tests and files to list")
    args = parser.parse_args()
    print(summarize(args.starts, args.top))
