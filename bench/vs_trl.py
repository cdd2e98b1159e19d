"""The project against TRL's GRPOTrainer on the same GRPO work, side by side in one run.

Both train SmolLM2-135M-Instruct (fp32) on the demo's arithmetic prompts, rendered through the same
chat template: P prompts x G samples of at most N new tokens at T = 1 (top-p 1) per optimizer step,
token-mean loss, no KL, one optimizer step per batch, full fine-tuning (or `--lora`: the preset's
adapters, the same modules and layers in both). The project's one policy rank runs DeepSpeed at
ZeRO stage 0: on one rank ZeRO partitions nothing and only adds gradient copies (`--set
training.zero_stage=2` shows them). TRL runs in its own environment (`make trl-env`),
8 completions per forward/backward; the project runs its actors (vLLM engine, DeepSpeed policy,
a verifier pool of one actor) with the preset's training settings. Each side runs in a child
process, the sides alternating over `--repeats`; the first `--warmup` steps of each child are
left out and the table shows medians of the rest. Peak memory is the machine's (MemTotal -
MemAvailable, every process and shared memory) above what it was before the child started, and
the child's own: anonymous and shared-memory PSS summed over its process tree (Ray's processes and
actors included), which other jobs on the machine do not disturb; both sampled every 0.2 s.

    make trl-env
    .venv/bin/python bench/vs_trl.py --repeats 2 --steps 2
    .venv/bin/python bench/vs_trl.py --lora --repeats 1 --steps 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
PRESET = ROOT / "configs" / "smollm2-arith.yaml"
BEFORE = [
    "training.micro_batch_tokens=0",
    "training.lm_head_chunk=0",
    "training.shared_prefix=false",
    "training.zero_stage=2",
]
BF16_ENGINE = ["generation.dtype=bfloat16"]
LEAN = ["training.gradient_checkpointing=true", "training.lm_head_chunk=256", *BF16_ENGINE]
SIDES = {
    "trl": None,
    "project": [],
    "project-before": BEFORE,
    "project-bf16": BF16_ENGINE,
    "project-lean": LEAN,
    "project-lean-mmap": [*LEAN, "resources.malloc_mmap_threshold_kib=1024"],
    "project-lean-jemalloc": [*LEAN, "resources.allocator=jemalloc"],
}
"""Each side and its project overrides: "project-before" turns off the trainer's optimisations
(token-budget micro-batches, LM head at loss tokens, shared-prefix packs, ZeRO stage 0 on one
rank): 8 rows per forward and full logits, as TRL runs them, under ZeRO-2. "project-bf16" samples
with a bfloat16 engine (the fp32 trainer's mismatch corrected by training.engine_is, as verl and
OpenRLHF run bf16 vLLM beside fp32 training). "project-lean" trades training time for memory:
activation checkpointing and LM-head chunks of 256 loss tokens, with the bfloat16 engine;
"project-lean-mmap" also pins glibc's mmap threshold at 1 MiB in the policy and the engine
(resources.malloc_mmap_threshold_kib), where glibc's own rises to 32 MiB; "project-lean-jemalloc"
runs them on jemalloc instead (resources.allocator)."""
LABELS = {
    "trl": "TRL GRPOTrainer",
    "project": "project",
    "project-before": "project, before",
    "project-bf16": "project, bf16 engine",
    "project-lean": "project, lean",
    "project-lean-mmap": "project, lean, 1 MiB mmap threshold",
    "project-lean-jemalloc": "project, lean, jemalloc",
}
PARTS = ("time_step", "time_generate", "time_train", "time_sync")
ENGINE_MISMATCH = ("train_engine_kl", "train_engine_capped_frac", "train_engine_ratio_max")
"""The step's engine/trainer mismatch (KL of the engine's sampled tokens to the trainer's pi_old,
the share of tokens whose importance ratio was capped, the largest ratio): what a bf16 engine
costs in fidelity."""


def memory_used_gib() -> float:
    """The machine's memory in use: MemTotal - MemAvailable, in GiB."""
    kib = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        kib[key] = int(value.split()[0])
    return (kib["MemTotal"] - kib["MemAvailable"]) / 2**20


def tree_pids(root: int) -> list[int]:
    """`root` and every process descended from it (Ray's daemons and actors included)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, []))
    return pids


def tree_memory_gib(root: int) -> dict[str, float]:
    """Anonymous and shared-memory PSS over `root`'s process tree, in GiB by process name (Ray
    names its actors' processes `ray::ClassName`): the memory its processes own (a shared page
    split among its mappers), whatever else runs on the machine; file pages (mapped safetensors,
    libraries) are reclaimable cache and left out."""
    by_name: dict[str, float] = {}
    for pid in tree_pids(root):
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
            name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        kib = sum(
            int(line.split()[1])
            for line in rollup.splitlines()
            if line.startswith(("Pss_Anon:", "Pss_Shmem:"))
        )
        name = name.split(".")[0] if name.startswith("ray::") else Path(name).name
        by_name[name] = by_name.get(name, 0.0) + kib / 2**20
    return by_name


class PeakMemory:
    """Samples, in a thread, `memory_used_gib` (the machine) and, once `watch` names the child,
    `tree_memory_gib` (the child's processes); peaks of both, and the child's processes at its
    peak."""

    def __init__(self, every_s: float = 0.2):
        self.every_s, self.idle = every_s, memory_used_gib()
        self.peak, self.tree_peak, self._stop = self.idle, 0.0, threading.Event()
        self.tree_at_peak: dict[str, float] = {}
        self._root: int | None = None
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def watch(self, pid: int) -> None:
        self._root = pid

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, memory_used_gib())
            if self._root is not None:
                by_name = tree_memory_gib(self._root)
                total = sum(by_name.values())
                if total > self.tree_peak:
                    self.tree_peak, self.tree_at_peak = total, by_name

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_above_idle(self) -> float:
        return self.peak - self.idle


def bench_config(lora: bool, steps: int, overrides: list[str]):
    """The preset at the compared workload (`--set` applies last)."""
    from rlvr.config import load_config

    return load_config(
        PRESET,
        [
            f"model.lora.enabled={str(lora).lower()}",
            "generation.max_tokens=128",
            "generation.temperature=1.0",
            "generation.top_p=1.0",
            "generation.group_size=8",
            "generation.prompts_per_step=8",
            "training.lr=1e-6",
            "training.loss_agg=token-mean",
            "training.kl_coef=0.0",
            # one policy rank: ZeRO has nothing to partition, only gradient copies to add
            "training.zero_stage=0",
            # 64 boxed answers a step: one verifier actor (and its math-verify worker) checks them
            # in well under a second; the preset's second one only holds memory here
            "resources.num_verifiers=1",
            "run.eval_every=0",
            f"run.steps={steps}",
            "run.name=vs-trl",
            *overrides,
        ],
    )


def write_prompts(cfg, path: Path) -> str:
    """The training problems as TRL's conversational prompts; returns the model directory."""
    from rlvr.tasks.prompts import prompt_messages
    from workflows.train import prepare

    model_dir, train_problems, _ = prepare(cfg)
    rows = [
        {"prompt": prompt_messages(p, cfg.task.instruction), "answer": str(p.answer)}
        for p in train_problems
    ]
    path.write_text(json.dumps(rows))
    return str(model_dir)


def run_project(config_path: Path, out: Path) -> None:
    """Child process: the project's actors on `config_path`, one JSON line of metrics per step."""
    from transformers import AutoTokenizer

    from rlvr.config import load_config
    from rlvr.run.rundir import RunDir
    from workflows.cluster import init_ray, quiet_driver, ray_env
    from workflows.components import start_components
    from workflows.train import Trainer, prepare

    ray_env()
    quiet_driver()
    cfg = load_config(config_path, [])
    model_dir, train_problems, test_problems = prepare(cfg)
    init_ray(cfg)
    import ray

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = RunDir(Path(tmp) / "run")
        run_dir.create(cfg.to_dict())
        comps = start_components(cfg, model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        trainer = Trainer(cfg, run_dir, comps, tokenizer, train_problems, test_problems)
        for step in range(cfg.run.steps):
            m = trainer.step(step)
            record = {k: m[k] for k in (*PARTS, "tokens_generated", "reward_mean")}
            record.update({k: m[k] for k in ENGINE_MISMATCH if k in m})
            with out.open("a") as f:
                f.write(json.dumps({"step": step, **record}) + "\n")
        comps.shutdown()
    ray.shutdown()


def run_child(side: str, args: argparse.Namespace, files: dict[str, Path]) -> dict:
    """One child run of `side`: its measured steps, wall time and peak memory above idle."""
    out = files["dir"] / f"{side}-{time.time_ns()}.jsonl"
    steps = args.warmup + args.steps
    if side == "trl":
        cmd = [
            str(TRL_PYTHON),
            str(ROOT / "bench" / "trl_grpo.py"),
            f"--model={files['model']}",
            f"--prompts={files['prompts']}",
            f"--out={out}",
            f"--steps={steps}",
            f"--seed={args.seed}",
        ]
        if args.lora:
            cmd.append(f"--lora={files['lora'].read_text()}")
    else:
        cmd = [sys.executable, __file__, "--child-project", str(files[side]), f"--out={out}"]
    log = files["dir"] / f"{side}.log"
    t0 = time.perf_counter()
    with PeakMemory() as mem, log.open("a") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        mem.watch(proc.pid)
        proc.wait()
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{side} failed (exit {proc.returncode}); its log: {log}")
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return {
        "steps": records[args.warmup :],
        "wall_s": wall,
        "outside_steps_s": wall - sum(r["time_step"] for r in records),
        "peak_gib": mem.peak_above_idle,
        "tree_peak_gib": mem.tree_peak,
        "tree_at_peak_gib": mem.tree_at_peak,
    }


def summarise(runs: list[dict]) -> dict[str, float]:
    """Medians over every measured step of every run of one side."""
    steps = [s for r in runs for s in r["steps"]]
    out = {p: statistics.median(s.get(p, 0.0) for s in steps) for p in PARTS}
    for key in ENGINE_MISMATCH:
        if key in steps[0]:
            out[key] = statistics.median(s[key] for s in steps)
    if "time_forward" in steps[0]:
        out["time_forward"] = statistics.median(s["time_forward"] for s in steps)
    out["tokens_per_s"] = statistics.median(s["tokens_generated"] / s["time_step"] for s in steps)
    out["peak_gib"] = max(r["peak_gib"] for r in runs)
    peak_run = max(runs, key=lambda r: r["tree_peak_gib"])
    out["tree_peak_gib"] = peak_run["tree_peak_gib"]
    out["tree_at_peak_gib"] = peak_run["tree_at_peak_gib"]
    out["outside_steps_s"] = statistics.median(r["outside_steps_s"] for r in runs)
    out["measured_steps"] = len(steps)
    return out


def format_table(result: dict[str, dict[str, float]], title: str) -> str:
    lines = [
        f"### {title}",
        "",
        "| | step s | generate s | train s | sync s | tokens/s (step) | peak GiB above idle | "
        "peak GiB, its processes | start-up + exit s | steps |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for side, r in result.items():
        train = f"{r['time_train']:.1f}"
        if "time_forward" in r:
            train += f" (forward + loss {r['time_forward']:.1f})"
        lines.append(
            f"| {LABELS[side]} | {r['time_step']:.1f} | {r['time_generate']:.1f} | {train} | "
            f"{r['time_sync']:.1f} | {r['tokens_per_s']:.1f} | {r['peak_gib']:.2f} | "
            f"{r['tree_peak_gib']:.2f} | "
            f"{r['outside_steps_s']:.0f} | {r['measured_steps']} |"
        )
    if "trl" in result:
        trl = result["trl"]
        lines.append("")
        for side, r in result.items():
            if side != "trl":
                lines.append(
                    f"- {LABELS[side]}: step time TRL / it **{trl['time_step'] / r['time_step']:.2f}x** "
                    f"(training {trl['time_train'] / r['time_train']:.2f}x, generation "
                    f"{trl['time_generate'] / r['time_generate']:.2f}x); peak memory it / TRL "
                    f"{r['peak_gib'] / trl['peak_gib']:.2f} (the machine's), "
                    f"{r['tree_peak_gib'] / trl['tree_peak_gib']:.2f} (their processes')."
                )
    mismatch = [(side, r) for side, r in result.items() if "train_engine_kl" in r]
    if mismatch:
        lines += ["", "Engine/trainer mismatch (medians over steps):", ""]
        for side, r in mismatch:
            lines.append(
                f"- {LABELS[side]}: KL(engine || trainer) per token {r['train_engine_kl']:.2e}, "
                f"ratio capped at {r['train_engine_capped_frac']:.2%} of tokens, largest ratio "
                f"{r['train_engine_ratio_max']:.3f}"
            )
    lines += ["", "Each side's processes at its peak (GiB, anonymous + shared PSS):", ""]
    for side, r in result.items():
        parts = sorted(r["tree_at_peak_gib"].items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"{name} {gib:.2f}" for name, gib in parts if gib >= 0.01)
        lines.append(f"- {LABELS[side]}: {shown}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="child runs per side, alternating")
    ap.add_argument("--steps", type=int, default=2, help="measured steps per child run")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured first steps per child run")
    ap.add_argument("--lora", action="store_true", help="the preset's LoRA instead of full FT")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES))
    ap.add_argument("--set", action="append", default=[], help="project config override")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "vs_trl"))
    ap.add_argument("--child-project", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_project:
        run_project(Path(args.child_project), Path(args.out))
        return
    if not TRL_PYTHON.exists():
        raise SystemExit(f"{TRL_PYTHON} is missing: run `make trl-env` first")

    import yaml

    overrides = [f"run.seed={args.seed}", *args.set]
    cfg = bench_config(args.lora, args.warmup + args.steps, overrides)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "lora" if args.lora else "full"
    with tempfile.TemporaryDirectory() as tmp:
        files = {"dir": Path(tmp), "prompts": Path(tmp) / "prompts.json"}
        for side in args.sides:
            if SIDES[side] is not None:
                side_cfg = bench_config(
                    args.lora, args.warmup + args.steps, [*SIDES[side], *overrides]
                )
                files[side] = Path(tmp) / f"{side}.yaml"
                files[side].write_text(yaml.safe_dump(side_cfg.to_dict()))
        files["model"] = Path(write_prompts(cfg, files["prompts"]))
        files["lora"] = Path(tmp) / "lora.json"
        files["lora"].write_text(json.dumps(trl_lora_kwargs(cfg)))
        runs: dict[str, list[dict]] = {side: [] for side in args.sides}
        for repeat in range(args.repeats):
            for side in args.sides if repeat % 2 == 0 else args.sides[::-1]:
                print(f"repeat {repeat}: {side} ...", flush=True)
                runs[side].append(run_child(side, args, files))
                print(json.dumps(runs[side][-1]["steps"]), flush=True)
    result = {side: summarise(r) for side, r in runs.items()}
    title = (
        f"{'LoRA' if args.lora else 'Full fine-tuning'}: SmolLM2-135M fp32, 8 prompts x 8 samples, "
        f"128 new tokens, T 1.0; medians of {args.repeats} alternating runs per side"
    )
    table = format_table(result, title)
    print(table)
    (out / f"{name}.md").write_text(table + "\n")
    (out / f"{name}.json").write_text(json.dumps({"result": result, "runs": runs}, indent=2))


def trl_lora_kwargs(cfg) -> dict:
    """peft.LoraConfig arguments of the preset's adapters: same rank, scale, modules and layers."""
    from transformers import AutoConfig

    from rlvr.models import resolve_model_path

    lora = cfg.model.lora
    n_layers = AutoConfig.from_pretrained(resolve_model_path(cfg.model.path)).num_hidden_layers
    layers = list(range(n_layers - lora.top_layers, n_layers)) if lora.top_layers else None
    return {
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.target_modules),
        "layers_to_transform": layers,
    }


if __name__ == "__main__":
    main()
