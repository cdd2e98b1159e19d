"""GeneratorActor: owns a generation backend (vLLM by default, transformers as fallback).

Receives new weights after every training step through `update_weights` (named tensors via the
object store on CPU) and keeps a running tokens/s figure.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from rlvr.generation import make_backend
from rlvr.generation.base import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    StopRuleFactory,
)


class GeneratorActor:
    def __init__(self, backend: str, model_path: str, threads: int, **backend_kwargs: Any):
        torch.set_num_threads(threads)
        self.backend = make_backend(backend, model_path, **backend_kwargs)
        self.tokens = 0
        self.seconds = 0.0
        self.weight_version = 0

    def ready(self) -> bool:
        return True

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        stop_rule_factory: StopRuleFactory | None = None,
    ) -> list[GenerationResult]:
        t = time.perf_counter()
        results = self.backend.generate(requests, params, stop_rule_factory)
        self.seconds += time.perf_counter() - t
        self.tokens += sum(len(s.token_ids) for r in results for s in r.samples)
        return results

    def update_weights(self, named_tensors: dict[str, torch.Tensor]) -> int:
        self.backend.load_weights(named_tensors.items())
        self.weight_version += 1
        return self.weight_version

    def stats(self) -> dict[str, float]:
        return {
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "weight_version": self.weight_version,
        }
