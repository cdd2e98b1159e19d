"""transformers generation backend: the fallback engine and the reference the vLLM backend is tested against.

A manual sampling loop over a left-padded batch with a KV cache, sampling exactly like vLLM's
(temperature, then top-p, per-sample seeded generators), with the same stop-rule hook. Multi-turn
rollouts run on the same engine loop as vLLM's (`rlvr.generation.engine_loop`), in rounds: every
trajectory's next turn is sampled in one batch once all their callbacks have answered.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PretrainedConfig

from rlvr.algorithms.nucleus import top_p_filter
from rlvr.algorithms.tandem import JUNIOR, WordSwitchSchedule
from rlvr.generation.base import (
    GenerationRequest,
    GenerationResult,
    Sample,
    SamplingParams,
    StopRuleFactory,
    cut_at_stop,
    engine_stop_ids,
    scored_positions,
)
from rlvr.generation.engine_loop import (
    FinishedTurn,
    TurnHooks,
    TurnRequest,
    check_tandem,
    grouped_samples,
    iter_trajectories,
    ordered,
    run_trajectories,
    sample_trajectories,
)
from rlvr.generation.segments import Segments
from rlvr.generation.tandem_separate import HANDOFF, Handoff, resume_segment
from rlvr.generation.tandem_support import check_same_tokenizer, draw_tokens
from rlvr.generation.trajectories import Trajectory, TrajectoryLimits, TrajectoryResult

GREEDY_EPS = 1e-5
"""Temperatures below this decode greedily (vLLM's threshold)."""

_DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16}

_Job = tuple[list[int], int, TurnHooks]
"""One sample to generate: prompt ids, its max_tokens, its seed and trackers."""


def processed_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs of the distribution a token is sampled from: [batch, vocab] -> [batch, vocab].

    Temperature scales the logits, then top-p truncates them as vLLM does (`nucleus.top_p_filter`).
    Greedy decoding reports the raw distribution.
    """
    logits = logits.float()
    if temperature < GREEDY_EPS:
        return torch.log_softmax(logits, dim=-1)
    return torch.log_softmax(top_p_filter(logits / temperature, top_p), dim=-1)


def hf_weight_names(config: PretrainedConfig) -> tuple[set[str], set[str]]:
    """(required, allowed) HF parameter names of the model `config` describes.

    Required: the model's named_parameters() (tied weights once); allowed adds their aliases as they
    appear in state_dict() (e.g. lm_head.weight with tied embeddings). Built on the meta device, so
    it costs no memory.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    required = {name for name, _ in model.named_parameters()}
    return required, required | set(model.state_dict())


def check_weight_names(names: Iterable[str], required: set[str], allowed: set[str]) -> None:
    """Raise ValueError unless `names` covers `required` and stays within `allowed`."""
    given = set(names)
    missing = sorted(required - given)
    unknown = sorted(given - allowed)
    if missing or unknown:
        raise ValueError(
            f"weight names do not match the model: missing {missing}, unknown {unknown}"
        )


def checked_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    names: Collection[str] | None,
    required: set[str],
    allowed: set[str],
) -> Iterable[tuple[str, torch.Tensor]]:
    """``named_tensors`` once their names passed `check_weight_names`, before any tensor is read.

    ``names`` announces what ``named_tensors`` will yield (a streamed broadcast knows them ahead),
    so the tensors can still stream to the loader one at a time; without it they are listed first.
    """
    if names is None:
        named_tensors = list(named_tensors)
        names = [name for name, _ in named_tensors]
    check_weight_names(names, required, allowed)
    return named_tensors


class HFBackend:
    """`GenerationBackend` over a transformers causal LM (`device` "cpu" or "cuda").

    Samples are generated in batches of at most `max_batch_size`; a sample that ends (EOS, its
    stop rule, or max_tokens) leaves the batch and its KV cache rows are dropped. Seeds, log-probs,
    finish reasons and stop rules follow `VLLMBackend`'s conventions, so the two are interchangeable.

    With `junior_path` it also holds Tandem's frozen junior and `generate(..., schedule=...)`
    co-writes every sample in lockstep: both models run on every token with their own KV caches,
    the author's logits are sampled by the tandem seeding contract (`draw_tokens`), and
    `load_weights` replaces the senior only. Without a junior, `write_segments` writes one
    author's segments of samples co-written with a junior on another engine
    (`rlvr.generation.tandem_separate`).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_batch_size: int = 64,
        junior_path: str | Path | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.model_path = Path(model_path)
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=_DTYPES[dtype])
        self.model.to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.eos_token_id: int = self.tokenizer.eos_token_id
        self.stop_token_ids = engine_stop_ids(
            self.eos_token_id, self.model.generation_config.eos_token_id
        )
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = self.eos_token_id if pad is None else pad
        self._required_names, self._allowed_names = hf_weight_names(self.model.config)
        self.junior = None
        if junior_path is not None:
            check_same_tokenizer(self.model_path, junior_path)
            junior = AutoModelForCausalLM.from_pretrained(junior_path, dtype=_DTYPES[dtype])
            self.junior = junior.to(self.device).eval().requires_grad_(False)

    @property
    def context_limit(self) -> int:
        """Prompt + response tokens one sample may hold: the model's max_position_embeddings."""
        return self.model.config.get_text_config().max_position_embeddings

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        stop_rule_factory: StopRuleFactory | None = None,
        schedule: WordSwitchSchedule | None = None,
        segments: Segments | None = None,
    ) -> list[GenerationResult]:
        """Sample `n` responses per request (sample j seeded params.seed + j); `schedule`
        co-writes every sample with the junior (a Tandem rollout); `segments`: partial rollouts
        (`rlvr.generation.segments`)."""
        self._check(params, schedule, stop_rule_factory is not None)
        trajectories = sample_trajectories(requests, params, stop_rule_factory)
        turns = _RoundTurns(self, params, schedule)
        results = run_trajectories(turns, trajectories, params, segments=segments)
        return grouped_samples(requests, results)

    def generate_trajectories(
        self,
        trajectories: Sequence[Trajectory],
        params: SamplingParams,
        limits: TrajectoryLimits | None = None,
        schedule: WordSwitchSchedule | None = None,
        segments: Segments | None = None,
    ) -> list[TrajectoryResult]:
        """Multi-turn rollouts as `VLLMBackend.generate_trajectories` runs them, in rounds; the
        context limit is the model's max_position_embeddings (or `limits.max_context`)."""
        return ordered(
            self.iter_trajectories(trajectories, params, limits, schedule, segments),
            len(trajectories),
        )

    def iter_trajectories(
        self,
        trajectories: Sequence[Trajectory],
        params: SamplingParams,
        limits: TrajectoryLimits | None = None,
        schedule: WordSwitchSchedule | None = None,
        segments: Segments | None = None,
    ) -> Iterator[tuple[int, TrajectoryResult]]:
        """`generate_trajectories` yielding (index, result) as each trajectory ends."""
        self._check(params, schedule, any(t.stop_rule for t in trajectories))
        turns = _RoundTurns(self, params, schedule)
        return iter_trajectories(turns, trajectories, params, limits, segments=segments)

    def write_segments(
        self,
        handoffs: Sequence[Handoff],
        params: SamplingParams,
        schedule: WordSwitchSchedule,
        author: int,
        stop_token_ids: Collection[int],
    ) -> list[Handoff]:
        """Continue each handoff with this engine's model writing as `author` (SENIOR or JUNIOR)
        until the schedule gives the next token to the other author or the sample ends (a stop
        id of `stop_token_ids`, the senior's; a stop string; its max_tokens). The context is
        prefilled from the handoff's ids, and tokens are drawn by its own generator."""
        written: list[Handoff] = []
        for start in range(0, len(handoffs), self.max_batch_size):
            chunk = handoffs[start : start + self.max_batch_size]
            jobs: list[_Job] = []
            for h in chunk:
                hooks = TurnHooks(h.seed, author=resume_segment(h, params, schedule, author))
                jobs.append((h.prompt_ids + h.response_ids, h.max_tokens, hooks))
            samples = self._generate_batch(
                jobs, params, author=author, handoffs=chunk, stop_token_ids=stop_token_ids
            )
            for h, (_, _, hooks), sample in zip(chunk, jobs, samples, strict=True):
                written.append(
                    Handoff(
                        h.key,
                        h.prompt_ids,
                        h.seed,
                        h.max_tokens,
                        sample.token_ids,
                        sample.logprobs,
                        hooks.author.generator.get_state(),
                        None if sample.finish_reason == HANDOFF else sample.finish_reason,
                    )
                )
        return written

    def _check(
        self, params: SamplingParams, schedule: WordSwitchSchedule | None, stop_rules: bool
    ) -> None:
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        check_tandem(schedule, self.junior is not None, stop_rules)

    @torch.inference_mode()
    def _generate_batch(
        self,
        jobs: list[_Job],
        params: SamplingParams,
        author: int | None = None,
        handoffs: Sequence[Handoff] | None = None,
        stop_token_ids: Collection[int] | None = None,
    ) -> list[Sample]:
        """Sample every job to its end; with `author`, co-written `handoffs` (their response so
        far ends each job's prompt) each only until the other author's turn (finish reason
        HANDOFF), with this engine's model alone."""
        n = len(jobs)
        stop_ids = self.stop_token_ids if stop_token_ids is None else stop_token_ids
        width = max(len(job[0]) for job in jobs)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((n, width), dtype=torch.long)
        for row, (prompt, *_) in enumerate(jobs):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        input_ids = input_ids.to(self.device)
        attention_mask = attention_mask.to(self.device)
        # Left padding shifts the prompts; positions must count real tokens only.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        generators = [
            None if hooks.seed is None else torch.Generator(self.device).manual_seed(hooks.seed)
            for _, _, hooks in jobs
        ]
        authors = [hooks.author for _, _, hooks in jobs]
        tandem = authors[0] is not None
        lockstep = tandem and author is None
        models = [self.model, self.junior] if lockstep else [self.model]
        responses: list[list[int]] = [[] for _ in jobs]
        logprobs: list[list[float]] = [[] for _ in jobs]
        if handoffs is not None:
            responses = [list(h.response_ids) for h in handoffs]
            logprobs = [list(h.logprobs) for h in handoffs]
        finish: list[str] = ["length"] * n
        active = list(range(n))
        caches = [DynamicCache(config=model.config) for model in models]
        step_ids, step_positions = input_ids, position_ids
        while active:
            # Lockstep: every model sees every token, so each cache always holds the shared prefix.
            all_logits = [
                model(
                    input_ids=step_ids,
                    attention_mask=attention_mask,
                    position_ids=step_positions,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                .logits[:, -1, :]
                .float()
                for model, cache in zip(models, caches, strict=True)
            ]
            logits = all_logits[0]
            if lockstep:
                for row, job in enumerate(active):
                    if authors[job].observe(responses[job]) == JUNIOR:
                        logits[row] = all_logits[1][row]
            for row, job in enumerate(active):
                tracker = jobs[job][2].tracker
                if tracker is not None and tracker.observe(responses[job]):
                    logits[row] = float("-inf")
                    logits[row, self.eos_token_id] = 0.0
            step_logprobs = processed_logprobs(logits, params.temperature, params.top_p)
            if tandem:
                drawn, _ = draw_tokens(logits, [authors[job] for job in active])
                tokens = torch.tensor(drawn, device=logits.device)
            else:
                tokens = self._sample(
                    step_logprobs, params.temperature, [generators[j] for j in active]
                )
            chosen = step_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
            keep: list[int] = []
            for row, (job, token, logprob) in enumerate(
                zip(active, tokens.tolist(), chosen, strict=True)
            ):
                responses[job].append(token)
                logprobs[job].append(logprob)
                if token in stop_ids or self._ends_in_stop(responses[job], params.stop):
                    finish[job] = "stop"
                elif len(responses[job]) < jobs[job][1]:
                    if author is None or authors[job].observe(responses[job]) == author:
                        keep.append(row)
                    else:
                        finish[job] = HANDOFF
            if len(keep) < len(active):
                if not keep:
                    break
                rows = torch.tensor(keep, device=self.device)
                for cache in caches:
                    cache.reorder_cache(rows)
                attention_mask = attention_mask[rows]
                step_positions = step_positions[rows]
                tokens = tokens[rows]
                active = [active[row] for row in keep]
            attention_mask = torch.cat(
                [attention_mask, attention_mask.new_ones((len(active), 1))], dim=1
            )
            step_positions = step_positions[:, -1:] + 1
            step_ids = tokens.unsqueeze(1)
        samples = []
        for job, (_, _, hooks) in enumerate(jobs):
            flags, authorship = hooks.finish(responses[job])
            samples.append(
                Sample(
                    token_ids=responses[job],
                    text=cut_at_stop(
                        self.tokenizer.decode(responses[job], skip_special_tokens=True),
                        params.stop,
                    ),
                    logprobs=logprobs[job],
                    finish_reason=finish[job],
                    flags=flags,
                    authorship=authorship,
                )
            )
        return samples

    def _ends_in_stop(self, response: list[int], stop: tuple[str, ...]) -> bool:
        """Whether the response text (as vLLM matches it: special tokens skipped) holds a stop
        string; checked after every token, so the last token is the one that completed it."""
        if not stop:
            return False
        text = self.tokenizer.decode(response, skip_special_tokens=True)
        return any(s in text for s in stop)

    @staticmethod
    def _sample(
        logprobs: torch.Tensor, temperature: float, generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """One token per row from [rows, vocab] log-probs; greedy below GREEDY_EPS."""
        if temperature < GREEDY_EPS:
            return logprobs.argmax(dim=-1)
        probs = logprobs.exp()
        tokens = torch.empty(len(generators), dtype=torch.long, device=logprobs.device)
        unseeded = [row for row, g in enumerate(generators) if g is None]
        if unseeded:
            tokens[unseeded] = torch.multinomial(probs[unseeded], 1).squeeze(1)
        for row, generator in enumerate(generators):
            if generator is not None:
                tokens[row] = torch.multinomial(probs[row], 1, generator=generator).squeeze(0)
        return tokens

    @torch.inference_mode()
    def score_logprobs(
        self, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """log p(seq[t] | seq[:t]) at each t of `positions[i]` (raw logits, full vocabulary).

        The same quantity as `VLLMBackend.score_logprobs`, from right-padded teacher-forced
        forwards of at most `max_batch_size` sequences.
        """
        out: list[list[float]] = []
        for start in range(0, len(sequences), self.max_batch_size):
            chunk = sequences[start : start + self.max_batch_size]
            width = max(len(s) for s in chunk)
            input_ids = torch.full((len(chunk), width), self.pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, seq in enumerate(chunk):
                input_ids[row, : len(seq)] = torch.tensor([int(t) for t in seq])
                attention_mask[row, : len(seq)] = 1
            logits = (
                self.model(
                    input_ids=input_ids.to(self.device),
                    attention_mask=attention_mask.to(self.device),
                    use_cache=False,
                )
                .logits[:, :-1]
                .float()
            )
            targets = input_ids[:, 1:, None].to(self.device)
            picked = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
            picked = picked.cpu()
            for row, seq in enumerate(chunk):
                pos = scored_positions(positions[start + row], len(seq))
                # picked[:, t - 1] predicts token t from its prefix.
                out.append(picked[row, [t - 1 for t in pos]].tolist())
        return out

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        names: Collection[str] | None = None,
    ) -> None:
        """Copy new weights into the model in place; names must be exactly the HF parameter names
        (tied aliases such as lm_head.weight optional), announced by ``names`` when known ahead."""
        state = dict(
            checked_weights(named_tensors, names, self._required_names, self._allowed_names)
        )
        # strict=False only because a tied alias may be absent; check_weight_names did the strict part.
        self.model.load_state_dict(state, strict=False)

    def close(self) -> None:
        """Drop the model so its memory can be freed."""
        self.model = None


class _RoundTurns:
    """`TurnEngine` over an HFBackend: the turns submitted since the last round are sampled
    together, in the order submitted, in batches of at most `max_batch_size`."""

    rounds = True

    def __init__(
        self, backend: HFBackend, params: SamplingParams, schedule: WordSwitchSchedule | None
    ) -> None:
        self.backend = backend
        self.params = params
        self.schedule = schedule
        self.context_limit: int = backend.context_limit
        self.vocab_size: int = backend.model.config.get_text_config().vocab_size
        self._submitted: list[tuple[int, _Job]] = []

    def submit(self, key: int, request: TurnRequest) -> None:
        hooks = TurnHooks.make(request, self.backend.eos_token_id, self.params, self.schedule)
        self._submitted.append((key, (request.prompt_ids, request.max_tokens, hooks)))

    def poll(self) -> list[FinishedTurn]:
        submitted, self._submitted = self._submitted, []
        size = self.backend.max_batch_size
        finished = []
        for start in range(0, len(submitted), size):
            chunk = submitted[start : start + size]
            samples = self.backend._generate_batch([job for _, job in chunk], self.params)
            finished += [
                FinishedTurn(key, sample) for (key, _), sample in zip(chunk, samples, strict=True)
            ]
        return finished

    def decode(self, token_ids: list[int]) -> str:
        return self.backend.tokenizer.decode(token_ids, skip_special_tokens=True)

    def in_flight(self) -> int:
        return len(self._submitted)

    def abort(self) -> None:
        self._submitted = []
