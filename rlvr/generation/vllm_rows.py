"""The base of this project's vLLM V1 batch logits processors: row bookkeeping over vLLM's
persistent batch, shared by the stop-rule processor and Tandem's author processor.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from vllm.config import VllmConfig
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality


class RowTrackingLogitsProcessor(LogitsProcessor):
    """Base of this project's V1 batch logits processors: it follows vLLM's persistent batch.

    vLLM builds one instance per engine and tells it how requests enter, leave and move between
    rows of its persistent batch (`update_state`); the processor keeps row -> (entry, live output
    ids) for the requests whose extra_args name an entry of `registry` under `extra_arg`. Entries
    are consulted in `apply`, which runs right before sampling, when the output ids are final for
    this step (with async scheduling on GPUs, `update_state` may still see placeholders).
    Subclasses change the argmax, so vLLM must apply them before greedy sampling too.
    """

    extra_arg: ClassVar[str]
    registry: ClassVar[dict[str, Any]]

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._rows: dict[int, tuple[Any, list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        """Forcing or replacing logits changes the argmax, so greedy rows must see it as well."""
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Follow the persistent batch; BatchUpdate is applied in its documented order:
        removed, then added (which may reuse a freed row), then moved."""
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._rows.pop(index, None)
        for index, params, _prompt_ids, output_ids in batch_update.added:
            key = (params.extra_args or {}).get(self.extra_arg)
            if key is None:
                self._rows.pop(index, None)
                continue
            entry = self.registry.get(key)
            if entry is None:
                raise RuntimeError(
                    f"{self.extra_arg} {key!r} is not registered: the engine core is not in this "
                    "process or the request outlived its generate() call"
                )
            self._rows[index] = (entry, output_ids)
        for a, b, direction in batch_update.moved:
            entry_a = self._rows.pop(a, None)
            entry_b = self._rows.pop(b, None)
            if entry_a is not None:
                self._rows[b] = entry_a
            if direction == MoveDirectionality.SWAP and entry_b is not None:
                self._rows[a] = entry_b


def real_token_count(output_ids: list[int]) -> int:
    """Length of `output_ids` without trailing -1 placeholders (vLLM async scheduling)."""
    n = len(output_ids)
    while n and output_ids[n - 1] < 0:
        n -= 1
    return n
