"""ReferenceActor: the frozen reference model of DRO: rubric author, rubric judge, optional R3 scorer.

A thin shell over `rlvr.verifiers.rubric`: it owns a generation backend on the initial checkpoint
(never synced with the policy) or, for the keyword judge, no model at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rlvr.generation import make_backend
from rlvr.verifiers.rubric import (
    JudgeRequest,
    KeywordRubricModel,
    ReferenceRubricModel,
    RubricModel,
    RubricQuery,
    RubricSet,
    build_rubrics,
    judge_answers,
)


class ReferenceActor:
    def __init__(
        self,
        judge: str,
        threads: int,
        model_path: str | None = None,
        backend: str | None = None,
        max_tokens: int = 512,
        max_model_len: int = 1024,
        seed: int = 0,
        **backend_kwargs: Any,
    ):
        """`judge` "keyword" needs nothing else; "reference" starts `backend` on `model_path`."""
        torch.set_num_threads(threads)
        self.backend = None
        self.model: RubricModel
        if judge == "keyword":
            self.model = KeywordRubricModel()
        elif judge == "reference":
            if model_path is None or backend is None:
                raise ValueError("the reference judge needs model_path and backend")
            if backend == "vllm":
                backend_kwargs["max_model_len"] = max_model_len
            self.backend = make_backend(backend, model_path, **backend_kwargs)
            self.model = ReferenceRubricModel(
                self.backend, self.backend.tokenizer, max_model_len, max_tokens, seed
            )
        else:
            raise ValueError(f"unknown judge {judge!r}; choose 'reference' or 'keyword'")

    def ready(self) -> bool:
        return True

    def build_rubrics(self, queries: Sequence[RubricQuery]) -> list[RubricSet]:
        return build_rubrics(self.model, queries)

    def judge_answers(self, requests: Sequence[JudgeRequest]) -> tuple[list[np.ndarray], int]:
        return judge_answers(self.model, requests)

    def score_logprobs(
        self, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """Reference-model log-probs at `positions` (DRO's scorer='reference')."""
        if self.backend is None:
            raise ValueError("the keyword judge holds no model to score with")
        return self.backend.score_logprobs(sequences, positions)

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
