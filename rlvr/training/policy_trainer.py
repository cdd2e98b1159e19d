"""The trained policy under a DeepSpeed engine: ZeRO 0-3, full fine-tune or PEFT LoRA.

Micro-batched log-prob passes (old / reference / teacher-forced scoring) and the GRPO PPO-clip step
(`rlvr.algorithms.grpo`), merged-weight export for generation engines, HF checkpoints and exact resume.
One process per rank: on CPU a single gloo process, on GPUs one process (actor) per rank.
"""

from __future__ import annotations

import copy
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import deepspeed
import peft
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from rlvr.algorithms import dro, grpo
from rlvr.config import LoraConfig
from rlvr.generation.base import scored_positions
from rlvr.training.batch import TrainBatch, build_batch, token_entropy, token_logprobs

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
_STATE_TAG = "state"


def init_distributed() -> None:
    """Join the process group DeepSpeed needs, starting a one-process group when none is set up.

    A launcher (Ray placement group, torchrun) sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
    MASTER_PORT; without them this process is rank 0 of 1 on 127.0.0.1 and a free port. CPU uses
    gloo (DeepSpeed would pick oneCCL if its bindings were installed); GPUs use the accelerator's
    backend (nccl).
    """
    if dist.is_initialized():
        # Another component of this process (e.g. an in-process vLLM engine) already set up a group;
        # DeepSpeed reuses it but still insists on the launcher's rank variables.
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
        os.environ.setdefault("RANK", str(dist.get_rank()))
        os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
        return
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        os.environ.setdefault(key, value)
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        backend = "gloo"
    else:
        backend = accelerator.communication_backend_name()
        accelerator.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


class PolicyTrainer:
    """The policy model wrapped in a DeepSpeed engine, with GRPO log-prob, loss and step passes.

    ``train_step`` is one optimizer step over the whole batch, run in micro-batches of
    ``micro_batch_size`` sequences with gradient accumulation; each micro-batch's loss is scaled so
    the accumulated gradient equals that of the full-batch loss. With ``lora`` enabled only the
    adapter trains and the reference policy is the same model with adapters disabled; a full
    fine-tune keeps a frozen reference copy only when ``kl_coef > 0``.

    ``max_response_len`` is the constant normaliser of "seq-mean-token-sum-norm" (Dr.GRPO; pass the
    generation budget), by default the longest response of each batch. ``loss="dro"`` replaces the
    GRPO loss with DRO's (`dro.dro_loss`: Dr.GRPO normaliser over the batch's sequences, PG only on
    the top ``rho_ent`` entropy tokens of each micro-batch, k3 KL weighted by ``kl_coef`` on all
    loss tokens); the caller leaves rejected groups out of the batch and gives truncated rollouts
    no loss tokens, so they count in the normaliser only. ``warmup_steps`` ramps the
    lr linearly over the first optimizer steps. bf16 with ZeRO 1-3 keeps fp32 master weights and
    fp32 gradient accumulation; with stage 0 DeepSpeed accumulates gradients in bf16. On CPU every
    ZeRO stage runs in one gloo process and a fixed seed reproduces a run bit for bit.

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
        dtype: Literal["float32", "bfloat16"] = "float32",
        seed: int = 0,
        kl_coef: float = 0.0,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        loss_agg: LossAgg = "token-mean",
        max_response_len: int | None = None,
        warmup_steps: int = 0,
        loss: Literal["grpo", "dro"] = "grpo",
        rho_ent: float = dro.DEFAULT_RHO_ENT,
    ) -> None:
        if loss not in ("grpo", "dro"):
            raise ValueError(f"loss must be 'grpo' or 'dro', got {loss!r}")
        init_distributed()
        self.loss = loss
        self.rho_ent = rho_ent
        self.micro_batch_size = micro_batch_size
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

        # Seeded before any weight is created, so LoRA's random A init is reproducible.
        torch.manual_seed(seed)
        get_accelerator().manual_seed_all(seed)
        torch_dtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        pad = self.tokenizer.pad_token_id
        self._pad_id: int = self.tokenizer.eos_token_id if pad is None else pad
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
        self._hf_model: PreTrainedModel = model
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
        scheduler = None
        if warmup_steps > 0:
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _LinearWarmup(warmup_steps))
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
        self.steps = 0

    # ------------------------------------------------------------------ log-probs

    def _micro_ranges(self, n: int) -> Iterator[tuple[int, int]]:
        for start in range(0, n, self.micro_batch_size):
            yield start, min(start + self.micro_batch_size, n)

    def _forward(self, model: Callable[..., Any], mb: TrainBatch) -> torch.Tensor:
        return model(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False
        ).logits

    @torch.no_grad()
    def _logprobs_with(self, model: Callable[..., Any], batch: TrainBatch) -> torch.Tensor:
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for start, stop in self._micro_ranges(len(batch)):
            mb = batch.micro_batch(start, stop).to(self.device)
            logits = self._forward(model, mb)
            out[start:stop, : mb.input_ids.shape[1]] = token_logprobs(logits, mb.input_ids).cpu()
            del logits
        return out

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Current policy log-probs ``[B, T]`` (float32, CPU), aligned as in `rlvr.training.batch`.

        Micro-batched because whole-batch logits over the vocabulary dominate memory.
        """
        self.engine.eval()
        return self._logprobs_with(self.engine, batch)

    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Reference-policy log-probs ``[B, T]``: adapters disabled (LoRA) or the frozen copy."""
        if self.use_lora:
            self.engine.eval()
            with self.engine.module.disable_adapter():
                return self._logprobs_with(self.engine, batch)
        if self._ref_model is None:
            raise ValueError("no reference model: a full fine-tune keeps one only when kl_coef > 0")
        return self._logprobs_with(self._ref_model, batch)

    def sequence_logprobs(
        self, sequences: list[list[int]], positions: list[list[int]]
    ) -> list[list[float]]:
        """Current-policy log p(seq[t] | seq[:t]) at each t of `positions[i]` (DRO's R3 scoring).

        The learner-side twin of the generation backends' `score_logprobs`: one teacher-forced
        forward per sequence (micro-batched), full vocabulary, temperature 1.
        """
        batch = build_batch(
            [list(s[:1]) for s in sequences], [list(s[1:]) for s in sequences], self._pad_id
        )
        logp = self.logprobs(batch)
        return [
            logp[i, scored_positions(pos, len(sequences[i]))].tolist()
            for i, pos in enumerate(positions)
        ]

    # ------------------------------------------------------------------ training

    def train_step(self, batch: TrainBatch, logprob_sums: bool = False) -> dict[str, Any]:
        """One optimizer step of the PPO-clip GRPO loss (+ ``kl_coef`` * k3 KL) over ``batch``.

        ``batch.advantages`` is required; ``old_logp`` defaults to the current policy (on-policy,
        ratio 1) and ``ref_logp`` to `ref_logprobs` when ``kl_coef > 0``. Returns the full-batch
        loss, pre-clip grad_norm, clip_frac, kl, entropy (token means), lr and tokens. With
        ``logprob_sums`` it also returns "logprob_sums": per sequence of this rank's batch, the
        old-policy log-prob summed over its loss tokens (DUET's surrogate), taken from the
        training forward at no extra cost. The DRO loss also returns "entropy_threshold", the mean
        over micro-batches of the 80/20 entropy cut.
        """
        if batch.advantages is None:
            raise ValueError("train_step needs batch.advantages")
        # One optimizer step per batch: the policy is the same for every micro-batch, so the
        # on-policy old log-probs are the detached log-probs of the training forward itself.
        on_policy = batch.old_logp is None
        if self.kl_coef > 0 and batch.ref_logp is None:
            batch = replace(batch, ref_logp=self.ref_logprobs(batch))

        # The loss is the global-batch loss across ranks, so its denominators are global sums.
        per_seq_tokens = batch.response_mask.sum(dim=1)
        agg_counts = self._aggregation_counts(per_seq_tokens)
        n_tokens, n_agg = (
            int(x) for x in self._all_reduce([per_seq_tokens.sum(), agg_counts.sum()], "sum")
        )
        if n_tokens == 0:
            raise ValueError("batch has no loss tokens")
        # Dr.GRPO's constant normaliser must be the same for every micro-batch of the step.
        max_len = self.max_response_len or int(self._all_reduce([per_seq_tokens.max()], "max")[0])
        n_seqs = int(self._all_reduce([len(batch)], "sum")[0]) if self.loss == "dro" else 0
        entropy_thresholds: list[float] = []

        self.engine.train()
        lr = self.engine.get_lr()[0]
        totals = dict.fromkeys(("loss", "pg_loss", "kl", "entropy", "clip_frac", "approx_kl"), 0.0)
        seq_logp = torch.zeros(len(batch), dtype=torch.float64)
        ranges = list(self._micro_ranges(len(batch)))
        for i, (start, stop) in enumerate(ranges):
            mb = batch.micro_batch(start, stop).to(self.device)
            self.engine.set_gradient_accumulation_boundary(i == len(ranges) - 1)
            logits = self._forward(self.engine, mb)
            logp = token_logprobs(logits, mb.input_ids)
            entropy = token_entropy(logits)
            del logits
            token_share = int(per_seq_tokens[start:stop].sum()) / n_tokens
            old_logp = logp.detach() if on_policy else mb.old_logp
            if logprob_sums:
                masked = torch.where(mb.response_mask, old_logp, torch.zeros_like(old_logp))
                seq_logp[start:stop] = masked.sum(dim=1).double().cpu()
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
                )
                pg_loss = stats["pg_loss"]
                totals["kl"] += stats["kl_loss"].item()
                if mb.response_mask.any():
                    entropy_thresholds.append(float(stats["entropy_threshold"]))
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
                )
                # The aggregation divides by this micro-batch's count; rescale to the global count.
                pg_loss = pg_loss * (int(agg_counts[start:stop].sum()) / n_agg)
                loss = pg_loss
            if self.kl_coef > 0 and self.loss == "grpo":
                kl = grpo.kl_k3_mean(logp, mb.ref_logp, mb.response_mask) * token_share
                loss = loss + self.kl_coef * kl
                totals["kl"] += kl.item()
            # DeepSpeed averages gradients over ranks, hence the world-size factor. Every
            # micro-batch runs backward, even one without loss tokens: ZeRO reduces on the last.
            self.engine.backward(loss * self.world_size, scale_wrt_gas=False)
            totals["loss"] += loss.item()
            totals["pg_loss"] += pg_loss.item()
            totals["entropy"] += grpo.masked_mean(entropy, mb.response_mask).item() * token_share
            totals["clip_frac"] += stats["clip_frac"].item() * token_share
            totals["approx_kl"] += stats["approx_kl"].item() * token_share

        pre_step_norm = self._grad_norm() if self.zero_stage == 0 else None
        self.engine.step()
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is None:
            # DeepSpeed clips plain fp32 (stage 0) gradients without keeping the norm.
            grad_norm = pre_step_norm
        self.steps += 1
        metrics = dict(zip(totals, self._all_reduce(list(totals.values()), "sum"), strict=True))
        out: dict[str, Any] = {
            **metrics,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens": n_tokens,
        }
        if entropy_thresholds:
            # The 80/20 quantile is taken per micro-batch (as TRL does per device batch).
            out["entropy_threshold"] = sum(entropy_thresholds) / len(entropy_thresholds)
        if logprob_sums:
            out["logprob_sums"] = seq_logp.tolist()
        return out

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
        base = self.engine.module.get_base_model() if self.use_lora else self.engine.module
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        lora_prefixes: list[str] = []
        for name, module in base.named_modules():
            if any(name.startswith(prefix) for prefix in lora_prefixes):
                continue
            if isinstance(module, LoraLayer):
                lora_prefixes.append(name + ".")
                with self._gathered(list(module.parameters())):
                    layer = module.base_layer
                    merged = layer.weight.detach() + module.get_delta_weight("default")
                    out[f"{name}.weight"] = merged.cpu()
                    seen.add(id(layer.weight))
                    if layer.bias is not None:
                        out[f"{name}.bias"] = layer.bias.detach().to("cpu", copy=True)
                        seen.add(id(layer.bias))
                continue
            for pname, param in module.named_parameters(recurse=False):
                if id(param) in seen:
                    continue
                seen.add(id(param))
                with self._gathered([param]):
                    key = f"{name}.{pname}" if name else pname
                    # A copy: a gathered ZeRO-3 parameter's storage is freed after the block.
                    out[key] = param.detach().to("cpu", copy=True)
        return out

    def save_checkpoint(self, directory: str | Path) -> None:
        """Write an HF model directory (merged weights + tokenizer) and, with LoRA, ``adapter/``.

        ``AutoModelForCausalLM.from_pretrained(directory)`` loads it; every rank must call it.
        """
        directory = Path(directory)
        weights = self.export_weights()
        if self.use_lora:
            adapters = [p for p in self.engine.module.parameters() if p.requires_grad]
            with self._gathered(adapters):
                if self.rank == 0:
                    self.engine.module.save_pretrained(directory / "adapter")
        if self.rank == 0:
            self._hf_model.save_pretrained(directory, state_dict=weights)
            self.tokenizer.save_pretrained(directory)
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
        """Restore a `save_state` directory into this trainer (built with the same settings)."""
        path, client_state = self.engine.load_checkpoint(
            str(directory), tag=_STATE_TAG, load_module_strict=not self.use_lora
        )
        if path is None:
            raise FileNotFoundError(f"no trainer state under {directory}")
        self.steps = client_state["steps"]
        torch.set_rng_state(client_state["cpu_rng"])
        get_accelerator().set_rng_state(client_state["accelerator_rng"])


def _top_layers(model: PreTrainedModel, top: int | None) -> list[int] | None:
    """Indices of the last ``top`` decoder layers, for PEFT's ``layers_to_transform``."""
    if top is None:
        return None
    n_layers = model.config.num_hidden_layers
    if top > n_layers:
        raise ValueError(f"model.lora.top_layers={top} but the model has {n_layers} layers")
    return list(range(n_layers - top, n_layers))


class _LinearWarmup:
    """lr multiplier rising linearly to 1 over ``steps`` optimizer steps (picklable, unlike a lambda)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.steps)
