"""Tandem co-generation on vLLM (arXiv:2606.28166, App. A.1.1): inside one engine, and the
segments of a junior on an engine of its own.

`TandemForCausalLM` holds the senior and the frozen junior (layer prefix `tandem_junior.`) as
one vLLM model: every forward runs both on the same tokens, positions and block tables, each
with its own paged KV cache, so both caches always hold the shared prefix. Its logits are the
senior's; the junior's are left for `TandemAuthorLogitsProcessor`, which follows each request's
author state machine and hands the junior's row to the sampler where the junior writes. One
engine step therefore emits one token of every request, whichever model writes it: the cost is
one forward of each model, the floor of two decoders, with no round trips between engines.

With the junior on an engine of its own (`rlvr.generation.tandem_separate`), each engine runs its
model alone, and `TandemSegmentLogitsProcessor` writes a sample's segment on it: the author's
tokens, until the other author's turn.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import AutoConfig
from vllm import ModelRegistry
from vllm.compilation.backends import set_model_tag
from vllm.config import VllmConfig
from vllm.model_executor.model_loader.reload.inplace import reload_weights
from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
from vllm.model_executor.models.utils import init_vllm_registered_model, maybe_prefix
from vllm.transformers_utils.config import get_config

from rlvr.algorithms.tandem import JUNIOR
from rlvr.generation.tandem_separate import HANDOFF
from rlvr.generation.tandem_support import AuthorTracker, draw_tokens
from rlvr.generation.vllm_rows import RowTrackingLogitsProcessor, real_token_count

ARCHITECTURE = "RlvrTandemForCausalLM"
JUNIOR_PREFIX = "tandem_junior"
AUTHOR_KEY = "rlvr_tandem_author"
"""Key in vLLM's SamplingParams.extra_args naming the sample's tracker in `ACTIVE_AUTHORS`."""

SEGMENT_KEY = "rlvr_tandem_segment"
"""Key in vLLM's SamplingParams.extra_args naming the request's segment in `ACTIVE_SEGMENTS`."""

# Live trackers of the samples being generated, by key (see vllm_backend._ACTIVE_TRACKERS: vLLM
# deep-copies SamplingParams, so requests carry a key and the processor looks the object up).
ACTIVE_AUTHORS: dict[str, AuthorTracker] = {}
# The junior's logits of the current engine step, by engine (the hf_config's rlvr_tandem_key):
# written by the model's compute_logits, taken by the logits processor right before sampling.
_JUNIOR_LOGITS: dict[str, torch.Tensor] = {}


def engine_overrides(senior_path: str | Path, junior_path: str | Path) -> dict[str, Any]:
    """vLLM `hf_overrides` that turn the senior's directory into the combined tandem model.

    The engine loads the senior from its own directory as usual; the junior's directory and the
    senior's real architecture travel in the config. Registers the combined architecture with
    vLLM (in this process, where the in-process engine core runs).
    """
    ModelRegistry.register_model(ARCHITECTURE, TandemForCausalLM)
    senior = AutoConfig.from_pretrained(senior_path)
    return {
        "architectures": [ARCHITECTURE],
        "rlvr_tandem_senior_architectures": list(senior.architectures),
        "rlvr_tandem_junior_path": str(Path(junior_path).resolve()),
        "rlvr_tandem_key": uuid.uuid4().hex,
    }


class TandemForCausalLM(nn.Module):
    """Senior and junior in lockstep: forward returns both hidden states side by side
    ([tokens, senior_hidden + junior_hidden]) so vLLM's row selection keeps them aligned;
    compute_logits returns the senior's logits and stashes the junior's for the processor."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.key: str = config.rlvr_tandem_key
        self.junior_path = Path(config.rlvr_tandem_junior_path)
        self.senior = init_vllm_registered_model(
            vllm_config,
            prefix=maybe_prefix(prefix, "senior"),
            architectures=list(config.rlvr_tandem_senior_architectures),
        )
        junior_config = get_config(self.junior_path, trust_remote_code=False)
        senior_vocab = config.get_text_config().vocab_size
        junior_vocab = junior_config.get_text_config().vocab_size
        if senior_vocab != junior_vocab:
            raise ValueError(
                f"junior {self.junior_path} has {junior_vocab} logits, the senior {senior_vocab}"
            )
        # Its own compile tag, so a compiled junior never shares the senior's compiled graphs.
        with set_model_tag(JUNIOR_PREFIX):
            self.tandem_junior = init_vllm_registered_model(
                vllm_config, prefix=maybe_prefix(prefix, JUNIOR_PREFIX), hf_config=junior_config
            )
        self._widths = [
            config.get_text_config().hidden_size,
            junior_config.get_text_config().hidden_size,
        ]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The senior's embeddings (vLLM's text-generation interface asks for the method; the
        engine feeds token ids, which both models embed themselves)."""
        return self.senior.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Both models on the same tokens; their attention layers find their own KV caches."""
        if inputs_embeds is not None or intermediate_tensors is not None:
            raise NotImplementedError("tandem generation takes token ids on one pipeline stage")
        senior = self.senior(input_ids, positions)
        junior = self.tandem_junior(input_ids, positions)
        return torch.cat([senior, junior], dim=-1)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The senior's logits; the junior's wait in `_JUNIOR_LOGITS` for this step's sampler."""
        senior, junior = hidden_states.split(self._widths, dim=-1)
        _JUNIOR_LOGITS[self.key] = self.tandem_junior.compute_logits(junior.contiguous())
        return self.senior.compute_logits(senior.contiguous())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """First load only: the senior from the engine's checkpoint, the junior from its own
        directory. Later senior syncs go through `reload_senior` and never reach the junior."""
        loaded = {f"senior.{name}" for name in self.senior.load_weights(weights)}
        files = sorted(str(f) for f in self.junior_path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"junior {self.junior_path} holds no *.safetensors weights")
        junior = self.tandem_junior.load_weights(
            safetensors_weights_iterator(files, use_tqdm_on_load=False)
        )
        return loaded | {f"{JUNIOR_PREFIX}.{name}" for name in junior}


def reload_senior(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """`collective_rpc` target: vLLM's in-place reload scoped to the senior submodule (HF names),
    so the junior's parameters are never restored, reloaded or reprocessed."""
    runner = worker.model_runner
    reload_weights(
        runner.vllm_config,
        runner.get_model().senior,
        weights_iterator=weights,
        weights_path=None,
        is_checkpoint_format=True,
    )


class TandemAuthorLogitsProcessor(RowTrackingLogitsProcessor):
    """V1 batch logits processor of a tandem engine: each tracked row gets its author's logits.

    Right before sampling it feeds every tandem row's tracker the tokens emitted since the last
    step and, where the junior writes next, replaces the row with the junior's logits. Rows of
    requests without a tracker (solo generation on a tandem engine) keep the senior's.

    On CPU it also draws the tokens itself (`draw_tokens`) and leaves only those tokens
    finite: vLLM's CPU sampler seeds a fused Gumbel kernel with one integer per step, not the
    exponential race of the tandem seeding contract, so this is what makes a CPU rollout equal
    to `tandem_generate_reference`'s for the same seed. On GPUs vLLM's own sampler already runs
    that race (processed log-probs rule out FlashInfer), with the request's device generator.
    """

    extra_arg: ClassVar[str] = AUTHOR_KEY
    registry: ClassVar[dict[str, Any]] = ACTIVE_AUTHORS

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self.key: str = vllm_config.model_config.hf_config.rlvr_tandem_key
        self.own_sampling = device.type == "cpu"

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [num_rows, vocab], the senior's; returns each row's author's."""
        junior_logits = _JUNIOR_LOGITS.pop(self.key, None)
        if not self._rows:
            return logits
        if junior_logits is None or junior_logits.shape != logits.shape:
            raise RuntimeError(
                "the junior's logits of this step are missing or misaligned "
                f"({None if junior_logits is None else tuple(junior_logits.shape)} vs "
                f"{tuple(logits.shape)})"
            )
        junior_rows = [
            row
            for row, (tracker, output_ids) in self._rows.items()
            if tracker.observe(output_ids, real_token_count(output_ids)) == JUNIOR
        ]
        if junior_rows:
            index = torch.tensor(junior_rows, device=logits.device)
            logits[index] = junior_logits[index].to(logits.dtype)
        if self.own_sampling:
            rows = list(self._rows)
            trackers = [self._rows[row][0] for row in rows]
            tokens, logprobs = draw_tokens(logits[rows], trackers)
            for tracker, logprob in zip(trackers, logprobs, strict=True):
                tracker.logprobs.append(logprob)
            index = torch.tensor(rows, device=logits.device)
            logits[index] = float("-inf")
            logits[index, torch.tensor(tokens, device=logits.device)] = 0.0
        return logits


@dataclass
class SegmentTurn:
    """One sample's segment on an engine that runs one of the two models: the request's output
    continues the sample's response after its `head`."""

    tracker: AuthorTracker
    """The sample's author state and token generator, resumed from the response so far."""
    author: int
    """The author this engine's model writes as (SENIOR or JUNIOR)."""
    head: tuple[int, ...]
    """The response before this segment (another engine's tokens among them)."""
    end_token: int
    """A stop id of the request, forced to end it; the backend drops it from the segment."""
    holds_stop: Callable[[list[int]], bool] | None = None
    """Whether the whole response (`head` first) holds a stop string; None when the sampling
    settings have none."""
    ended: str | None = None
    """HANDOFF or 'stop' (a stop string) once `end_token` was forced; None while it writes."""

    def writes_next(self, output_ids: list[int], n: int) -> bool:
        """Show the tracker the request's first `n` output ids; whether this engine draws the
        next token (else the segment ends: `ended` says why)."""
        author = self.tracker.observe(output_ids, n, len(self.head))
        if self.ended is None and n and self.holds_stop is not None:
            self.ended = "stop" if self.holds_stop([*self.head, *output_ids[:n]]) else None
        if self.ended is None and author != self.author:
            self.ended = HANDOFF
        return self.ended is None


ACTIVE_SEGMENTS: dict[str, SegmentTurn] = {}


class TandemSegmentLogitsProcessor(RowTrackingLogitsProcessor):
    """V1 batch logits processor writing co-written segments on a one-model engine.

    Right before sampling, each tracked row's tracker sees the tokens emitted since the last
    step. Where the next token is this engine's author's, the token drawn by the sample's own
    generator (`draw_tokens`, the seeding contract on every device) is the only finite logit, as
    the shared engine's processor does on CPU; where the schedule hands over, or the response now
    holds a stop string, the segment's end token is forced instead and nothing is drawn, so the
    generator travels to the next engine in the state the shared engine would hold.
    """

    extra_arg: ClassVar[str] = SEGMENT_KEY
    registry: ClassVar[dict[str, Any]] = ACTIVE_SEGMENTS

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [num_rows, vocab], this engine's model's; returns them with one token left
        finite in every tracked row."""
        if not self._rows:
            return logits
        drawing: list[int] = []
        ending: list[int] = []
        for row, (segment, output_ids) in self._rows.items():
            writes = segment.writes_next(output_ids, real_token_count(output_ids))
            (drawing if writes else ending).append(row)
        forced = {row: self._rows[row][0].end_token for row in ending}
        if drawing:
            trackers = [self._rows[row][0].tracker for row in drawing]
            tokens, logprobs = draw_tokens(logits[drawing], trackers)
            for tracker, logprob in zip(trackers, logprobs, strict=True):
                tracker.logprobs.append(logprob)
            forced.update(zip(drawing, tokens, strict=True))
        rows = list(forced)
        index = torch.tensor(rows, device=logits.device)
        logits[index] = float("-inf")
        logits[index, torch.tensor([forced[r] for r in rows], device=logits.device)] = 0.0
        return logits
