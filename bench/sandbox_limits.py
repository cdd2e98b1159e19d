"""What a code candidate can do to its verifier: forge a verdict, flood it, hold memory; this
checkout's code verifier beside a baseline commit's, the same programs run through each.

    .venv/bin/python bench/sandbox_limits.py --baseline 5ac0ac6

Each scenario runs in a fresh Python process (so its peak RSS is its own) with `rlvr` taken from
this checkout or from the baseline commit's `rlvr/` (extracted with `git archive`):

* flood 1 GiB: an io-format solution writes 1 GiB to stdout and exits; `CodeVerifier.verify` with
  a 5 s timeout. Reported: the verdict, the wall time of `verify`, the verifier process's peak RSS
  (ru_maxrss; an idle one holds about 40 MB).
* endless flood: the same, writing for ever.
* 4 x 400 MB: `run_python` (default limits: 512 MB) of a program that forks 4 children, each
  filling 400 MB and holding it 3 s; reported, the largest total RSS of the run's processes seen
  (sampled every 20 ms) and how many children held their 400 MB.
* 40 correct items: `CodeVerifier(num_workers=2).verify_batch` of 40 correct assert-style
  solutions, median of 3 (the price of the second sandbox per item).
* hostile: the programs of tests/verifiers/hostile_solutions.py (wrong solutions that try to score
  correct) and its correct solutions (CORRECT), through `CodeVerifier.verify_batch`; reported,
  each verdict, how many hostile programs scored correct and how many correct ones did.

Prints two Markdown tables (limits; hostile verdicts by class) and writes them to
bench/out/sandbox_limits/ (results.md, and the raw figures in results.json). Timings are this
machine's, loaded or not; the point is the verdicts and the memory, not the speed. The peak of
the 4 x 400 MB run sums each process's RSS, so pages its processes share count more than once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "sandbox_limits"
IO_GOLD = json.dumps({"io": [{"input": "3\n", "output": "10\n"}]})
FLOOD = "import os\nchunk = b'x' * (1 << 20)\nfor _ in range(1024):\n    os.write(1, chunk)\n"
ENDLESS = "import os\nchunk = b'x' * (1 << 20)\nwhile True:\n    os.write(1, chunk)\n"
CHILDREN = """
import os, time
for _ in range(4):
    if os.fork() == 0:
        try:
            block = bytearray(400 << 20)
            for i in range(0, len(block), 4096):
                block[i] = 1
            os.write(1, b"held\\n")
            time.sleep(3)
        except MemoryError:
            os.write(1, b"refused\\n")
        os._exit(0)
for _ in range(4):
    try:
        os.wait()
    except ChildProcessError:
        break
"""
SCENARIOS = ("flood 1 GiB", "endless flood", "4 x 400 MB", "40 correct items", "hostile")
LIMITS = SCENARIOS[:4]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _flood(program: str) -> dict[str, Any]:
    from rlvr.verifiers.code import CodeVerifier

    with CodeVerifier(num_workers=1, timeout=5.0) as verifier:
        start = time.monotonic()
        verdict = verifier.verify(f"```python\n{program}```", IO_GOLD)
        seconds = time.monotonic() - start
    return {"verdict": list(verdict), "seconds": seconds, "peak_rss_mb": _peak_rss_mb()}


def _children() -> dict[str, Any]:
    import psutil

    from rlvr.verifiers.sandbox import run_python

    me = psutil.Process()
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            total = 0
            for proc in me.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    total += proc.memory_info().rss
            peak[0] = max(peak[0], total)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result = run_python(CHILDREN, timeout=10.0)
    finally:
        done.set()
        sampler.join()
    return {
        "held": result.stdout.count("held"),
        "peak_total_rss_mb": peak[0] / (1 << 20),
        "returncode": result.returncode,
    }


def _throughput() -> dict[str, Any]:
    from rlvr.verifiers.code import CodeVerifier
    from tests.verifiers.hostile_solutions import CORRECT

    right = CORRECT[0]
    times = []
    with CodeVerifier(num_workers=2, timeout=10.0) as verifier:
        verifier.wait_ready()
        for _ in range(3):
            start = time.monotonic()
            scored = verifier.verify_batch([right.response] * 40, [right.gold] * 40)
            times.append(time.monotonic() - start)
    return {"seconds": statistics.median(times), "correct": [s[1] for s in scored].count("correct")}


def _hostile() -> dict[str, Any]:
    from rlvr.verifiers.code import CodeVerifier
    from tests.verifiers.hostile_solutions import CORRECT, SECRET_ENV, dataset_lines, hostile_cases

    data = ROOT / f".hostile-data-{os.getpid()}.jsonl"
    data.write_text(dataset_lines())
    os.environ[SECRET_ENV] = json.loads(dataset_lines().splitlines()[0])["answer"]
    try:
        cases = hostile_cases(str(data))
        responses = [c.response for c in cases + CORRECT]
        golds = [c.gold for c in cases + CORRECT]
        with CodeVerifier(num_workers=2, timeout=5.0) as verifier:
            scored = verifier.verify_batch(responses, golds)
    finally:
        data.unlink()
    rows = [
        {"kind": c.kind, "name": c.name, "verdict": list(s)}
        for c, s in zip(cases, scored[: len(cases)], strict=True)
    ]
    right = [
        {"name": c.name, "verdict": list(s)}
        for c, s in zip(CORRECT, scored[len(cases) :], strict=True)
    ]
    return {"cases": rows, "correct_solutions": right}


def _scenario(name: str) -> dict[str, Any]:
    if name == "flood 1 GiB":
        return _flood(FLOOD)
    if name == "endless flood":
        return _flood(ENDLESS)
    if name == "4 x 400 MB":
        return _children()
    if name == "40 correct items":
        return _throughput()
    return _hostile()


def _run(code_root: Path, name: str) -> dict[str, Any]:
    """`name` in a fresh process whose `rlvr` is the one under `code_root`."""
    env = {**os.environ, "PYTHONPATH": f"{code_root}{os.pathsep}{ROOT}"}
    done = subprocess.run(
        [sys.executable, __file__, "--scenario", name],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name} under {code_root} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _baseline(commit: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "rlvr"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _limits_row(name: str, r: dict[str, Any]) -> str:
    if name == "4 x 400 MB":
        return f"{r['held']} of 4 held; peak {r['peak_total_rss_mb']:.0f} MB in all"
    if name == "40 correct items":
        return f"{r['correct']} correct in {r['seconds']:.2f} s"
    reward, status = r["verdict"]
    return f"{status} ({reward:g}); {r['seconds']:.1f} s; verifier peak {r['peak_rss_mb']:.0f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="a commit whose code verifier runs the same programs")
    parser.add_argument("--scenario", choices=SCENARIOS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scenario:
        print(json.dumps(_scenario(args.scenario)))
        return
    with tempfile.TemporaryDirectory(prefix="rlvr-baseline-") as tmp:
        roots = {"this checkout": ROOT}
        if args.baseline:
            roots = {args.baseline: _baseline(args.baseline, Path(tmp)), **roots}
        results = {label: {s: _run(root, s) for s in SCENARIOS} for label, root in roots.items()}
    labels = list(results)
    lines = ["| scenario | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name in LIMITS:
        row = " | ".join(_limits_row(name, results[x][name]) for x in labels)
        lines.append(f"| {name} | {row} |")
    lines += ["", "| class | hostile program | " + " | ".join(labels) + " |"]
    lines.append("|---" * (len(labels) + 2) + "|")
    hostile = [results[x]["hostile"] for x in labels]
    for i, case in enumerate(hostile[0]["cases"]):
        verdicts = " | ".join(h["cases"][i]["verdict"][1] for h in hostile)
        lines.append(f"| {case['kind']} | {case['name']} | {verdicts} |")
    for i, case in enumerate(hostile[0]["correct_solutions"]):
        verdicts = " | ".join(h["correct_solutions"][i]["verdict"][1] for h in hostile)
        lines.append(f"| (correct) | {case['name']} | {verdicts} |")
    for key, what in (("cases", "hostile programs"), ("correct_solutions", "correct solutions")):
        counts = [sum(c["verdict"][1] == "correct" for c in h[key]) for h in hostile]
        cells = " | ".join(str(n) for n in counts)
        lines.append(f"| (score) | {what} scored correct, of {len(hostile[0][key])} | {cells} |")
    print("\n".join(lines))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(results, indent=1))
    (OUT / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
