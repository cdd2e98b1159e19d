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
import math
import os
import shutil
import subprocess
import sys
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

from rlvr.algorithms import dro, grpo
from rlvr.config import LoraConfig
from rlvr.generation.base import scored_positions
from rlvr.training.batch import TrainBatch, build_batch, token_entropy, token_logprobs
from rlvr.training.data_parallel import mini_batch_bounds, token_budget_rows
from rlvr.training.lean_import import without_modules
from rlvr.training.lm_head import head_calls_needed, loss_token_stats
from rlvr.training.rendezvous import LOOPBACK, master_store
from rlvr.training.shared_prefix import BLOCK_MASK_ATTENTION, packed_length, prompt_groups
from rlvr.training.weight_sync import TensorSpec

# `import deepspeed` imports its autotuner, which imports mlflow whenever it is installed (the
# `loggers` extra): 105 MiB more in every policy rank, for autotuning this project never runs.
with without_modules("mlflow"):
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import default_pg_timeout
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

log = logging.getLogger(__name__)

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LrSchedule = Literal["constant", "linear", "cosine"]
EngineIS = Literal["off", "tis", "mask"]
_STATE_TAG = "state"
_UNIVERSAL_TAG = "state_universal"


def init_distributed() -> None:
    """Join the process group DeepSpeed needs, starting a one-process group when none is set up.

    A launcher (Ray placement group, torchrun) sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
    MASTER_PORT; without them this process is rank 0 of 1 on 127.0.0.1 and a port the OS picks.
    CPU uses gloo (DeepSpeed would pick oneCCL if its bindings were installed); GPUs use the
    accelerator's backend (nccl).
    """
    skip_shared_memory_all_reduce()
    if dist.is_initialized():
        # Another component of this process (e.g. an in-process vLLM engine) already set up a group;
        # DeepSpeed reuses it but still insists on the launcher's rank variables.
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
        return
    for key, value in (
        ("MASTER_ADDR", LOOPBACK),
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        os.environ.setdefault(key, value)
    accelerator = get_accelerator()
    device_id = None
    if accelerator.device_name() == "cpu":
        backend = "gloo"
    else:
        backend = accelerator.communication_backend_name()
        local_rank = int(os.environ["LOCAL_RANK"])
        accelerator.set_device(local_rank)
        if int(os.environ["WORLD_SIZE"]) > 1:
            device_id = local_rank  # as DeepSpeed's own init binds it (eager NCCL, comm splits)
    join_default_group(backend, device_id)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


def join_default_group(backend: str, device_id: int | None) -> None:
    """Start torch's default process group as the launcher's variables say, over a store that
    rank 0 serves on MASTER_ADDR alone (torch's env:// store listens on every interface); rank 0
    without MASTER_PORT takes a port the OS picks and records it."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address = os.environ["MASTER_ADDR"]
    if rank == 0:
        store = master_store(
            address, int(os.environ.get("MASTER_PORT", 0)), world_size, default_pg_timeout
        )
        os.environ["MASTER_PORT"] = str(store.port)
    else:
        port = int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(address, port, world_size, timeout=default_pg_timeout)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=default_pg_timeout,
        device_id=device_id,
    )


def skip_shared_memory_all_reduce() -> None:
    """Keep DeepSpeed from JIT-building its CPU shared-memory all-reduce at init.

    That op serves only inference tensor parallelism (`inference_all_reduce`), which training never
    calls; building or loading it takes a file lock in the torch extensions folder, and a process
    killed while holding it (a stopped run, a killed actor) leaves the lock behind, on which every
    later DeepSpeed start then waits forever.
    """
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


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
    ``rollout_logp``. With ``lora`` enabled only the adapter trains and the reference policy is the
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
        self,
        model_path: str | Path,
        *,
        zero_stage: Literal[0, 1, 2, 3] = 2,
        lora: LoraConfig | None = None,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float = 1.0,
        micro_batch_size: int = 8,
        micro_batch_tokens: int = 0,
        lm_head_chunk: int = 0,
        shared_prefix: bool = False,
        gradient_checkpointing: bool = False,
        dtype: Literal["float32", "bfloat16"] = "float32",
        seed: int = 0,
        kl_coef: float = 0.0,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        loss_agg: LossAgg = "token-mean",
        max_response_len: int | None = None,
        loss: Literal["grpo", "dro"] = "grpo",
        rho_ent: float = dro.DEFAULT_RHO_ENT,
        temperature: float = 1.0,
        mini_batches: int = 1,
        epochs: int = 1,
        engine_is: EngineIS = "off",
        engine_is_cap: float = 2.0,
        lr_schedule: LrSchedule = "constant",
        warmup_steps: int = 0,
        total_steps: int | None = None,
        min_lr_ratio: float = 0.0,
    ) -> None:
        if loss not in ("grpo", "dro"):
            raise ValueError(f"loss must be 'grpo' or 'dro', got {loss!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if mini_batches < 1 or epochs < 1:
            raise ValueError(f"mini_batches={mini_batches} and epochs={epochs} must be >= 1")
        if engine_is not in grpo.ENGINE_IS_MODES:
            raise ValueError(f"engine_is must be one of {grpo.ENGINE_IS_MODES}, got {engine_is!r}")
        schedule = LrLambda(lr_schedule, warmup_steps, total_steps, min_lr_ratio)
        init_distributed()
        self.temperature = temperature
        self.mini_batches = mini_batches
        self.epochs = epochs
        self.engine_is: EngineIS = engine_is
        self.engine_is_cap = engine_is_cap
        self.loss = loss
        self.rho_ent = rho_ent
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.lm_head_chunk = lm_head_chunk
        self.shared_prefix = shared_prefix
        self.kl_coef = kl_coef
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.loss_agg: LossAgg = loss_agg
        self.max_response_len = max_response_len
        self.zero_stage = zero_stage
        self.use_lora = lora is not None and lora.enabled
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
        if gradient_checkpointing:
            # Each decoder layer keeps only its input and recomputes the rest in backward: one
            # layer's activations alive at a time for one more forward. Non-reentrant, so LoRA's
            # frozen embeddings need no input grads and ZeRO-3 re-gathers during recomputation.
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        attention = model.config._attn_implementation
        if shared_prefix and attention not in BLOCK_MASK_ATTENTION:
            log.warning(
                "training.shared_prefix is off: the %s attention takes no block mask (%s do)",
                attention,
                " and ".join(BLOCK_MASK_ATTENTION),
            )
            self.shared_prefix = False
        self._ref_model: PreTrainedModel | None = None
        if lora is not None and lora.enabled:
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
        elif kl_coef > 0:
            ref = copy.deepcopy(model).eval().requires_grad_(False)
            self._ref_model = ref.to(self.device)

        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=lr, betas=betas, weight_decay=weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        config = {
            # Accumulation is driven per call (set_gradient_accumulation_boundary), since batches vary
            # in size; DeepSpeed only needs a consistent nominal batch.
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": 1,
            "train_batch_size": micro_batch_size * self.world_size,
            "gradient_clipping": grad_clip,
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
        if self.shared_prefix and batch.prompt_lens is not None:
            groups = prompt_groups(batch)
            return groups, [packed_length(batch, rows) for rows in groups]
        return [[row] for row in range(len(batch))], batch.attention_mask.sum(dim=1).tolist()

    def _token_stats(
        self, model: Callable[..., Any], mb: TrainBatch, temperature: float, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs and (with_entropy) entropies ``[b, t]`` of one micro-batch: through the LM
        head at the loss tokens only (`lm_head.loss_token_stats`, in chunks of ``lm_head_chunk``,
        one chunk when only ``shared_prefix`` asks for it; packed when the batch knows its
        prompts), else from the full logits tensor."""
        shared_prefix = self.shared_prefix and mb.prompt_lens is not None
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
            )
        logits = model(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False
        ).logits
        logp = token_logprobs(logits, mb.input_ids, temperature)
        return logp, token_entropy(logits, temperature) if with_entropy else None

    @torch.no_grad()
    def _logprobs_with(
        self,
        model: Callable[..., Any],
        batch: TrainBatch,
        temperature: float,
        entropy: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Log-probs ``[B, T]`` at ``temperature``; fills ``entropy`` (``[B, T]``) when given."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for rows in self._micro_batches(batch):
            mb = batch.rows(rows).to(self.device)
            width = mb.input_ids.shape[1]
            logp, mb_entropy = self._token_stats(model, mb, temperature, entropy is not None)
            out[rows, :width] = logp.cpu()
            if entropy is not None:
                entropy[rows, :width] = mb_entropy.cpu()
        return out

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
        PPO-clip GRPO loss (+ ``kl_coef`` * k3 KL), or the DRO loss.

        ``batch.advantages`` is required; ``old_logp`` defaults to the current policy before the
        update and ``ref_logp`` to `ref_logprobs` when ``kl_coef > 0``. Returns, averaged over the
        optimizer steps, loss, pg_loss, kl, entropy (token means), clip_frac (and its _low / _high
        sides), approx_kl (to the behaviour policy pi_old), grad_norm (pre-clip), lr, plus tokens,
        optimizer_steps and "updates" (the same figures per optimizer step). With ``rollout_logp``
        in the batch it adds the engine/trainer mismatch (`grpo.engine_is_weights`: engine_ratio_mean,
        engine_ratio_max, engine_capped_frac, engine_kl), measured whatever ``engine_is`` is. With
        ``logprob_sums`` it also returns "logprob_sums": per sequence of this rank's batch, the
        old-policy log-prob summed over its loss tokens (DUET's surrogate). The DRO loss also
        returns "entropy_threshold", the 80/20 cut over every loss token of the batch.
        """
        if batch.advantages is None:
            raise ValueError("train_step needs batch.advantages")
        n_tokens = int(self._all_reduce([batch.num_loss_tokens], "sum")[0])
        if n_tokens == 0:
            raise ValueError("batch has no loss tokens")
        parts = self._mini_batch_rows(len(batch))
        several = self.epochs * len(parts) > 1
        entropy = torch.zeros(batch.input_ids.shape) if self.loss == "dro" else None
        if (several and batch.old_logp is None) or entropy is not None:
            # pi_old before the first optimizer step: the ratio's denominator for every later
            # step, and (DRO) the entropies of the whole batch's 80/20 cut.
            self.engine.eval()
            old_logp = self._logprobs_with(self.engine, batch, self.temperature, entropy)
            if batch.old_logp is None:
                batch = replace(batch, old_logp=old_logp)
        if self.kl_coef > 0 and batch.ref_logp is None:
            batch = replace(batch, ref_logp=self.ref_logprobs(batch))
        threshold = None
        if entropy is not None:
            values = self._gather(entropy[batch.response_mask])
            threshold = float(dro.entropy_threshold(values, self.rho_ent))

        engine = _EngineMismatch()
        seq_logp = torch.zeros(len(batch), dtype=torch.float64)
        updates: list[dict[str, float]] = []
        for epoch in range(self.epochs):
            for rows in parts:
                part = batch if len(rows) == len(batch) else batch.select(rows)
                # The first pass sees every row once, against pi_old: the mismatch and the
                # old-policy sums are taken there.
                first = epoch == 0
                stats = self._optimizer_step(part, threshold, engine if first else None)
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
        if threshold is not None:
            out["entropy_threshold"] = threshold
        if batch.rollout_logp is not None:
            out.update(engine.summary(self._all_reduce))
        if logprob_sums:
            out["logprob_sums"] = seq_logp.tolist()
        return out

    def _mini_batch_rows(self, n: int) -> list[list[int]]:
        """Rows of each optimizer step (`data_parallel.mini_batch_bounds`)."""
        bounds = mini_batch_bounds(n, self.mini_batches)
        return [list(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]

    def _optimizer_step(
        self, batch: TrainBatch, threshold: float | None, engine: _EngineMismatch | None
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
        keys = (
            "loss",
            "pg_loss",
            "kl",
            "entropy",
            "clip_frac",
            "clip_frac_low",
            "clip_frac_high",
            "approx_kl",
        )
        totals = dict.fromkeys(keys, 0.0)
        seq_logp = torch.zeros(len(batch), dtype=torch.float64)
        micro_batches = self._micro_batches(batch)
        for i, rows in enumerate(micro_batches):
            mb = batch.rows(rows).to(self.device)
            self.engine.set_gradient_accumulation_boundary(i == len(micro_batches) - 1)
            logp, entropy = self._token_stats(self.engine, mb, self.temperature, True)
            token_share = int(per_seq_tokens[rows].sum()) / max(n_tokens, 1)
            old_logp = logp.detach() if on_policy else mb.old_logp
            seq_logp[rows] = _masked_row_sums(old_logp, mb.response_mask)
            token_weights = None
            if mb.rollout_logp is not None and (engine is not None or self.engine_is != "off"):
                token_weights, engine_stats = grpo.engine_is_weights(
                    old_logp, mb.rollout_logp, mb.response_mask, self.engine_is, self.engine_is_cap
                )
                if engine is not None:
                    engine.add(engine_stats)
                if self.engine_is == "off":
                    token_weights = None
            if self.loss == "dro":
                loss, stats = dro.dro_loss(
                    logp,
                    old_logp,
                    mb.advantages,
                    mb.response_mask,
                    ref_logp=mb.ref_logp,
                    entropy=entropy,
                    beta=self.kl_coef,
                    clip_low=self.clip_low,
                    clip_high=self.clip_high,
                    rho_ent=self.rho_ent,
                    max_len=max_len,
                    num_sequences=n_seqs,
                    entropy_threshold=threshold,
                    token_weights=token_weights,
                )
                pg_loss = stats["pg_loss"]
                totals["kl"] += stats["kl_loss"].item()
            else:
                pg_loss, stats = grpo.policy_loss(
                    logp,
                    old_logp,
                    mb.advantages,
                    mb.response_mask,
                    clip_low=self.clip_low,
                    clip_high=self.clip_high,
                    agg=self.loss_agg,
                    weights=mb.weights,
                    max_len=max_len,
                    token_weights=token_weights,
                )
                # The aggregation divides by this micro-batch's count; rescale to the global count.
                agg_share = int(agg_counts[rows].sum()) / max(n_agg, 1)
                pg_loss = pg_loss * agg_share
                loss = pg_loss
                if self.kl_coef > 0:
                    kl = (
                        grpo.kl_loss(logp, mb.ref_logp, mb.response_mask, self.loss_agg, max_len)
                        * agg_share
                    )
                    loss = loss + self.kl_coef * kl
                    totals["kl"] += kl.item()
            # DeepSpeed averages gradients over ranks, hence the world-size factor. Every
            # micro-batch runs backward, even one without loss tokens: ZeRO reduces on the last.
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            totals["loss"] += loss.item()
            totals["pg_loss"] += pg_loss.item()
            totals["entropy"] += grpo.masked_mean(entropy, mb.response_mask).item() * token_share
            for key in ("clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl"):
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
            tag=_STATE_TAG,
            client_state=client_state,
            exclude_frozen_parameters=self.use_lora,
        )

    def load_state(self, directory: str | Path) -> None:
        """Restore a `save_state` directory into this trainer (built with the same settings).

        A ZeRO state saved by another number of ranks is first converted (once, by rank 0, next
        to it) into DeepSpeed's universal checkpoint, which any rank count loads.
        """
        directory = Path(directory)
        tag = _STATE_TAG
        saved = len(list((directory / _STATE_TAG).glob("*zero_pp_rank_*_optim_states.pt")))
        universal = self.zero_stage > 0 and saved not in (0, self.world_size)
        if universal:
            tag = _UNIVERSAL_TAG
            if self.rank == 0 and not (directory / tag).is_dir():
                _to_universal(directory / _STATE_TAG, directory / tag)
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


def _to_universal(state: Path, out: Path) -> None:
    """DeepSpeed's conversion of a ZeRO state into a universal checkpoint (written beside, then
    renamed into place, so a half-written conversion is never loaded)."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    args = ["--input_folder", str(state), "--output_folder", str(partial)]
    args += ["--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"]
    done = subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", *args],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"cannot convert {state} (saved by another number of policy ranks) into a universal "
            f"checkpoint; resume with the rank count it was saved with:\n{done.stderr[-2000:]}"
        )
    partial.rename(out)


def _top_layers(model: PreTrainedModel, top: int | None) -> list[int] | None:
    """Indices of the last ``top`` decoder layers, for PEFT's ``layers_to_transform``."""
    if top is None:
        return None
    n_layers = model.config.num_hidden_layers
    if top > n_layers:
        raise ValueError(f"model.lora.top_layers={top} but the model has {n_layers} layers")
    return list(range(n_layers - top, n_layers))


class LrLambda:
    """The lr multiplier of optimizer step k (0-based): a linear warm-up to 1 over ``warmup``
    steps, then constant, or a linear / cosine decay to ``min_ratio`` at step ``total``.

    A class rather than a lambda so that DeepSpeed can pickle it with the scheduler's state.
    """

    def __init__(
        self,
        schedule: LrSchedule = "constant",
        warmup: int = 0,
        total: int | None = None,
        min_ratio: float = 0.0,
    ) -> None:
        if schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown lr schedule {schedule!r}")
        if warmup < 0 or not 0.0 <= min_ratio <= 1.0:
            raise ValueError(f"warmup={warmup} must be >= 0 and min_ratio={min_ratio} in [0, 1]")
        if schedule != "constant" and (total is None or total <= warmup):
            raise ValueError(
                f"a {schedule} lr schedule needs total steps above the warm-up ({warmup}), got {total}"
            )
        self.schedule, self.warmup, self.total, self.min_ratio = schedule, warmup, total, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / (self.total - self.warmup))
        if self.schedule == "linear":
            decay = 1.0 - progress
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * decay


class _EngineMismatch:
    """Token-weighted running means (and the max) of `grpo.engine_is_weights`'s statistics over
    the micro-batches of an update."""

    MEANS = ("engine_ratio_mean", "engine_capped_frac", "engine_kl")

    def __init__(self) -> None:
        self.sums = dict.fromkeys(self.MEANS, 0.0)
        self.tokens = 0.0
        self.ratio_max = 0.0

    def add(self, stats: dict[str, torch.Tensor]) -> None:
        n = float(stats["engine_tokens"])
        for key in self.MEANS:
            self.sums[key] += float(stats[key]) * n
        self.tokens += n
        if n:
            self.ratio_max = max(self.ratio_max, float(stats["engine_ratio_max"]))

    def summary(self, all_reduce: Callable[..., list[float]]) -> dict[str, float]:
        *sums, tokens = all_reduce([*self.sums.values(), self.tokens], "sum")
        (ratio_max,) = all_reduce([self.ratio_max], "max")
        out = {key: s / tokens if tokens else 0.0 for key, s in zip(self.MEANS, sums, strict=True)}
        out["engine_ratio_max"] = ratio_max if tokens else 1.0
        return out


def _masked_row_sums(logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row, ``logp`` summed over ``mask`` (float64, CPU): a sequence's log-prob."""
    return torch.where(mask, logp, torch.zeros_like(logp)).sum(dim=1).double().cpu()
