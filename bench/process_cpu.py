"""Where a run's CPU goes, process by process: the CPU seconds of everything a command starts.

A driver's start is most of a short run (and of the test suite's end-to-end tests): Ray's own
processes, the driver's imports, then each actor's (`from vllm import LLM` in an engine,
DeepSpeed in a policy rank). This runs one command, polls its process tree, and prints each
program's CPU seconds (user + system, a process's last reading before it ended) beside the
command's wall time. Without a command it runs a one-step tiny `rlvr train`:

    .venv/bin/python bench/process_cpu.py
    .venv/bin/python bench/process_cpu.py --out /tmp/cpu.json -- .venv/bin/rlvr train --config configs/tiny.yaml --set run.steps=2

The command's processes are its descendants (Ray's workers are its raylet's children), polled
every quarter second: a process that lives less than that may be missed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import psutil

from workflows.reaper import program

ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.25


def tiny_run(out: Path) -> list[str]:
    """A one-step tiny run, the shape of the suite's end-to-end tests (tests/integration)."""
    sets = [
        f"run.output_dir={out}",
        "run.steps=1",
        "run.eval_every=0",
        "task.n_test=16",
        "generation.prompts_per_step=4",
        "generation.group_size=4",
        "generation.max_tokens=24",
        "resources.num_verifiers=1",
    ]
    config = str(ROOT / "configs" / "tiny.yaml")
    return [sys.executable, "-m", "workflows.cli", "train", "--config", config] + [
        f"--set={s}" for s in sets
    ]


def measure(argv: list[str]) -> dict:
    """Run `argv` to its end; returns its wall seconds, exit status and CPU seconds by program."""
    started = time.time()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    root = psutil.Process(proc.pid)
    cpu: dict[int, tuple[str, float]] = {}
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            tree = []
        for p in tree:
            try:
                times = p.cpu_times()
                cpu[p.pid] = (program(p) or p.name(), times.user + times.system)
            except psutil.Error:
                continue
        time.sleep(POLL_S)
    wall = time.time() - started
    by_program: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, seconds in cpu.values():
        by_program[name][0] += seconds
        by_program[name][1] += 1
    rows = sorted(
        ({"program": n, "cpu_s": round(s, 1), "processes": k} for n, (s, k) in by_program.items()),
        key=lambda r: -r["cpu_s"],
    )
    total = round(sum(r["cpu_s"] for r in rows), 1)
    return {
        "argv": argv,
        "returncode": proc.returncode,
        "wall_s": round(wall, 1),
        "cpu_s": total,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the table as JSON here")
    parser.add_argument("command", nargs="*", help="the command (default: a one-step tiny run)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.command or tiny_run(Path(tmp)))
    print(f"wall {result['wall_s']} s, CPU {result['cpu_s']} s, exit {result['returncode']}")
    print("| program | processes | CPU s |\n|---|---|---|")
    for row in result["rows"]:
        print(f"| {row['program']} | {row['processes']} | {row['cpu_s']} |")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
