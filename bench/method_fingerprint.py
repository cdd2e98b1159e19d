"""Fixed-seed fingerprint of every method: a short tiny-model run of each, its metrics without the
timings and a hash of its rollouts, so a refactor can show that it changed no number.

Each method runs in its own process (one in-process vLLM engine per process), on its tiny preset,
3 steps of 4 prompts with an evaluation after steps 2 and 3; about 1-2 minutes per method on 2
cores. Compare two fingerprints with `--compare`:

    .venv/bin/python bench/method_fingerprint.py --out /tmp/fp-before      # on the old commit
    .venv/bin/python bench/method_fingerprint.py --out /tmp/fp-after       # on the new one
    .venv/bin/python bench/method_fingerprint.py --compare /tmp/fp-before /tmp/fp-after
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
PRESETS = {
    "grpo": (CONFIGS / "tiny.yaml", []),
    "laconic": (CONFIGS / "tiny-laconic.yaml", []),
    "duet": (CONFIGS / "tiny-duet.yaml", []),
    "dro": (CONFIGS / "tiny-dro.yaml", []),
    "tandem": (CONFIGS / "tiny-tandem.yaml", []),
    "dapo": (CONFIGS / "tiny.yaml", ["algorithm.name=dapo"]),
}
SHORT = ["run.steps=3", "run.eval_every=2", "task.n_test=16", "generation.prompts_per_step=4"]


def timing_free(record: dict) -> dict:
    """A metrics record without the wall-clock figures, which differ run to run."""
    return {
        k: v
        for k, v in record.items()
        if not k.startswith(("time_", "busy_share_", "flops_per_s_", "mfu_"))
        and k not in ("tokens_per_s", "eval_seconds", "pipeline_ready_batches")
    }


def fingerprint(method: str, out: Path) -> None:
    """Train `method` in this process (in-process workers) and write `out/<method>.json`."""
    from rlvr.config import load_config
    from workflows.train import prepare, train

    path, extra = PRESETS[method]
    cfg = load_config(path, [*SHORT, *extra, f"run.name=fingerprint-{method}"])
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / method
        train(cfg, run, use_actors=False, prepared=prepare(cfg))
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        rollouts = hashlib.sha1((run / "rollouts.jsonl").read_bytes()).hexdigest()
    record = {"metrics": [timing_free(m) for m in metrics], "rollouts_sha1": rollouts}
    (out / f"{method}.json").write_text(json.dumps(record, indent=1, sort_keys=True))


def compare(a: Path, b: Path) -> bool:
    """Print, per method, whether two fingerprints agree (and the first differences)."""
    same = True
    for method in PRESETS:
        fa, fb = a / f"{method}.json", b / f"{method}.json"
        if not (fa.exists() and fb.exists()):
            print(f"{method}: missing in {a if not fa.exists() else b}")
            same = False
            continue
        ra, rb = json.loads(fa.read_text()), json.loads(fb.read_text())
        diffs = [
            f"step {x.get('step')} {k}: {x.get(k)} != {y.get(k)}"
            for x, y in zip(ra["metrics"], rb["metrics"], strict=False)
            for k in sorted(set(x) | set(y))
            if x.get(k) != y.get(k)
        ]
        if ra["rollouts_sha1"] != rb["rollouts_sha1"]:
            diffs.append("rollouts differ")
        if len(ra["metrics"]) != len(rb["metrics"]):
            diffs.append(f"{len(ra['metrics'])} != {len(rb['metrics'])} records")
        n = len(ra["metrics"][0]) if ra["metrics"] else 0
        print(f"{method}: " + ("identical" if not diffs else "; ".join(diffs[:5])) + f" ({n} keys)")
        same = same and not diffs
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="folder for <method>.json")
    ap.add_argument("--methods", nargs="+", choices=list(PRESETS), default=list(PRESETS))
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"))
    ap.add_argument("--one", choices=list(PRESETS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compare:
        sys.exit(0 if compare(*args.compare) else 1)
    if args.out is None:
        ap.error("--out is required unless --compare is given")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one:
        fingerprint(args.one, args.out)
        return
    for method in args.methods:
        cmd = [sys.executable, __file__, "--out", str(args.out), "--one", method]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"{method}: written", flush=True)


if __name__ == "__main__":
    main()
