"""One PolicyTrainer step captured (log-probs, metrics, gradients, weights before and after) and
compared with the CPU fp32 reference within derived tolerances (`bench/gpu_check.py` says how).
DeepSpeed and pydantic are imported where used: on a GPU machine they come from the carried
wheels, installed after this module is loaded."""

from __future__ import annotations

import gc
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from rlvr.training.lm_head import causal_lm

LR = 1e-3
"""Large enough that AdamW's first step (lr per weight) moves a bf16 weight of the init's size
(0.02: ulp 1.2e-4) by several ulps, so the weight check sees it."""
NO_CLIP = 1e9
"""Gradient clipping off: AdamW's first step is then a closed form of the captured gradient."""
MICRO_BATCH = 4
LORA_RANK = 8
SAFETY = 4.0
"""K of the tolerances: four standard deviations of a random walk of rounding errors."""
STAGES_PER_LAYER = 6
"""Chained reductions per decoder layer: q/k/v, scores, scores x values, o, gate/up, down."""
UNIT_ROUNDOFF = {"float32": 2.0**-24, "tf32": 2.0**-11, "bfloat16": 2.0**-9}
TRAINER_CASES = tuple(
    (stage, dtype, lora)
    for stage in (0, 2)
    for dtype in ("float32", "bfloat16")
    for lora in (False, True)
)


def unit_roundoff(dtype: str) -> float:
    """u of ``dtype``'s matmuls; fp32 is TF32's where torch lets matmuls use it."""
    if dtype == "float32" and torch.get_float32_matmul_precision() != "highest":
        return UNIT_ROUNDOFF["tf32"]
    return UNIT_ROUNDOFF[dtype]


def relative_tolerance(dtype: str, config: dict[str, int]) -> float:
    """Relative error a correct forward + backward in ``dtype`` may show against another
    (`bench/gpu_check.py` derives it): K u sqrt(S n) in fp32, K u sqrt(S) in bf16."""
    stages = 2 * (STAGES_PER_LAYER * config["layers"] + 1)
    if dtype == "bfloat16":
        return SAFETY * unit_roundoff(dtype) * math.sqrt(stages)
    widest = max(config["hidden"], config["intermediate"], config["vocab"], config["tokens"])
    return SAFETY * unit_roundoff(dtype) * math.sqrt(stages * widest)


def ulp(x: Any, dtype: Any) -> Any:
    """The spacing of ``dtype``'s numbers at ``x`` (float64 in, float64 out)."""
    mantissa_bits = {torch.float32: 23, torch.bfloat16: 7}[dtype]
    _, exponent = torch.frexp(x.abs().clamp_min(torch.finfo(dtype).tiny))
    return torch.ldexp(torch.ones_like(x), exponent - 1 - mantissa_bits)


# ---------------------------------------------------------------------------- one trainer step


@dataclass
class TrainerRun:
    """What one PolicyTrainer step on the check batch gives, on the CPU: log-probs before the
    step, its metrics, and per compared tensor the gradient and the weights before and after."""

    logp: Any
    loss: float
    entropy: float
    grad_norm: float
    grads: dict[str, Any]
    before: dict[str, Any]
    after: dict[str, Any]
    weight_dtype: Any
    lr: float
    eps: float
    trainable: int
    logit_scale: float
    config: dict[str, int]


def compared_names(names: list[str], layers: int, every: bool) -> list[str]:
    """All ``names``, or (a large model) those of its first and last layers and every tensor
    outside the layers: each kind of tensor once at each end, a fraction of the copies."""
    if every:
        return names
    ends = {0, layers - 1}
    chosen = []
    for name in names:
        found = re.search(r"\.layers\.(\d+)\.", name)
        if found is None or int(found.group(1)) in ends:
            chosen.append(name)
    return chosen


def train_once(
    model_dir: Path,
    batch: Any,
    *,
    zero_stage: int,
    dtype: str,
    lora: bool,
    old_logp: Any = None,
    names: list[str] | None = None,
) -> TrainerRun:
    """One PolicyTrainer step (micro-batches of `MICRO_BATCH`, lr `LR`, no clipping) on
    whatever device DeepSpeed finds, with pi_old = ``old_logp`` (default: its own log-probs, as
    the reference takes them). ``names`` picks the compared tensors (default `compared_names`)."""
    from deepspeed.utils import safe_get_full_grad

    from rlvr.training.policy_trainer import PolicyTrainer
    from rlvr.training.settings import LoraSettings

    trainer = PolicyTrainer(
        model_dir,
        zero_stage=zero_stage,
        dtype=dtype,
        lora=LoraSettings(r=LORA_RANK, alpha=2 * LORA_RANK) if lora else None,
        lr=LR,
        grad_clip=NO_CLIP,
        micro_batch_size=MICRO_BATCH,
        seed=0,
    )
    try:
        engine = trainer.engine
        logp = trainer.logprobs(batch)
        batch = replace(batch, old_logp=logp if old_logp is None else old_logp)
        trainable = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
        hf_config = causal_lm(engine).config
        layers = hf_config.num_hidden_layers
        if names is None:
            names = compared_names(list(trainable), layers, lora or layers <= 2)
        params = {n: trainable[n] for n in names}
        before = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in params.items()}
        grads: dict[str, torch.Tensor] = {}
        step = engine.step

        def capture_then_step() -> None:
            for n, p in params.items():
                grads[n] = safe_get_full_grad(p).to("cpu", torch.float32, copy=True)
            step()

        engine.step = capture_then_step
        try:
            metrics = trainer.train_step(batch)
        finally:
            engine.step = step
        after = {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in params.items()}
        group = engine.optimizer.param_groups[0]
        mb = batch.to(trainer.device)
        with torch.no_grad():
            logits = engine.module(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        logit_scale = float(logits[mb.attention_mask.bool()].abs().max())
        return TrainerRun(
            logp=logp,
            loss=metrics["loss"],
            entropy=metrics["entropy"],
            grad_norm=metrics["grad_norm"],
            grads=grads,
            before=before,
            after=after,
            weight_dtype=next(iter(params.values())).dtype,
            lr=float(group["lr"]),
            eps=float(group["eps"]),
            trainable=sum(p.numel() for p in trainable.values()),
            logit_scale=logit_scale,
            config={
                "layers": layers,
                "hidden": hf_config.hidden_size,
                "intermediate": hf_config.intermediate_size,
                "vocab": hf_config.vocab_size,
                "tokens": int(batch.attention_mask.sum()),
            },
        )
    finally:
        release(trainer)


def release(trainer: Any) -> None:
    """Free a trainer's device memory before the next one (DeepSpeed's engine holds hooks and
    optimizer state until destroyed)."""

    trainer.engine.destroy()
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class Verdict:
    """A comparison: each error over its tolerance, the weights past theirs, the raw numbers;
    it passes when every ratio is at most 1 and no weight is past its tolerance."""

    ratios: dict[str, float]
    weights_over: int
    data: dict[str, Any]

    @property
    def passed(self) -> bool:
        return all(r <= 1.0 for r in self.ratios.values()) and self.weights_over == 0

    def summary(self) -> str:
        parts = [f"{key} {ratio:.2g}" for key, ratio in self.ratios.items()]
        parts.append(f"{self.weights_over} weights past tolerance")
        parts.append(self.data["note"])
        return " · ".join(parts)


def adamw_first_step(g: torch.Tensor, eps: float) -> torch.Tensor:
    """AdamW's first update of a weight with gradient ``g``, in units of lr (no weight decay)."""
    return g / (g.abs() + eps)


def compare_runs(ref: TrainerRun, got: TrainerRun, batch: Any, dtype: str) -> Verdict:
    """``got`` against the fp32 reference ``ref`` within the tolerances `bench/gpu_check.py`
    derives, for a run in ``dtype``."""

    rel = relative_tolerance(dtype, ref.config)
    z = ref.logit_scale
    mask = batch.response_mask
    tol_logp = 2 * rel * z
    errors = {
        "logp": (float((got.logp - ref.logp)[mask].abs().max()), tol_logp),
        "loss": (
            abs(got.loss - ref.loss),
            float(batch.advantages.abs().max()) * math.expm1(tol_logp),
        ),
        "entropy": (abs(got.entropy - ref.entropy), 2 * rel * z * z),
        "grad norm": (abs(got.grad_norm - ref.grad_norm) / ref.grad_norm, rel),
    }
    if got.grads.keys() != ref.grads.keys():
        raise ValueError("the runs compared different tensors")
    model_rms = ref.grad_norm / math.sqrt(ref.trainable)
    worst, worst_name = 0.0, ""
    over, flips, elements = 0, 0, 0
    u32 = UNIT_ROUNDOFF["float32"]
    for name, g_ref in ref.grads.items():
        g_got = got.grads[name]
        scale = max(float(g_ref.pow(2).mean().sqrt()), model_rms)
        ratio = float((g_got - g_ref).pow(2).mean().sqrt()) / (rel * scale)
        if ratio > worst:
            worst, worst_name = ratio, name
        gr, gg = g_ref.double(), g_got.double()
        w0r, w1r = ref.before[name].double(), ref.after[name].double()
        w0g, w1g = got.before[name].double(), got.after[name].double()

        allowed = (
            (w0g - w0r).abs()
            + ref.lr * (adamw_first_step(gg, got.eps) - adamw_first_step(gr, ref.eps)).abs()
            + ulp(w1g, got.weight_dtype)
            + 8 * u32 * (w0r.abs() + ref.lr)
        )
        over += int(((w1g - w1r).abs() > allowed).sum())
        flips += int((torch.sign(gg) != torch.sign(gr)).sum())
        elements += g_ref.numel()
    ratios = {
        key: err / tol if tol > 0 else (0.0 if err == 0 else math.inf)
        for key, (err, tol) in errors.items()
    }
    ratios["grads"] = worst
    data = {
        "relative_tolerance": rel,
        "logit_scale": z,
        "errors": {key: {"error": e, "tolerance": t} for key, (e, t) in errors.items()},
        "worst_gradient": worst_name,
        "weights_over_tolerance": over,
        "gradient_sign_flips": flips,
        "compared_elements": elements,
        "note": f"{flips} of {elements} gradient signs differ",
    }
    return Verdict(ratios, over, data)


def save_run(run: TrainerRun, path: Path) -> None:
    torch.save(asdict(run), path)


def load_run(path: Path) -> TrainerRun:
    return TrainerRun(**torch.load(path, weights_only=False))
