"""`rlvr tandem-eval`: Tandem RL's held-out evaluation of a trained senior against a junior
(arXiv:2606.28166, Sec. 4 and App. B.3): solo pass@k, handoff robustness (strict and stochastic),
legibility (junior cross-entropy, distribution overlap) and marginal-token drift, written as JSON
and PNG plots.

Pure evaluation in this process (no Ray): generation through the backends, teacher-forced passes
through transformers; the metric math lives in `rlvr.algorithms.tandem.metrics`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlvr.algorithms.tandem import metrics as tm
from rlvr.config import ConfigError
from rlvr.generation import make_backend
from rlvr.generation.base import GenerationBackend, GenerationRequest, SamplingParams
from rlvr.generation.tandem_support import check_same_tokenizer
from rlvr.models import resolve_model_path
from rlvr.tasks.base import Problem
from rlvr.tasks.prompts import render_prompt
from rlvr.verifiers.math import MathVerifier
from workflows.checkpoints import resolve_checkpoint, run_config

log = logging.getLogger(__name__)

SEED_STRIDE = 10_007
"""Problem i's samples draw from seed + SEED_STRIDE * i + j (independent streams per problem)."""
BOUNDARY_TAIL = 4
"""Tokens decoded to test whether a turn has just completed its step boundary."""


@dataclass(frozen=True)
class EvalSettings:
    """Sampling and aggregation settings; the defaults are the evaluation settings of the authors'
    code (the paper's text does not give them)."""

    n: int = 8
    """Samples (solo) and chains (handoff) per problem."""
    ks: tuple[int, ...] = (1, 2, 4, 8)
    temperature: float = 0.7
    top_p: float = 0.8
    max_tokens: int = 3000
    """Solo response length and the handoff chains' shared budget (cut to fit context_len)."""
    context_len: int = 4096
    step_boundary: str = "\n\n"
    """A handoff turn ends once the team text ends with this string."""
    max_rounds: int = 150
    p: float = 0.5
    """Senior's chance to write the next turn in the stochastic handoff schedule."""
    seed: int = 0
    n_boot: int = 1000
    verifier_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.ks or min(self.ks) < 1 or max(self.ks) > self.n:
            raise ValueError(f"every k must lie in 1..n={self.n}, got {list(self.ks)}")


# --- generation and scoring ---------------------------------------------------------------------


class StepEnd:
    """Stop rule of a handoff turn: fires after the token that makes the turn end with the step
    boundary (the engine then forces EOS, which the turn drops); `at` is the turn's length."""

    def __init__(self, tokenizer: Any, boundary: str) -> None:
        self.tokenizer = tokenizer
        self.boundary = boundary
        self.at: int | None = None

    def should_stop(self, generated_ids: Sequence[int]) -> bool:
        """True once the decoded tail of the turn ends with the boundary."""
        tail = self.tokenizer.decode(list(generated_ids[-BOUNDARY_TAIL:]))
        if tail.endswith(self.boundary):
            self.at = len(generated_ids)
            return True
        return False

    def flags(self) -> dict[str, Any]:
        """Where the boundary ended the turn (None: EOS or the token allowance ended it)."""
        return {"step_end": self.at}


def backend_turn_writer(
    backend: GenerationBackend, boundary: str, settings: EvalSettings
) -> tm.TurnWriter:
    """A `TurnWriter` over a generation backend: one seeded sample per turn, cut at the step
    boundary by `StepEnd` (Sec. 4.3's step schedule; in-engine token ids with no retokenization,
    as in the authors' in-engine code)."""

    def write(requests: list[tm.TurnRequest]) -> list[tm.Turn]:
        rules: list[StepEnd] = []

        def rule(i: int, _j: int) -> StepEnd:
            rules.append(StepEnd(backend.tokenizer, boundary))
            return rules[-1]

        # One call per distinct allowance: SamplingParams is shared by a call's requests.
        turns: dict[int, tm.Turn] = {}
        for allowance in sorted({r.max_tokens for r in requests}):
            idx = [i for i, r in enumerate(requests) if r.max_tokens == allowance]
            rules.clear()
            results = backend.generate(
                [
                    GenerationRequest(requests[i].context_ids, 1, str(i), requests[i].seed)
                    for i in idx
                ],
                SamplingParams(settings.temperature, settings.top_p, max_tokens=allowance),
                stop_rule_factory=rule,
            )
            for i, step_end, result in zip(idx, list(rules), results, strict=True):
                sample = result.samples[0]
                if step_end.at is not None:
                    turns[i] = tm.Turn(sample.token_ids[: step_end.at], eos=False)
                else:
                    turns[i] = tm.Turn(sample.token_ids, eos=sample.finish_reason == "stop")
        return [turns[i] for i in range(len(requests))]

    return write


def _solo(
    backend: GenerationBackend, prompts: list[list[int]], settings: EvalSettings
) -> list[list[Any]]:
    """n seeded solo samples per prompt (problem i's stream starts at seed + SEED_STRIDE * i)."""
    params = SamplingParams(settings.temperature, settings.top_p, settings.max_tokens)
    requests = [
        GenerationRequest(p, settings.n, str(i), settings.seed + SEED_STRIDE * i)
        for i, p in enumerate(prompts)
    ]
    return [r.samples for r in backend.generate(requests, params)]


def _correct(verifier: MathVerifier, texts: list[str], golds: list[str]) -> list[bool]:
    return [reward >= 1.0 for reward, _ in verifier.verify_batch(texts, golds)]


def _by_problem(
    flat: Sequence[float], benchmarks: Mapping[str, Sequence[Problem]], n: int
) -> dict[str, dict[str, list[float]]]:
    """Regroup values laid out benchmark by benchmark, problem by problem, n per problem."""
    out: dict[str, dict[str, list[float]]] = {}
    i = 0
    for bench, problems in benchmarks.items():
        out[bench] = {}
        for p in problems:
            out[bench][p.id] = list(flat[i : i + n])
            i += n
    return out


def _defined(
    values: Mapping[str, Mapping[str, Sequence[float]]],
) -> dict[str, dict[str, list[float]]]:
    """Drop undefined (NaN) samples, e.g. an EOS-only response, and problems left with none."""
    out = {}
    for bench, problems in values.items():
        kept = {p: [v for v in vs if not np.isnan(v)] for p, vs in problems.items()}
        out[bench] = {p: vs for p, vs in kept.items() if vs}
    return out


def _summary(values: Mapping[str, Mapping[str, Sequence[float]]], settings: EvalSettings) -> dict:
    """Macro mean, its bootstrap SE over problems, and the per-benchmark means."""
    m = tm.macro_mean(values)
    per_problem = {b: list(p.values()) for b, p in m.per_problem.items()}
    se = tm.bootstrap_macro_se(per_problem, settings.n_boot, settings.seed)
    return {"mean": m.macro, "se": se, "per_benchmark": m.per_benchmark}


def _pass_at_k(correct: Mapping[str, Mapping[str, Sequence[bool]]], settings: EvalSettings) -> dict:
    table = tm.pass_at_k_table(correct, settings.ks)
    return {str(k): _summary(table[k], settings) for k in settings.ks}


@torch.inference_mode()
def _legibility(
    senior_dir: Path,
    junior_dir: Path,
    sequences: list[tuple[list[int], list[int]]],
    stop_ids: set[int],
) -> tuple[list[float], list[float]]:
    """Per-sample junior CE and overlap over each (prompt, response) pair's response tokens,
    teacher-forced through both models (EOS excluded, full vocabulary, temperature 1)."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    senior = AutoModelForCausalLM.from_pretrained(senior_dir, dtype=dtype).to(device).eval()
    junior = AutoModelForCausalLM.from_pretrained(junior_dir, dtype=dtype).to(device).eval()
    ce, overlap = [], []
    for prompt, response in sequences:
        response = response[:-1] if response and response[-1] in stop_ids else response
        if not response:
            ce.append(float("nan"))
            overlap.append(float("nan"))
            continue
        ids = torch.tensor([prompt + response], device=device)
        # keep the logits predicting the response tokens only (the last one predicts nothing)
        keep = len(response) + 1
        s = senior(ids, logits_to_keep=keep).logits[:, :-1]
        j = junior(ids, logits_to_keep=keep).logits[:, :-1]
        target = torch.tensor([response], device=device)
        mask = torch.ones_like(target, dtype=torch.bool)
        ce.append(float(tm.junior_cross_entropy(j, target, mask)[0]))
        overlap.append(float(tm.distribution_overlap(s, j, mask)[0]))
    del senior, junior
    return ce, overlap


# --- the evaluation -----------------------------------------------------------------------------


def evaluate_tandem(
    senior_dir: Path,
    junior_dir: Path,
    benchmarks: Mapping[str, Sequence[Problem]],
    instruction: str,
    settings: EvalSettings,
    backend: str = "vllm",
    backend_kwargs: dict[str, Any] | None = None,
    chat_template: bool = True,
) -> dict[str, Any]:
    """All Tandem evaluation metrics of the senior in `senior_dir` against the junior in
    `junior_dir` on `benchmarks` (name -> held-out problems); returns a JSON-ready dict.

    Solo samples of both models (pass@k; the junior's are the drift reference), handoff chains
    at `settings.step_boundary` (strict alternation and Bernoulli(p) turns, senior first, shared
    budget), junior CE and overlap on the senior's solo responses, marginal drift of the senior's
    solo tokens from the junior's. Macro values carry bootstrap SEs over problems. Prompts are
    rendered as the run trained (`chat_template`: task.chat_template).
    """
    from transformers import AutoConfig, AutoTokenizer

    check_same_tokenizer(senior_dir, junior_dir)
    tokenizer = AutoTokenizer.from_pretrained(senior_dir)
    problems = [p for ps in benchmarks.values() for p in ps]
    prompts = [render_prompt(tokenizer, p, instruction, chat_template) for p in problems]
    golds = [p.answer for p in problems for _ in range(settings.n)]
    kwargs = dict(backend_kwargs or {})
    senior = make_backend(backend, senior_dir, **kwargs)
    same = senior_dir.resolve() == junior_dir.resolve()
    junior = senior if same else make_backend(backend, junior_dir, **kwargs)
    report: dict[str, Any] = {
        "senior": str(senior_dir),
        "junior": str(junior_dir),
        "settings": asdict(settings),
        "backend": backend,
        "problems": {b: len(ps) for b, ps in benchmarks.items()},
    }
    try:
        with MathVerifier(num_workers=1, timeout=settings.verifier_timeout_s) as verifier:
            solo = {}
            for name, engine in (("senior", senior), ("junior", junior)):
                samples = [s for per in _solo(engine, prompts, settings) for s in per]
                solo[name] = samples
                correct = _correct(verifier, [s.text for s in samples], golds)
                report[f"solo_{name}"] = {
                    "pass_at_k": _pass_at_k(_by_problem(correct, benchmarks, settings.n), settings),
                    "length_mean": float(np.mean([len(s.token_ids) for s in samples])),
                }
            chains_prompts = [p for p in prompts for _ in range(settings.n)]
            budgets = [
                tm.handoff_budget(len(p), settings.max_tokens, settings.context_len)
                for p in chains_prompts
            ]
            seeds = [
                settings.seed + SEED_STRIDE * i + j
                for i in range(len(prompts))
                for j in range(settings.n)
            ]
            boundary = settings.step_boundary
            writers = [backend_turn_writer(e, boundary, settings) for e in (senior, junior)]
            report["handoff"] = {}
            for schedule in ("strict", "stochastic"):
                chains = tm.handoff_rollouts(
                    chains_prompts,
                    *writers,
                    budgets,
                    seeds,
                    schedule,
                    settings.p,
                    settings.max_rounds,
                )
                texts = [tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in chains]
                correct = _correct(verifier, texts, golds)
                report["handoff"][schedule] = {
                    "pass_at_k": _pass_at_k(_by_problem(correct, benchmarks, settings.n), settings),
                    "senior_share": float(np.mean([c.senior_share for c in chains])),
                    "rounds_mean": float(np.mean([c.rounds for c in chains])),
                }
    finally:
        if junior is not senior:
            junior.close()
        senior.close()

    stop_ids = {tokenizer.eos_token_id}
    pairs = [(prompts[i // settings.n], s.token_ids) for i, s in enumerate(solo["senior"])]
    ce, overlap = _legibility(senior_dir, junior_dir, pairs, stop_ids)
    report["legibility"] = {
        name: _summary(_defined(_by_problem(values, benchmarks, settings.n)), settings)
        for name, values in (("junior_ce", ce), ("overlap", overlap))
    }

    vocab = max(
        AutoConfig.from_pretrained(d).get_text_config().vocab_size for d in (senior_dir, junior_dir)
    )
    counts = {
        name: tm.token_counts([s.token_ids for s in samples], vocab)
        for name, samples in solo.items()
    }
    drift = tm.marginal_drift(counts["senior"], counts["junior"])
    report["drift"] = {
        "kl_to_junior": drift.kl_to_junior,
        "kl_from_junior": drift.kl_from_junior,
        "taus": drift.taus.tolist(),
        "survival": drift.survival.tolist(),
        "frequent_tokens": int((counts["junior"] >= 20).sum()),
        "over_emitted": [
            {
                "id": v,
                "token": tokenizer.decode([v]),
                "log_ratio": d,
                "count": c,
                "junior_count": cj,
            }
            for v, d, c, cj in tm.over_emitted(drift.log_ratio, counts["senior"], counts["junior"])
        ],
    }
    return report


def plot_report(report: dict[str, Any], out: Path) -> list[Path]:
    """pass_at_k.png (solo senior and junior, both handoff schedules) and survival.png."""
    from matplotlib.figure import Figure

    ks = [int(k) for k in report["solo_senior"]["pass_at_k"]]
    curves = {
        "senior solo": report["solo_senior"]["pass_at_k"],
        "junior solo": report["solo_junior"]["pass_at_k"],
        "handoff strict": report["handoff"]["strict"]["pass_at_k"],
        "handoff stochastic": report["handoff"]["stochastic"]["pass_at_k"],
    }
    fig = Figure(figsize=(5.5, 4), layout="constrained")
    ax = fig.subplots()
    for name, curve in curves.items():
        ax.errorbar(
            ks,
            [curve[str(k)]["mean"] for k in ks],
            yerr=[curve[str(k)]["se"] for k in ks],
            marker="o",
            capsize=3,
            label=name,
        )
    ax.set(xscale="log", xlabel="k", ylabel="pass@k (macro)", title="pass@k", ylim=(0, 1.02))
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.legend()
    paths = [out / "pass_at_k.png", out / "survival.png"]
    fig.savefig(paths[0], dpi=120)
    fig = Figure(figsize=(5.5, 4), layout="constrained")
    ax = fig.subplots()
    d = report["drift"]
    ax.plot(d["taus"], d["survival"], label=f"senior (KL {d['kl_to_junior']:.4f})")
    ax.set(
        xlabel="tau",
        ylabel="share of frequent tokens with |d(v)| > tau",
        title="drift from the junior (survival curve)",
        ylim=(0, 1.02),
    )
    ax.legend()
    fig.savefig(paths[1], dpi=120)
    return paths


def run_tandem_eval(
    checkpoint: str,
    junior: str | None = None,
    config: str | None = None,
    out: str | None = None,
    backend: str = "vllm",
    **settings: Any,
) -> tuple[Path, dict[str, Any]]:
    """The `rlvr tandem-eval` command: resolve the checkpoint, the junior (default: the run's starting
    model) and the held-out problems of the run's task; evaluate; write evaluation.json and the
    plots into `out` (default: `<checkpoint>/tandem_eval`). Bad inputs raise ConfigError first."""
    from workflows.train import prepare

    path = Path(checkpoint).expanduser()
    cfg, run_dir = run_config(path, config)
    base_dir, _, test = prepare(cfg)
    try:
        senior_dir = resolve_checkpoint(path, base_dir, cfg)
        if junior is not None:
            junior_dir = resolve_model_path(junior, seed=cfg.model.seed)
        elif cfg.algorithm.name == "tandem":
            from rlvr.methods.tandem.shaping import junior_dir as run_junior

            junior_dir = run_junior(cfg, base_dir)
        else:
            junior_dir = base_dir  # the run's starting model
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"invalid evaluation input: {err}") from None
    g = cfg.generation
    settings.setdefault("max_tokens", g.max_tokens)
    settings.setdefault("context_len", g.max_model_len)
    settings.setdefault("verifier_timeout_s", cfg.verifier.timeout_s)
    try:
        eval_settings = EvalSettings(**settings)
    except ValueError as err:
        raise ConfigError(f"invalid evaluation input: {err}") from None
    kwargs: dict[str, Any] = {"dtype": cfg.engine_dtype}
    if backend == "vllm":
        kwargs.update(
            max_model_len=g.max_model_len,
            kv_cache_gib=g.kv_cache_gib,
            enforce_eager=g.enforce_eager,
            engine_loop=g.engine_loop,
        )
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = 0.4  # two engines share the device
    log.info("evaluating %s against junior %s on %d problems", senior_dir, junior_dir, len(test))
    report = evaluate_tandem(
        senior_dir,
        junior_dir,
        {cfg.task.name: test},
        cfg.task.instruction,
        eval_settings,
        backend,
        kwargs,
        chat_template=cfg.task.chat_template,
    )
    report["checkpoint"] = checkpoint
    target = Path(out) if out else (run_dir or senior_dir) / f"tandem_eval-{path.name}"
    target.mkdir(parents=True, exist_ok=True)
    (target / "evaluation.json").write_text(json.dumps(report, indent=2))
    plot_report(report, target)
    return target, report
