"""The trained policy under a DeepSpeed engine: ZeRO 0-3, full fine-tune or PEFT LoRA.

Micro-batched log-prob passes (old / reference / teacher-forced scoring) at the sampling temperature,
the PPO-clip update over one or more mini-batches (`rlvr.algorithms.grpo`) with the engine importance
correction, the learning-rate schedule, merged-weight export for generation engines, HF checkpoints
and exact resume.
One process (a PolicyActor) per data-parallel rank (`resources.policy_ranks`): gloo between them
on CPU, NCCL on GPUs; a single rank is a one-process group.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import peft
import torch
import torch.distributed as dist
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from rlvr.algorithms import grpo
from rlvr.generation.base import scored_positions
from rlvr.training.batch import (
    TrainBatch,
    build_batch,
    token_entropy,
    token_logprobs,
    token_nucleus_log_mass,
)
from rlvr.training.checkpoint import STATE_TAG, UNIVERSAL_TAG, saved_ranks, to_universal
from rlvr.training.data_parallel import mini_batch_bounds, token_budget_rows
from rlvr.training.distributed import deepspeed, get_accelerator, init_distributed
from rlvr.training.engine_mismatch import MismatchTally
from rlvr.training.lm_head import TokenStats, head_calls_needed, loss_token_stats
from rlvr.training.losses import LossContext, StepContext, policy_loss
from rlvr.training.schedule import LrLambda
from rlvr.training.settings import EngineIS, LossAgg, TrainerSettings
from rlvr.training.shared_prefix import (
    BLOCK_MASK_ATTENTION,
    longest_pack,
    packed_length,
    prompt_groups,
    sliding_window,
)
from rlvr.training.weight_sync import TensorSpec

log = logging.getLogger(__name__)


class PolicyTrainer:
    """The policy model wrapped in a DeepSpeed engine, with GRPO log-prob, loss and update passes.

    Every log-prob and entropy is of softmax(logits / ``temperature``), the distribution the
    rollouts were sampled from (pass the generation temperature); DRO's R3 scoring
    (`sequence_logprobs`) alone stays at temperature 1.

    ``train_step`` is one PPO update of a rollout batch: ``epochs`` passes over it, each split into
    ``mini_batches`` optimizer steps (TRL's num_iterations, verl's ppo_epochs and
    ppo_mini_batch_size). With more than one optimizer step the old-policy log-probs are computed
    once, without grad, before the first, so the clipped ratio acts from the second step on; with
    one they are the detached log-probs of the training forward itself (ratio 1, as in GRPO).
    Each optimizer step runs in micro-batches of ``micro_batch_size`` sequences (or, with
    ``micro_batch_tokens``, of rows grouped longest first under that many padded tokens) with
    gradient accumulation, scaled so the accumulated gradient equals that of its mini-batch's loss.
    ``lm_head_chunk`` applies the LM head only at loss tokens, that many at a time, recomputed in
    backward but under ZeRO-3 (`rlvr.training.lm_head`): no full logits tensor; log-probs are
    then 0 off the loss tokens. ``shared_prefix`` runs each prompt once for the rows of a
    micro-batch that share it, behind a block mask (`rlvr.training.shared_prefix`; token-budget
    micro-batches then keep prompt groups together), with the head as under ``lm_head_chunk``
    (one chunk when that is 0). ``gradient_checkpointing`` recomputes each decoder layer in
    backward instead of keeping its activations: the same values for one more forward.
    ``engine_is`` corrects the mismatch between the generation engine that sampled the rollouts
    and the trainer (`grpo.engine_is_weights`, cap ``engine_is_cap``) when the batch carries
    ``rollout_logp``. The engine reports log-probs of what it sampled from, the tempered
    distribution truncated to its top-p nucleus; the weight compares them with pi_old under the
    same truncation (``top_p``, `nucleus.nucleus_log_mass`), so with the engine's weights it is 1:
    the policy-gradient ratio itself stays that of the full tempered softmax, as in verl and TRL. With ``lora`` enabled only the adapter trains and the reference policy is the
    same model with adapters disabled; a full fine-tune keeps a frozen reference copy only when
    ``kl_coef > 0``. The k3 KL is aggregated like the policy loss (``loss_agg``).

    ``max_response_len`` is the constant normaliser of "seq-mean-token-sum-norm" (Dr.GRPO; pass the
    generation budget), by default the longest response of each batch. ``loss="dro"`` replaces the
    GRPO loss with DRO's (`dro.dro_loss`: Dr.GRPO normaliser over the batch's sequences, PG only on
    the top ``rho_ent`` entropy tokens of the whole batch, k3 KL weighted by ``kl_coef`` on all
    loss tokens); the caller leaves rejected groups out of the batch and gives truncated rollouts
    no loss tokens, so they count in the normaliser only. The learning rate follows
    ``lr_schedule`` (constant, linear or cosine decay to ``min_lr_ratio`` * lr over
    ``total_steps`` optimizer steps) after a linear warm-up of ``warmup_steps``; its state is in
    the checkpoint. bf16 with ZeRO 1-3 keeps fp32 master weights and fp32 gradient accumulation;
    with stage 0 DeepSpeed accumulates gradients in bf16. On CPU every ZeRO stage runs under gloo,
    and in one process a fixed seed reproduces a run bit for bit.

    On several ranks (data parallel, one process each) every rank calls the same methods in the
    same order with its own share of the batch, and the shares must split into the same number of
    micro-batches (ZeRO-3 gathers weights collectively in every forward); losses are normalised
    over the global batch, so the step equals the one-process step on the concatenated batch.
    """

    def __init__(
        self, model_path: str | Path, settings: TrainerSettings | None = None, **overrides: Any
    ) -> None:
        """``settings`` (default: `TrainerSettings()`), with ``overrides`` of its fields."""
        settings = replace(settings or TrainerSettings(), **overrides)
        self.settings = settings
        self.policy_loss = policy_loss(settings.loss, settings.loss_module)
        schedule = LrLambda(
            settings.lr_schedule, settings.warmup_steps, settings.total_steps, settings.min_lr_ratio
        )
        init_distributed()
        self.temperature = settings.temperature
        self.top_p = settings.top_p
        self.mini_batches = settings.mini_batches
        self.epochs = settings.epochs
        self.engine_is: EngineIS = settings.engine_is
        self.engine_is_cap = settings.engine_is_cap
        self.micro_batch_size = settings.micro_batch_size
        self.micro_batch_tokens = settings.micro_batch_tokens
        self.lm_head_chunk = settings.lm_head_chunk
        self.shared_prefix = settings.shared_prefix
        self.kl_coef = settings.kl_coef
        self.loss_agg: LossAgg = settings.loss_agg
        self.max_response_len = settings.max_response_len
        self.zero_stage = zero_stage = settings.zero_stage
        lora, seed, dtype = settings.lora, settings.seed, settings.dtype
        self.use_lora = lora is not None
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = torch.device(get_accelerator().current_device_name())
        if zero_stage and self.world_size == 1 and not self.use_lora:
            log.warning(
                "training.zero_stage=%d on one policy rank partitions nothing, yet copies every "
                "gradient into ZeRO's buckets and keeps a second fp32 copy of the weights; "
                "zero_stage 0 trains the same faster there (bench/micro_batches.py)",
                zero_stage,
            )

        # Seeded before any weight is created, so LoRA's random A init is reproducible.
        torch.manual_seed(seed)
        get_accelerator().manual_seed_all(seed)
        torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        pad = self.tokenizer.pad_token_id
        self._pad_id: int = self.tokenizer.eos_token_id if pad is None else pad
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
        self._hf_model: PreTrainedModel = model
        if settings.gradient_checkpointing:
            # Each decoder layer keeps only its input and recomputes the rest in backward: one
            # layer's activations alive at a time for one more forward. Non-reentrant, so LoRA's
            # frozen embeddings need no input grads and ZeRO-3 re-gathers during recomputation.
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        attention = model.config._attn_implementation
        if self.shared_prefix and attention not in BLOCK_MASK_ATTENTION:
            log.warning(
                "training.shared_prefix is off: the %s attention takes no block mask (%s do)",
                attention,
                " and ".join(BLOCK_MASK_ATTENTION),
            )
            self.shared_prefix = False
        self._window = sliding_window(model.config)
        self._window_warned = False
        self._ref_model: PreTrainedModel | None = None
        if lora is not None:
            model = peft.get_peft_model(
                model,
                peft.LoraConfig(
                    r=lora.r,
                    lora_alpha=lora.alpha,
                    lora_dropout=lora.dropout,
                    target_modules=list(lora.target_modules),
                    layers_to_transform=_top_layers(model, lora.top_layers),
                    task_type="CAUSAL_LM",
                ),
            )
        elif self.kl_coef > 0:
            ref = copy.deepcopy(model).eval().requires_grad_(False)
            self._ref_model = ref.to(self.device)

        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            trainable, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        config = {
            # Accumulation is driven per call (set_gradient_accumulation_boundary), since batches vary
            # in size; DeepSpeed only needs a consistent nominal batch.
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": 1,
            "train_batch_size": self.micro_batch_size * self.world_size,
            "gradient_clipping": settings.grad_clip,
            "zero_optimization": {"stage": zero_stage},
            "bf16": {"enabled": dtype == "bfloat16"},
            "steps_per_print": 2**62,
            "wall_clock_breakdown": False,
        }
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        if zero_stage == 0 and dtype == "bfloat16":
            _forget_initialising_step(self.engine.optimizer)
        if self.world_size == 1 and zero_stage == 0:
            # Alone, the gradient all-reduce is an identity (a sum over one rank, times 1.0) that
            # still copies every gradient into one flat buffer and back: a model-sized transient
            # at the end of each step's backward. Skipping it leaves every gradient bit-identical.
            self.engine.enable_backward_allreduce = False
        self.steps = 0

    # ------------------------------------------------------------------ log-probs

    def _micro_batches(self, batch: TrainBatch) -> list[list[int]]:
        """Rows of each micro-batch: ``micro_batch_size`` rows in order, or under the
        ``micro_batch_tokens`` budget (`token_budget_rows`) with as many micro-batches on every
        rank (the most any rank needs)."""
        n = len(batch)
        if not self.micro_batch_tokens:
            size = self.micro_batch_size
            return [list(range(a, min(a + size, n))) for a in range(0, n, size)]
        units, lengths = self._budget_units(batch)
        parts = token_budget_rows(lengths, self.micro_batch_tokens)
        if self.world_size > 1:
            count = int(self._all_reduce([len(parts)], "max")[0])
            if count > len(units):
                # fewer prompt groups than micro-batches other ranks need: split them into rows
                units = [[row] for row in range(n)]
                lengths = batch.attention_mask.sum(dim=1).tolist()
            parts = token_budget_rows(lengths, self.micro_batch_tokens, count)
        return [[row for unit in part for row in units[unit]] for part in parts]

    def _budget_units(self, batch: TrainBatch) -> tuple[list[list[int]], list[int]]:
        """What token-budget micro-batches are made of, and each one's tokens: rows, or under
        ``shared_prefix`` whole prompt groups at their packed length."""
        if self._packs(batch):
            groups = prompt_groups(batch)
            return groups, [packed_length(batch, rows) for rows in groups]
        return [[row] for row in range(len(batch))], batch.attention_mask.sum(dim=1).tolist()

    def _token_stats(
        self,
        model: Callable[..., Any],
        mb: TrainBatch,
        temperature: float,
        with_entropy: bool,
        top_p: float = 1.0,
    ) -> TokenStats:
        """Log-probs, (with_entropy) entropies and (top_p < 1) nucleus log-probs ``[b, t]`` of one
        micro-batch: through the LM head at the loss tokens only (`lm_head.loss_token_stats`, in
        chunks of ``lm_head_chunk``, one chunk when only ``shared_prefix`` asks for it; packed
        when the batch knows its prompts), else from the full logits tensor."""
        shared_prefix = self._packs(mb)
        if self.lm_head_chunk or shared_prefix:
            chunk = self.lm_head_chunk or max(1, mb.num_loss_tokens)
            head_calls = None
            if self.zero_stage == 3 and self.world_size > 1:
                needed = head_calls_needed(mb.num_loss_tokens, chunk)
                head_calls = int(self._all_reduce([needed], "max")[0])
            return loss_token_stats(
                model,
                mb,
                temperature,
                chunk,
                with_entropy,
                recompute=self.zero_stage != 3,
                head_calls=head_calls,
                shared_prefix=shared_prefix,
                top_p=top_p,
            )
        logits = model(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False
        ).logits
        logp = token_logprobs(logits, mb.input_ids, temperature)
        entropy = token_entropy(logits, temperature) if with_entropy else None
        if top_p >= 1.0:
            return TokenStats(logp, entropy)
        log_mass, outside = token_nucleus_log_mass(
            logits, mb.input_ids, mb.response_mask, temperature, top_p
        )
        return TokenStats(logp, entropy, logp.detach() - log_mass, outside)

    def _packs(self, batch: TrainBatch) -> bool:
        """Whether ``batch`` runs packed (``shared_prefix``): it knows its prompts, and its
        packed sequences fit the model's sliding window, if any (else packed responses would
        see other tokens than in their own rows: the plain forward runs instead)."""
        if not self.shared_prefix or batch.prompt_lens is None:
            return False
        if self._window is None or longest_pack(batch) <= self._window:
            return True
        if not self._window_warned:
            log.warning(
                "training.shared_prefix is off for batches whose packed prompt groups exceed the "
                "model's %d-token sliding window (%d here): the plain forward runs them",
                self._window,
                longest_pack(batch),
            )
            self._window_warned = True
        return False

    @torch.no_grad()
    def _stats_with(
        self,
        model: Callable[..., Any],
        batch: TrainBatch,
        temperature: float,
        with_entropy: bool = False,
        top_p: float = 1.0,
    ) -> TokenStats:
        """`_token_stats` of the whole batch in micro-batches, ``[B, T]`` on the CPU."""
        shape = batch.input_ids.shape
        logp = torch.zeros(shape)
        entropy = torch.zeros(shape) if with_entropy else None
        nucleus = torch.zeros(shape) if top_p < 1.0 else None
        outside = torch.zeros(shape, dtype=torch.bool) if top_p < 1.0 else None
        for rows in self._micro_batches(batch):
            mb = batch.rows(rows).to(self.device)
            width = mb.input_ids.shape[1]
            stats = self._token_stats(model, mb, temperature, with_entropy, top_p)
            for whole, part in zip((logp, entropy, nucleus, outside), stats, strict=True):
                if whole is not None:
                    whole[rows, :width] = part.cpu()
        return TokenStats(logp, entropy, nucleus, outside)

    def _logprobs_with(
        self, model: Callable[..., Any], batch: TrainBatch, temperature: float
    ) -> torch.Tensor:
        """Log-probs ``[B, T]`` at ``temperature``."""
        return self._stats_with(model, batch, temperature).logp

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Current policy log-probs ``[B, T]`` (float32, CPU) at the sampling temperature,
        aligned as in `rlvr.training.batch`.

        Micro-batched because whole-batch logits over the vocabulary dominate memory.
        """
        self.engine.eval()
        return self._logprobs_with(self.engine, batch, self.temperature)

    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Reference-policy log-probs ``[B, T]`` at the sampling temperature: adapters disabled
        (LoRA) or the frozen copy."""
        if self.use_lora:
            self.engine.eval()
            with self.engine.module.disable_adapter():
                return self._logprobs_with(self.engine, batch, self.temperature)
        if self._ref_model is None:
            raise ValueError("no reference model: a full fine-tune keeps one only when kl_coef > 0")
        return self._logprobs_with(self._ref_model, batch, self.temperature)

    def sequence_logprobs(
        self, sequences: list[list[int]], positions: list[list[int]]
    ) -> list[list[float]]:
        """Current-policy log p(seq[t] | seq[:t]) at each t of `positions[i]` (DRO's R3 scoring).

        The learner-side twin of the generation backends' `score_logprobs`: one teacher-forced
        forward per sequence (micro-batched), full vocabulary, temperature 1 whatever the sampling
        temperature (R3 is the policy's own certainty of the reference answer).
        """
        batch = build_batch(
            [list(s[:1]) for s in sequences], [list(s[1:]) for s in sequences], self._pad_id
        )
        # the split after one token is no prompt: nothing is shared, so nothing is packed
        batch.prompt_lens = None
        self.engine.eval()
        logp = self._logprobs_with(self.engine, batch, temperature=1.0)
        return [
            logp[i, scored_positions(pos, len(sequences[i]))].tolist()
            for i, pos in enumerate(positions)
        ]

    # ------------------------------------------------------------------ training

    def train_step(self, batch: TrainBatch, logprob_sums: bool = False) -> dict[str, Any]:
        """One PPO update of ``batch``: ``epochs`` x ``mini_batches`` optimizer steps of the
        registered policy loss (`rlvr.training.losses`; GRPO's PPO-clip + ``kl_coef`` * k3 KL by
        default).

        ``batch.advantages`` is required; ``old_logp`` defaults to the current policy before the
        update and ``ref_logp`` to `ref_logprobs` when ``kl_coef > 0``. Returns, averaged over the
        optimizer steps, loss, pg_loss, kl, entropy (token means), clip_frac (and its _low / _high
        sides), approx_kl (to the behaviour policy pi_old), grad_norm (pre-clip), lr, plus tokens,
        optimizer_steps and "updates" (the same figures per optimizer step). With ``rollout_logp``
        in the batch it adds the engine/trainer mismatch (`grpo.engine_is_weights`: engine_ratio_mean,
        engine_ratio_max, engine_capped_frac, engine_kl), measured whatever ``engine_is`` is. With
        ``logprob_sums`` it also returns "logprob_sums": per sequence of this rank's batch, the
        old-policy log-prob summed over its loss tokens (DUET's surrogate). A loss's step-level
        values (DRO's "entropy_threshold", the 80/20 cut by pi_old's entropies over every loss
        token of the batch, which every update applies) and its own statistics ("pg_token_frac")
        are returned as well.
        """
        if batch.advantages is None:
            raise ValueError("train_step needs batch.advantages")
        n_tokens = int(self._all_reduce([batch.num_loss_tokens], "sum")[0])
        if n_tokens == 0:
            raise ValueError("batch has no loss tokens")
        parts = self._mini_batch_rows(len(batch))
        several = self.epochs * len(parts) > 1
        loss = self.policy_loss
        if (several and batch.old_logp is None) or loss.needs_old_entropy:
            # pi_old before the first optimizer step: the ratio's denominator for every later
            # step, its nucleus log-probs for the engine importance weights, and the entropies
            # a loss may cut on (DRO's 80/20), the same in every update.
            self.engine.eval()
            old = self._stats_with(
                self.engine,
                batch,
                self.temperature,
                loss.needs_old_entropy,
                self._nucleus_top_p(batch),
            )
            batch = replace(batch, old_entropy=old.entropy)
            if batch.old_logp is None:
                batch = replace(
                    batch,
                    old_logp=old.logp,
                    old_nucleus_logp=old.nucleus_logp,
                    old_outside=old.outside,
                )
        if self.kl_coef > 0 and batch.ref_logp is None:
            batch = replace(batch, ref_logp=self.ref_logprobs(batch))
        step_values: dict[str, float] = {}
        if loss.prepare is not None:
            entropy = batch.old_entropy
            gathered = None if entropy is None else self._gather(entropy[batch.response_mask])
            step_values = loss.prepare(StepContext(gathered, self.settings.loss_options))

        engine = MismatchTally()
        seq_logp = torch.zeros(len(batch), dtype=torch.float64)
        updates: list[dict[str, float]] = []
        for epoch in range(self.epochs):
            for rows in parts:
                part = batch if len(rows) == len(batch) else batch.select(rows)
                # The first pass sees every row once, against pi_old: the mismatch and the
                # old-policy sums are taken there.
                first = epoch == 0
                stats = self._optimizer_step(part, step_values, engine if first else None)
                row_sums = stats.pop("logprob_sums")
                if first:
                    seq_logp[rows] = row_sums
                updates.append(stats)

        out: dict[str, Any] = {
            key: sum(u[key] for u in updates) / len(updates)
            for key in updates[0]
            if key != "tokens"
        }
        out["tokens"] = n_tokens
        out["optimizer_steps"] = len(updates)
        out["updates"] = updates
        out.update(step_values)
        if batch.rollout_logp is not None:
            out.update(engine.summary(self._all_reduce))
        if logprob_sums:
            out["logprob_sums"] = seq_logp.tolist()
        return out

    def _nucleus_top_p(self, batch: TrainBatch) -> float:
        """The top-p the engine importance weights need pi_old's nucleus for: the sampler's when
        the batch carries the engine's log-probs, else 1 (none)."""
        return self.top_p if batch.rollout_logp is not None else 1.0

    def _mini_batch_rows(self, n: int) -> list[list[int]]:
        """Rows of each optimizer step (`data_parallel.mini_batch_bounds`)."""
        bounds = mini_batch_bounds(n, self.mini_batches)
        return [list(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]

    def _optimizer_step(
        self,
        batch: TrainBatch,
        step_values: dict[str, float],
        engine: MismatchTally | None,
    ) -> dict[str, Any]:
        """One optimizer step over ``batch`` in micro-batches; the loss is this (global) batch's.

        ``old_logp`` None means on-policy: the detached log-probs of this very forward.
        """
        on_policy = batch.old_logp is None
        # The loss is the global-batch loss across ranks, so its denominators are global sums.
        per_seq_tokens = batch.response_mask.sum(dim=1)
        agg_counts = self._aggregation_counts(per_seq_tokens)
        counted = batch.counted_rows
        # A micro-batch's aggregation divides by its own count (fillers included), the loss by
        # the global count of real rows: `agg_share` below turns one into the other.
        n_tokens, n_agg, n_seqs = (
            int(x)
            for x in self._all_reduce(
                [per_seq_tokens.sum(), agg_counts[counted].sum(), counted.sum()], "sum"
            )
        )
        # Dr.GRPO's constant normaliser must be the same for every micro-batch of the step.
        max_len = self.max_response_len or int(self._all_reduce([per_seq_tokens.max()], "max")[0])

        self.engine.train()
        lr = self.engine.get_lr()[0]
        token_means = (
            "clip_frac",
            "clip_frac_low",
            "clip_frac_high",
            "approx_kl",
            *self.policy_loss.metrics,
        )
        totals = dict.fromkeys(("loss", "pg_loss", "kl", "entropy", *token_means), 0.0)
        seq_logp = torch.zeros(len(batch), dtype=torch.float64)
        micro_batches = self._micro_batches(batch)
        for i, rows in enumerate(micro_batches):
            mb = batch.rows(rows).to(self.device)
            self.engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
            weigh_engine = mb.rollout_logp is not None and (
                engine is not None or self.engine_is != "off"
            )
            top_p = self._nucleus_top_p(mb) if on_policy and weigh_engine else 1.0
            logp, entropy, nucleus_logp, outside = self._token_stats(
                self.engine, mb, self.temperature, True, top_p
            )
            token_share = int(per_seq_tokens[rows].sum()) / max(n_tokens, 1)
            old_logp = logp.detach() if on_policy else mb.old_logp
            if not on_policy:
                nucleus_logp, outside = mb.old_nucleus_logp, mb.old_outside
            seq_logp[rows] = _masked_row_sums(old_logp, mb.response_mask)
            token_weights = None
            if weigh_engine:
                if self.top_p < 1.0 and nucleus_logp is None:
                    raise ValueError(
                        "batch.old_logp was given without old_nucleus_logp: the engine importance "
                        f"weights need pi_old within the sampler's top-p {self.top_p}"
                    )
                token_weights, engine_stats = grpo.engine_is_weights(
                    old_logp if nucleus_logp is None else nucleus_logp,
                    mb.rollout_logp,
                    mb.response_mask,
                    self.engine_is,
                    self.engine_is_cap,
                    outside=outside,
                    forced=mb.forced,
                )
                if engine is not None:
                    engine.add(engine_stats)
                if self.engine_is == "off":
                    token_weights = None
            loss, stats = self.policy_loss.fn(
                LossContext(
                    logp=logp,
                    old_logp=old_logp,
                    advantages=mb.advantages,
                    mask=mb.response_mask,
                    weights=mb.weights,
                    token_weights=token_weights,
                    ref_logp=mb.ref_logp,
                    old_entropy=mb.old_entropy,
                    agg=self.loss_agg,
                    agg_share=int(agg_counts[rows].sum()) / max(n_agg, 1),
                    num_sequences=n_seqs,
                    max_len=max_len,
                    clip_low=self.settings.clip_low,
                    clip_high=self.settings.clip_high,
                    kl_coef=self.kl_coef,
                    options=self.settings.loss_options,
                    step=step_values,
                    inputs=mb.loss_inputs or {},
                )
            )
            # DeepSpeed averages gradients over ranks, hence the world-size factor. Every
            # micro-batch runs backward, even one without loss tokens: ZeRO reduces on the last.
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            totals["loss"] += loss.item()
            totals["pg_loss"] += stats["pg_loss"].item()
            totals["kl"] += stats["kl"].item()
            totals["entropy"] += grpo.masked_mean(entropy, mb.response_mask).item() * token_share
            for key in token_means:
                totals[key] += stats[key].item() * token_share

        pre_step_norm = self._grad_norm() if self.zero_stage == 0 else None
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is None:
            # DeepSpeed clips plain fp32 (stage 0) gradients without keeping the norm.
            grad_norm = pre_step_norm
        self.steps += 1
        metrics = dict(zip(totals, self._all_reduce(list(totals.values()), "sum"), strict=True))
        return {
            **metrics,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens": n_tokens,
            "logprob_sums": seq_logp,
        }

    def _gather(self, values: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D ``values`` concatenated (sizes may differ between ranks)."""
        if self.world_size == 1:
            return values
        sizes = [None] * self.world_size
        dist.all_gather_object(sizes, int(values.numel()))
        padded = torch.zeros(max(sizes), dtype=torch.float32, device=self.device)
        padded[: values.numel()] = values.to(self.device, torch.float32)
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)]).cpu()

    def _aggregation_counts(self, per_seq_tokens: torch.Tensor) -> torch.Tensor:
        """Per sequence, its part of the loss aggregation's denominator (`grpo.LOSS_AGGREGATIONS`).

        token-mean divides by loss tokens, seq-mean-token-mean by sequences that have loss
        tokens, seq-mean-token-sum-norm by all sequences.
        """
        if self.loss_agg == "token-mean":
            return per_seq_tokens
        if self.loss_agg == "seq-mean-token-mean":
            return (per_seq_tokens > 0).long()
        return torch.ones_like(per_seq_tokens)

    def _all_reduce(
        self, values: list[float | torch.Tensor], op: Literal["sum", "max"]
    ) -> list[float]:
        if self.world_size == 1:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.tolist()

    def _grad_norm(self) -> float:
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads))

    # ------------------------------------------------------------------ export and checkpoints

    def _gathered(self, params: list[torch.nn.Parameter]) -> AbstractContextManager[Any]:
        if self.zero_stage == 3:
            return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        return nullcontext()

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full weights under the base architecture's HF names (LoRA merged), as CPU tensors.

        The merge is ``W + scale * B @ A`` computed on copies, so the training model is untouched;
        under ZeRO-3 parameters are gathered one module at a time. Every rank must call it.
        Tied weights appear once (under their first name), as in ``named_parameters``.
        """
        return {name: tensor.to("cpu", copy=True) for name, tensor in self.iter_export_weights()}

    @torch.no_grad()
    def iter_export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights of `export_weights`, one at a time in `export_manifest` order, on this
        rank's device, so a consumer (a bucketed broadcast) never holds the whole model.

        A tensor is valid only until the next one is requested (a gathered ZeRO-3 parameter is
        released then, and a plain one is the live parameter): copy what you keep. Every rank must
        run it to the end (ZeRO-3 gathers are collective).
        """
        base = self.engine.module.get_base_model() if self.use_lora else self.engine.module
        seen: set[int] = set()
        lora_prefixes: list[str] = []
        for name, module in base.named_modules():
            if any(name.startswith(prefix) for prefix in lora_prefixes):
                continue
            if isinstance(module, LoraLayer):
                lora_prefixes.append(name + ".")
                with self._gathered(list(module.parameters())):
                    layer = module.base_layer
                    seen.add(id(layer.weight))
                    yield f"{name}.weight", layer.weight + module.get_delta_weight("default")
                    if layer.bias is not None:
                        seen.add(id(layer.bias))
                        yield f"{name}.bias", layer.bias.detach()
                continue
            for pname, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                with self._gathered([param]):
                    yield (f"{name}.{pname}" if name else pname), param.detach()

    def export_manifest(self) -> list[TensorSpec]:
        """Name, full shape and dtype of every weight `iter_export_weights` yields, in its order,
        without gathering anything: the base architecture's parameters on the meta device."""
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(self._hf_model.config)
        dtype = self._hf_model.dtype
        return [TensorSpec(n, tuple(p.shape), dtype) for n, p in skeleton.named_parameters()]

    def save_checkpoint(self, directory: str | Path) -> None:
        """Write an HF model directory (merged weights + tokenizer) and, with LoRA, ``adapter/``.

        ``AutoModelForCausalLM.from_pretrained(directory)`` loads it; every rank must call it.
        """
        directory = Path(directory)
        weights = self.export_weights()
        if self.use_lora:
            self.save_adapter(directory / "adapter")
        if self.rank == 0:
            self._hf_model.save_pretrained(directory, state_dict=weights)
            self.tokenizer.save_pretrained(directory)
        dist.barrier()

    def save_adapter(self, directory: str | Path) -> None:
        """Write the PEFT LoRA adapter alone (`adapter_config.json`, `adapter_model.safetensors`);
        every rank must call it."""
        if not self.use_lora:
            raise ValueError("save_adapter needs a LoRA policy (model.lora.enabled)")
        adapters = [p for p in self.engine.module.parameters() if p.requires_grad]
        with self._gathered(adapters):
            if self.rank == 0:
                self.engine.module.save_pretrained(directory)
        dist.barrier()

    def save_state(self, directory: str | Path) -> None:
        """Save everything an exact resume needs: weights, optimizer, lr schedule, RNG, step count.

        With LoRA the frozen base weights are left out (they are reloaded from ``model_path``).
        """
        client_state = {
            "steps": self.steps,
            "cpu_rng": torch.get_rng_state(),
            "accelerator_rng": get_accelerator().get_rng_state(),
        }
        self.engine.save_checkpoint(
            str(directory),
            tag=STATE_TAG,
            client_state=client_state,
            exclude_frozen_parameters=self.use_lora,
        )

    def load_state(self, directory: str | Path) -> None:
        """Restore a `save_state` directory into this trainer (built with the same settings).

        A ZeRO state saved by another number of ranks is first converted (once, by rank 0, next
        to it) into DeepSpeed's universal checkpoint, which any rank count loads.
        """
        directory = Path(directory)
        tag = STATE_TAG
        saved = saved_ranks(directory)
        universal = self.zero_stage > 0 and saved not in (0, self.world_size)
        if universal:
            tag = UNIVERSAL_TAG
            if self.rank == 0 and not (directory / tag).is_dir():
                to_universal(directory / STATE_TAG, directory / tag)
            dist.barrier()
        self.engine._config.load_universal_checkpoint = universal
        try:
            path, client_state = self.engine.load_checkpoint(
                str(directory), tag=tag, load_module_strict=not self.use_lora
            )
        finally:
            self.engine._config.load_universal_checkpoint = False
        if path is None:
            raise FileNotFoundError(f"no trainer state under {directory}")
        self.steps = client_state["steps"]
        torch.set_rng_state(client_state["cpu_rng"])
        get_accelerator().set_rng_state(client_state["accelerator_rng"])


def _forget_initialising_step(optimizer: Any) -> None:
    """Undo the optimizer step DeepSpeed's bf16 wrapper at ZeRO stage 0 (`FP16_UnfusedOptimizer`)
    takes on zero gradients to create its state: AdamW's step count would start at 1, so every
    update took the next step's bias corrections (the first moved each weight 0.74 lr, not lr),
    and weight decay had shrunk the fp32 master weights once before training. The state is made
    again at the first real step; the masters are the model's weights again."""
    optimizer.optimizer.state.clear()
    for masters, weights in zip(optimizer.fp32_groups, optimizer.fp16_groups, strict=True):
        for master, weight in zip(masters, weights, strict=True):
            master.data.copy_(weight.data)


def _top_layers(model: PreTrainedModel, top: int | None) -> list[int] | None:
    """Indices of the last ``top`` decoder layers, for PEFT's ``layers_to_transform``."""
    if top is None:
        return None
    n_layers = model.config.num_hidden_layers
    if top > n_layers:
        raise ValueError(f"model.lora.top_layers={top} but the model has {n_layers} layers")
    return list(range(n_layers - top, n_layers))


def _masked_row_sums(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row, ``logp`` summed over ``mask`` (float64, CPU): a sequence's log-prob."""
    return torch.where(mask, logp, torch.zeros_like(logp)).sum(dim=1).double().cpu()
