"""`rlvr calibrate`: fit the CSA score map of a checkpoint on a CAL split (arXiv:2605.20270:
Sec. 4.2 and App. H for the isotonic map, App. B.5 for the grid).

For each CAL problem: K self-consistency samples, the majority answer and raw score 1 - agreement,
the math verifier's verdict on that answer; then the isotonic map g(raw) -> P(fail) and the grid,
written as `csa_calibration.json` next to the checkpoint for `rlvr serve`. No Ray needed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

import numpy as np
import psutil

from rlvr.config import ConfigError, load_config
from rlvr.generation import make_backend
from rlvr.generation.base import GenerationBackend, GenerationRequest, SamplingParams
from rlvr.models import resolve_model_path
from rlvr.models.checkpoints import checkpoint_fingerprint, with_adapter
from rlvr.serving.api import CALIBRATION_FILE, DEFAULT_ALPHAS, Calibration, boxed, vote
from rlvr.tasks import load_problems, load_task
from rlvr.tasks.base import Problem
from rlvr.tasks.prompts import DEFAULT_INSTRUCTION, render_prompt
from rlvr.verifiers.math import MathVerifier

log = logging.getLogger(__name__)

CAL_SEED = 42
CAL_FRACTION = 0.2


@dataclass(frozen=True)
class EngineOptions:
    """The engine's size and mode, set as training (`model.dtype`, `generation.*`) and serving
    set theirs: weights dtype, context, a fixed KV cache (so vLLM starts however little memory
    is free instead of claiming its default share of it), eager mode, CPU threads (None: all)."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    max_model_len: int = 1024
    kv_cache_gib: float = 1.0
    enforce_eager: bool = False
    threads: int | None = None

    def check(self, backend: str) -> None:
        """Raise ConfigError naming the first bad option, before any engine starts."""
        if self.max_model_len < 1:
            _bad(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if not (math.isfinite(self.kv_cache_gib) and self.kv_cache_gib > 0):
            _bad(f"--kv-cache-gib must be a number > 0, got {self.kv_cache_gib}")
        if self.threads is not None and self.threads < 1:
            _bad(f"--threads must be >= 1, got {self.threads}")
        if backend == "vllm" and not _on_gpu():
            free = psutil.virtual_memory().available / 2**30
            if self.kv_cache_gib > free:
                _bad(
                    f"--kv-cache-gib {self.kv_cache_gib:g} exceeds the {free:.1f} GiB of free memory"
                )

    def backend_kwargs(self, backend: str) -> dict[str, Any]:
        """The options as `make_backend` keywords (the hf backend takes the dtype alone)."""
        if backend != "vllm":
            return {"dtype": self.dtype}
        return {
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "kv_cache_gib": self.kv_cache_gib,
            "enforce_eager": self.enforce_eager,
            "cpu_threads": self.threads,
        }


def _bad(problem: str) -> NoReturn:
    """Refuse a calibration input, in the words the CLI prints (exit status 2)."""
    raise ConfigError(f"invalid calibration input: {problem}")


def _on_gpu() -> bool:
    """Whether vLLM's KV cache would live on a GPU (else in this machine's memory)."""
    import torch

    return torch.cuda.is_available()


def load_cal_problems(data: str) -> tuple[list[Problem], str, bool, dict[str, Any]]:
    """(problems, instruction, chat_template, source) from a dataset file (chat-formatted prompts)
    or a training preset's held-out split (prompts rendered as the preset trains)."""
    if data.endswith((".yaml", ".yml")):
        cfg = load_config(data)
        _, test = load_task(cfg.task)
        task = cfg.task
        return test, task.instruction, task.chat_template, {"preset": data, "split": "test"}
    return load_problems(data), DEFAULT_INSTRUCTION, True, {"file": data}


def cal_split(problems: Sequence[Problem], fraction: float, seed: int = CAL_SEED) -> list[Problem]:
    """The CAL split: a seeded random `fraction` of the problems (at least one), in file order."""
    if not 0 < fraction <= 1:
        raise ValueError(f"the CAL fraction must lie in (0, 1], got {fraction}")
    n = max(1, math.ceil(fraction * len(problems)))
    picked = np.sort(np.random.default_rng(seed).permutation(len(problems))[:n])
    return [problems[i] for i in picked]


def calibrate(
    backend: GenerationBackend,
    problems: Sequence[Problem],
    *,
    k: int = 5,
    temperature: float = 0.7,
    top_p: float = 1.0,
    max_tokens: int = 256,
    instruction: str = DEFAULT_INSTRUCTION,
    chat_template: bool = True,
    seed: int = CAL_SEED,
    m: int = 15,
    spacing: str = "geometric",
    verifier_timeout_s: float = 5.0,
    batch_size: int = 32,
) -> Calibration:
    """Sample, vote, verify and fit: the calibration of `backend`'s model on `problems`.

    K samples per problem at (temperature, top_p, max_tokens), seeded per problem, on prompts
    rendered with `instruction` (raw text unless `chat_template`); the verdict is on the majority
    answer (the released object), and a problem with no extractable answer fails.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens)
    tokenizer = backend.tokenizer
    votes = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        requests = [
            GenerationRequest(
                prompt_ids=render_prompt(tokenizer, p, instruction, chat_template),
                n=k,
                request_id=p.id,
                seed=seed * 1_000_003 + start + i,
            )
            for i, p in enumerate(chunk)
        ]
        for result in backend.generate(requests, params):
            votes.append(vote([s.text for s in result.samples]))
    passed = [False] * len(problems)
    answered = [i for i, v in enumerate(votes) if v.answer is not None]
    with MathVerifier(num_workers=1, timeout=verifier_timeout_s) as verifier:
        verdicts = verifier.verify_batch(
            [boxed(votes[i].answer) for i in answered], [problems[i].answer for i in answered]
        )
    for i, (_, status) in zip(answered, verdicts, strict=True):
        passed[i] = status == "correct"
    return Calibration.fit(
        [v.raw for v in votes],
        passed,
        k=k,
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        m=m,
        spacing=spacing,
        instruction=instruction,
        chat_template=chat_template,
        problem_ids=[p.id for p in problems],
    )


def run_calibrate(
    checkpoint: str,
    data: str,
    *,
    adapter: str | None = None,
    out: str | None = None,
    backend: str = "vllm",
    cal_fraction: float = CAL_FRACTION,
    seed: int = CAL_SEED,
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    instruction: str | None = None,
    engine: EngineOptions | None = None,
    **fit_kwargs: Any,
) -> tuple[Path, Calibration]:
    """The `rlvr calibrate` command: resolve, split, calibrate, write; returns (path, calibration).

    `engine` sizes the backend (default `EngineOptions()`). Bad inputs raise ConfigError before
    any model loads. The artefact goes to `out`, else next to the adapter when one is given, else
    into the checkpoint directory.
    """

    engine = engine or EngineOptions()
    engine.check(backend)
    if fit_kwargs.get("max_tokens", 256) >= engine.max_model_len:
        _bad("--max-tokens must be < --max-model-len")
    try:
        model_dir = resolve_model_path(checkpoint)
    except FileNotFoundError as err:
        raise ConfigError(f"invalid calibration input: --checkpoint: {err}") from None
    try:
        model_dir = with_adapter(model_dir, adapter)
    except FileNotFoundError as err:
        raise ConfigError(f"invalid calibration input: --adapter: {err}") from None
    try:
        problems, preset_instruction, chat_template, source = load_cal_problems(data)
        cal = cal_split(problems, cal_fraction, seed)
    except (ValueError, ConfigError) as err:
        raise ConfigError(f"invalid calibration input: --data: {err}") from None
    target = Path(out) if out else Path(adapter or model_dir) / CALIBRATION_FILE
    if engine.threads is not None:
        import torch

        torch.set_num_threads(engine.threads)
    model = make_backend(backend, model_dir, **engine.backend_kwargs(backend))
    try:
        log.info("calibrating %s on %d CAL problems", model_dir, len(cal))
        result = calibrate(
            model,
            cal,
            instruction=instruction if instruction is not None else preset_instruction,
            chat_template=chat_template,
            seed=seed,
            **fit_kwargs,
        )
    finally:
        model.close()
    result.checkpoint = checkpoint_fingerprint(model_dir)
    result.source = {
        **source,
        "chat_template": chat_template,
        "cal_fraction": cal_fraction,
        "seed": seed,
        "n_data": len(problems),
    }
    return result.save(target, alphas), result
