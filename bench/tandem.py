"""Tandem rollout cost: co-written (senior + frozen junior) rollouts against single-model rollouts
of the same batch on the same engine kind; with --train, GRPO vs Tandem vs KL-to-junior training.

    .venv/bin/python bench/tandem.py --model tiny|smollm2|PATH [--junior PATH] --prompts 8 \
        --n 4 --max-tokens 128 --repeats 3 [--oracle]
    .venv/bin/python bench/tandem.py --train --steps 12 --seeds 0 1 2 [--eval-n 8]
    .venv/bin/python bench/tandem.py --train --steps 1 --seeds 0 --eval-n 2 --k 1 2   # smoke run
    .venv/bin/python bench/tandem.py --forms [--backend vllm|hf] [--junior PATH] --prompts 8 \
        --n 4 --max-tokens 64

Forms mode (`algorithm.tandem.junior`): one engine kind's rollouts (--backend, vLLM by default)
as Ray actors of one thread each, pinned to cores: `solo` (the senior alone), `shared` (the
junior inside the senior's engine, both forwards on every token; also with two threads on both
cores) and `separate` (the junior in its own engine, `rlvr.generation.tandem_separate`) with both
engines on one core or each on its own. vLLM engines hand a sample over the moment its segment
ends (`cowrite_continuous`); transformers engines, which cannot take a request while they decode,
in rounds (`cowrite`). Besides the timings it counts, from the co-written samples'
authorship, the decode steps on the separate form's critical path (each round costs its longest
segment) against the shared form's (the longest sample, two forwards a step): the figures a
two-GPU prediction rests on, where a decode step costs about the same whatever the batch.

Training mode: configs/tiny.yaml (GRPO), tiny-tandem.yaml (Tandem) and tiny-kl-junior.yaml (KL to
the frozen base) trained with the same seeds and steps through the actors, then each final
checkpoint evaluated by `workflows.tandem_eval.evaluate_tandem` against the same junior (the shared
SFT-warmed start) on the held-out problems; handoff turns end at "\\n" (the task's step
separator). Writes a table (mean ± sd over seeds) as markdown, JSON and a PNG.

Variants, all in this process: `vllm solo` (a plain engine on the senior), `vllm tandem` (the
combined engine, `rlvr.generation.tandem_vllm`), `vllm tandem-engine solo` (the combined engine
without a schedule: the senior writes, the junior's forward still runs), `hf solo` and `hf tandem`
(the transformers lockstep loop), and with --oracle the two-model segment loop that re-reads the
whole prefix every token (the naive design). Each variant gets one untimed warm-up call, then the
timed calls alternate between variants so all see the same machine load. Prints the median
seconds per call, generated tokens, seconds per token and the ratios to the same engine's solo
rollout (wall time, and per token since solo and tandem responses may end at different lengths);
writes the table as JSON and a bar plot under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from harness import start_cluster

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from generation_throughput import make_prompts  # noqa: E402  (bench/, the script's directory)

from actors.generator import GeneratorActor  # noqa: E402
from rlvr.algorithms.tandem import (  # noqa: E402
    WordSwitchSchedule,
    tandem_generate_reference,
    word_boundary_ids,
)
from rlvr.generation import make_backend  # noqa: E402
from rlvr.generation.base import GenerationRequest, SamplingParams  # noqa: E402
from rlvr.models import resolve_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
Run = Callable[[], int]
"""One timed call: generate the batch, return the number of generated tokens."""


def variants(args: argparse.Namespace) -> tuple[dict[str, Run], list[Callable[[], None]]]:
    """The rollout variants to time, and the engines' close functions."""
    senior = resolve_model_path(args.model)
    junior = resolve_model_path(args.junior) if args.junior else senior
    prompts = make_prompts(senior, args.prompts)
    requests = [
        GenerationRequest(p, n=args.n, request_id=str(i), seed=1000 * i)
        for i, p in enumerate(prompts)
    ]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    engine = {
        "dtype": args.dtype,
        "max_model_len": max(len(p) for p in prompts) + args.max_tokens + 1,
        "kv_cache_gib": 1.0,
        "enforce_eager": not args.compile,
    }
    solo_vllm = make_backend("vllm", senior, **engine)
    tandem_vllm = make_backend("vllm", senior, junior_path=junior, **engine)
    solo_hf = make_backend("hf", senior, dtype=args.dtype)
    tandem_hf = make_backend("hf", senior, dtype=args.dtype, junior_path=junior)
    schedule = WordSwitchSchedule(
        word_boundary_ids(tandem_hf.tokenizer.get_vocab()), p=args.p, cap=args.cap
    )

    def count(results) -> int:
        return sum(len(s.token_ids) for r in results for s in r.samples)

    runs: dict[str, Run] = {
        "vllm solo": lambda: count(solo_vllm.generate(requests, params)),
        "vllm tandem": lambda: count(tandem_vllm.generate(requests, params, schedule=schedule)),
        "vllm tandem-engine solo": lambda: count(tandem_vllm.generate(requests, params)),
        "hf solo": lambda: count(solo_hf.generate(requests, params)),
        "hf tandem": lambda: count(tandem_hf.generate(requests, params, schedule=schedule)),
    }
    if args.oracle:

        def logits_of(model: torch.nn.Module) -> Callable[[list[int]], torch.Tensor]:
            return lambda ids: model(torch.tensor([ids])).logits[0, -1]

        @torch.inference_mode()
        def oracle() -> int:
            tokens = 0
            for request in requests:
                for j in range(request.n):
                    rollout = tandem_generate_reference(
                        request.prompt_ids,
                        logits_of(tandem_hf.model),
                        logits_of(tandem_hf.junior),
                        schedule,
                        request.seed + j,
                        args.max_tokens,
                        tandem_hf.stop_token_ids,
                        temperature=args.temperature,
                    )
                    tokens += len(rollout.response_ids)
            return tokens

        runs["segment-loop oracle"] = oracle
    # The tandem engine first: the last vLLM engine to close tears down torch.distributed.
    closers = [tandem_vllm.close, solo_vllm.close]
    return runs, closers


class PinnedGenerator(GeneratorActor):
    """A GeneratorActor whose process runs on the given cores only."""

    def __init__(self, cores: list[int], **kwargs) -> None:
        os.sched_setaffinity(0, cores)
        super().__init__(**kwargs)


def round_steps(authorships: list[list[int]]) -> dict[str, int]:
    """Decode steps on each form's critical path, from the co-written samples' authorship.

    `shared_steps`: the shared engine steps once per token of the longest sample (two forwards
    a step). `rounds`, `critical_steps`: every open sample writes one same-author run per round
    of `cowrite`, so round k holds each sample's k-th run; an engine steps until its longest run
    of the round ends, and the two engines of a round work at once: the round costs
    max(longest run of any sample's k-th run). `continuous_steps`: a sample handed over the moment
    its run ends (an engine that takes requests while it decodes others) waits for no other
    sample: its length plus one catch-up prefill per switch, the longest such sample.
    """
    runs = []
    for authorship in authorships:
        mine: list[tuple[int, int]] = []
        for author in authorship:
            if mine and mine[-1][0] == author:
                mine[-1] = (author, mine[-1][1] + 1)
            else:
                mine.append((author, 1))
        runs.append(mine)
    rounds = max(len(r) for r in runs)
    return {
        "shared_steps": max(len(a) for a in authorships),
        "rounds": rounds,
        "critical_steps": sum(max(r[k][1] for r in runs if len(r) > k) for k in range(rounds)),
        "continuous_steps": max(
            len(a) + len(r) - 1 for a, r in zip(authorships, runs, strict=True)
        ),
    }


def two_gpu_projection(steps: dict[str, int]) -> dict[str, float]:
    """Rollout time relative to one model alone, on two GPUs where a decode step costs one
    forward whatever the batch (small batches are memory-bound) and a catch-up prefill about
    as much: the senior alone steps `shared_steps` times, the shared engine as often with two
    forwards a step, the separate form along its critical path with one."""
    solo = steps["shared_steps"]
    return {
        "shared": 2.0,
        "separate_rounds": steps["critical_steps"] / solo,
        "separate_continuous": steps["continuous_steps"] / solo,
    }


def forms_variants(args: argparse.Namespace) -> tuple[dict[str, Run], Callable[[], dict]]:
    """The `--forms` variants as pinned Ray actors, and a function counting the separate
    form's rounds (`round_steps`) on one call's samples."""
    import ray

    from rlvr.config import load_config

    start_cluster(load_config(None, [f"generation.backend={args.backend}"]), Path(args.out))
    senior = str(resolve_model_path(args.model))
    junior = str(resolve_model_path(args.junior) if args.junior else senior)
    prompts = make_prompts(Path(senior), args.prompts)
    requests = [
        GenerationRequest(p, n=args.n, request_id=str(i), seed=1000 * i)
        for i, p in enumerate(prompts)
    ]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    tandem = {"junior_path": junior, "p": args.p, "cap": args.cap}
    common: dict = {"backend": args.backend, "dtype": args.dtype}
    if args.backend == "vllm":
        common |= {
            "max_model_len": max(len(p) for p in prompts) + args.max_tokens + 1,
            "kv_cache_gib": 0.5,
            "enforce_eager": not args.compile,
        }

    def actor(cores: list[int], threads: int = 1, **kwargs):
        env = {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}
        engine_threads = {"cpu_threads": threads} if args.backend == "vllm" else {}
        return (
            ray.remote(PinnedGenerator)
            .options(num_cpus=0, runtime_env=env)
            .remote(cores, **{**common, **engine_threads, "threads": threads, **kwargs})
        )

    solo = actor([0], model_path=senior)
    shared = actor([0], model_path=senior, tandem=tandem)
    shared_two = actor([0, 1], threads=2, model_path=senior, tandem=tandem)
    junior_role = {"p": args.p, "cap": args.cap, "role": "junior"}
    separate = {"tandem": {**tandem, "junior": "separate"}, "model_path": senior}
    one_core = actor([0], companion=actor([0], model_path=junior, tandem=junior_role), **separate)
    own_cores = actor([0], companion=actor([1], model_path=junior, tandem=junior_role), **separate)

    def call(engine, tandem_on: bool) -> Run:
        def run() -> int:
            results = ray.get(engine.generate.remote(requests, params, tandem=tandem_on))
            return sum(len(s.token_ids) for r in results for s in r.samples)

        return run

    kind = args.backend
    runs: dict[str, Run] = {
        f"{kind} solo": call(solo, False),
        f"{kind} shared": call(shared, True),
        f"{kind} shared 2 threads": call(shared_two, True),
        f"{kind} separate one core": call(one_core, True),
        f"{kind} separate own cores": call(own_cores, True),
    }

    def rounds() -> dict:
        results = ray.get(own_cores.generate.remote(requests, params, tandem=True))
        return round_steps([s.authorship for r in results for s in r.samples])

    return runs, rounds


def measure(runs: dict[str, Run], repeats: int) -> dict[str, dict[str, float]]:
    """Median seconds and tokens per variant over `repeats` alternating rounds."""
    for run in runs.values():
        run()  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    tokens: dict[str, list[int]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            tokens[name].append(run())
            seconds[name].append(time.perf_counter() - start)
    rows = {}
    for name in runs:
        s, t = statistics.median(seconds[name]), statistics.median(tokens[name])
        rows[name] = {"seconds": s, "tokens": t, "s_per_token": s / t}
    for name, row in rows.items():
        base = (
            rows[f"{name.split()[0]} solo"] if not name.startswith("segment") else rows["hf solo"]
        )
        row["ratio_wall"] = row["seconds"] / base["seconds"]
        row["ratio_per_token"] = row["s_per_token"] / base["s_per_token"]
    return rows


def plot(rows: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = list(rows)
    ax.barh(names, [1000 * rows[n]["s_per_token"] for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("ms per generated token (median)")
    ax.set_title("Tandem rollout cost")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


CONFIGS = {
    "grpo": "tiny.yaml",
    "tandem": "tiny-tandem.yaml",
    "kl-junior": "tiny-kl-junior.yaml",
}
TRAIN_COMMON = ["run.eval_every=0", "run.keep_last=1"]
COLUMNS = {
    "solo pass@1": ("solo_senior", "1"),
    "solo pass@K": ("solo_senior", "K"),
    "HR strict pass@1": ("strict", "1"),
    "HR strict pass@K": ("strict", "K"),
    "HR stochastic pass@1": ("stochastic", "1"),
    "HR stochastic pass@K": ("stochastic", "K"),
    "junior CE": ("legibility", "junior_ce"),
    "overlap": ("legibility", "overlap"),
    "KL(senior ‖ junior)": ("drift", "kl_to_junior"),
}


def metric(report: dict, column: str, k_max: int) -> float:
    """One table cell of one evaluation report."""
    part, key = COLUMNS[column]
    if part == "legibility":
        return report["legibility"][key]["mean"]
    if part == "drift":
        return report["drift"][key]
    block = report[part] if part == "solo_senior" else report["handoff"][part]
    return block["pass_at_k"][str(k_max) if key == "K" else key]["mean"]


def train_compare(args: argparse.Namespace) -> None:
    """Train the three methods per seed, evaluate every final checkpoint against the same junior."""
    import tempfile

    import ray

    from workflows.cluster import quiet_driver, ray_env

    ray_env()
    quiet_driver()
    from rlvr.config import load_config
    from workflows.tandem_eval import EvalSettings, evaluate_tandem
    from workflows.train import prepare, train

    configs = {name: ROOT / "configs" / f for name, f in CONFIGS.items()}
    start_cluster(load_config(configs["grpo"], TRAIN_COMMON), Path(args.out))
    reports: dict[str, dict[int, dict]] = {name: {} for name in CONFIGS}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for seed in args.seeds:
                for name, path in configs.items():
                    overrides = [
                        *TRAIN_COMMON,
                        f"run.steps={args.steps}",
                        f"run.seed={seed}",
                        f"run.name=bench-tandem-{name}-s{seed}",
                        *args.set,
                    ]
                    cfg = load_config(path, overrides)
                    prepared = prepare(cfg)
                    junior, _, test = prepared
                    summary = train(cfg, Path(tmp) / f"{name}-s{seed}", prepared=prepared)
                    g = cfg.generation
                    settings = EvalSettings(
                        n=args.eval_n,
                        ks=tuple(args.k),
                        temperature=args.eval_temperature,
                        top_p=args.eval_top_p,
                        max_tokens=g.max_tokens,
                        context_len=g.max_model_len,
                        step_boundary="\n",
                        seed=seed,
                        verifier_timeout_s=cfg.verifier.timeout_s,
                    )
                    engine = {"dtype": cfg.model.dtype}
                    if args.eval_backend == "vllm":
                        engine.update(
                            max_model_len=g.max_model_len,
                            kv_cache_gib=g.kv_cache_gib,
                            enforce_eager=g.enforce_eager,
                        )
                    reports[name][seed] = evaluate_tandem(
                        Path(summary["final_model"]),
                        junior,
                        {cfg.task.name: test},
                        cfg.task.instruction,
                        settings,
                        args.eval_backend,
                        engine,
                        chat_template=cfg.task.chat_template,
                    )
    finally:
        ray.shutdown()
    k_max = max(args.k)
    rows = {}
    for name, per_seed in reports.items():
        row = {}
        for column in COLUMNS:
            values = [metric(per_seed[s], column, k_max) for s in args.seeds]
            row[column] = {
                "mean": statistics.mean(values),
                "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
                "values": values,
            }
        rows[name] = row
    header = [c.replace("@K", f"@{k_max}") for c in COLUMNS]
    lines = [
        f"Tiny model, arithmetic, {args.steps} steps, seeds {args.seeds}, n={args.eval_n} "
        f"samples per held-out problem; mean ± sd over seeds; junior = the shared SFT-warmed "
        "start; handoff turns end at newlines.",
        "",
        "| method | " + " | ".join(header) + " |",
        "|---|" + "---|" * len(header),
    ]
    for name, row in rows.items():
        cells = [f"{row[c]['mean']:.4f} ± {row[c]['sd']:.4f}" for c in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_compare.md").write_text(table + "\n")
    (out / "train_compare.json").write_text(
        json.dumps({"args": vars(args), "rows": rows, "reports": reports}, indent=1)
    )
    plot_compare(rows, reports, k_max, out / "train_compare.png")
    print(f"wrote {out}")


def plot_compare(rows: dict, reports: dict, k_max: int, path: Path) -> None:
    """One bar panel per table column (mean ± sd over seeds) and the mean survival curves."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 7), layout="constrained")
    axes = fig.subplots(2, 5).ravel()
    names = list(rows)
    for ax, column in zip(axes, COLUMNS, strict=False):
        ax.bar(
            names,
            [rows[n][column]["mean"] for n in names],
            yerr=[rows[n][column]["sd"] for n in names],
            capsize=3,
        )
        ax.set_title(column.replace("@K", f"@{k_max}"), fontsize=9)
    ax = axes[len(COLUMNS)]
    for name, per_seed in reports.items():
        curves = [r["drift"]["survival"] for r in per_seed.values()]
        taus = next(iter(per_seed.values()))["drift"]["taus"]
        ax.plot(taus, [statistics.mean(v) for v in zip(*curves, strict=True)], label=name)
    ax.set(title="drift survival S(tau)", xlabel="tau")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="senior: 'tiny', 'smollm2' or a dir")
    parser.add_argument("--junior", default=None, help="junior (default: the senior's weights)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per call")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per response at most")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per variant")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--p", type=float, default=0.5, help="senior's share of author draws")
    parser.add_argument("--cap", type=int, default=32, help="K: redraw after K tokens")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--compile", action="store_true", help="let vLLM compile the models")
    parser.add_argument("--oracle", action="store_true", help="also time the segment loop")
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "tandem"))
    parser.add_argument("--train", action="store_true", help="training comparison mode")
    parser.add_argument("--forms", action="store_true", help="shared vs separate junior mode")
    parser.add_argument(
        "--backend", default="vllm", choices=["vllm", "hf"], help="--forms: the engine kind"
    )
    parser.add_argument("--steps", type=int, default=12, help="--train: steps per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="--train: seeds")
    parser.add_argument("--eval-n", type=int, default=8, help="--train: samples per problem")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8], help="--train: pass@k")
    parser.add_argument("--eval-temperature", type=float, default=0.7)
    parser.add_argument("--eval-top-p", type=float, default=0.8)
    parser.add_argument("--eval-backend", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("--set", action="append", default=[], help="--train: config override")
    args = parser.parse_args()
    if args.train:
        train_compare(args)
        return
    extra: dict = {}
    if args.forms:
        import ray

        try:
            runs, rounds = forms_variants(args)
            rows = measure(runs, args.repeats)
            extra = rounds()
            extra["two_gpus_x_solo"] = two_gpu_projection(extra)
        finally:
            ray.shutdown()
    else:
        runs, closers = variants(args)
        try:
            rows = measure(runs, args.repeats)
        finally:
            for close in closers:
                close()

    print(
        f"model={args.model} junior={args.junior or args.model} prompts={args.prompts} "
        f"n={args.n} max_tokens={args.max_tokens} temperature={args.temperature} p={args.p} "
        f"cap={args.cap} dtype={args.dtype} repeats={args.repeats} "
        f"threads={torch.get_num_threads()}"
    )
    print(
        f"{'variant':<24} {'seconds':>8} {'tokens':>7} {'ms/token':>9} "
        f"{'x solo wall':>12} {'x solo/token':>13}"
    )
    for name, r in rows.items():
        print(
            f"{name:<24} {r['seconds']:>8.2f} {r['tokens']:>7.0f} {1000 * r['s_per_token']:>9.2f} "
            f"{r['ratio_wall']:>12.2f} {r['ratio_per_token']:>13.2f}"
        )
    if extra:
        print(
            f"decode steps on the critical path: shared {extra['shared_steps']} (two forwards "
            f"each); separate {extra['critical_steps']} in {extra['rounds']} rounds; separate "
            f"with continuous hand-over {extra['continuous_steps']} (one forward each)"
        )
        print(
            "two GPUs, x solo (a step costs one forward whatever the batch): "
            + ", ".join(f"{k} {v:.2f}" for k, v in extra["two_gpus_x_solo"].items())
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{'forms_' + args.backend if args.forms else 'rollout_cost'}_{Path(args.model).name}"
    (out / f"{stem}.json").write_text(
        json.dumps({"args": vars(args), "rows": rows, **extra}, indent=2)
    )
    plot(rows, out / f"{stem}.png")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
