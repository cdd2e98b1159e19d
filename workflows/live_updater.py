"""The live updater: Expert-Iteration LoRA updates from served, verified traffic (arXiv:2605.20270
Sec. 6.2, updates predictable under Assumption 4.2).

EI round r is seqs [r * round_size, (r + 1) * round_size) of the live stream. Once every one of
them is applied (closed: labelled, or expired as a failure), a PolicyActor (DeepSpeed, LoRA) takes
`epochs` passes of SFT over the round's verifier-correct pairs (`live.algorithm: sft`, the paper's
Expert Iteration) or of GRPO over its shadow-verified prompts (`grpo`: fresh samples of the current
version, rewarded against each prompt's reference), the adapter is saved under a content-named
version, and the StreamsActor publishes it at the next seq of every stream,
declaring the last training seq (rule R2: it serves only later seqs). Replicas switch to it
between generations (`workflows.serve`).

Progress is durable: `updater.json` names the next round and every published version, and is
rewritten after a round's adapter and trainer state are on disk and before the version is
published. A restarted updater reloads the last state and publishes the last version again
(idempotent), so it neither skips a round nor trains one twice.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from transformers import AutoTokenizer

from actors.policy import PolicyActor
from rlvr.algorithms.groups import group_rows
from rlvr.config import Config
from rlvr.generation import make_backend
from rlvr.generation.base import GenerationRequest, SamplingParams
from rlvr.methods.grpo.shaping import shape_grpo
from rlvr.serving.config import ServeConfig
from rlvr.serving.live_updates import (
    UPDATER_FILE,
    UpdaterState,
    adapter_dir,
    adapter_version,
    round_seqs,
    shuffled_batches,
)
from rlvr.training.batch import build_batch
from rlvr.training.rendezvous import LOOPBACK
from rlvr.training.rollouts import Rollouts
from rlvr.verifiers.math import MathVerifier
from workflows.workers import Worker

GRPO_DEFAULTS = Config()
"""The training config's defaults: GRPO's group-normalised advantages, as a training run's."""

log = logging.getLogger(__name__)


class LiveUpdater:
    """Consumes the live stream's closed EI rounds and publishes one LoRA version per round that
    has verifier-correct pairs; `poll()` does all the work that is ready."""

    def __init__(self, cfg: ServeConfig, model_dir: str | Path, streams: Any):
        self.live = cfg.live
        self.model_dir, self.dtype = Path(model_dir), cfg.model.dtype
        self._engine: Any = None
        self.stream = cfg.live_stream()
        self.streams = streams
        self.dir = cfg.live_dir().resolve()
        (self.dir / "versions").mkdir(parents=True, exist_ok=True)
        (self.dir / "state").mkdir(exist_ok=True)
        self.state = UpdaterState.load(self.dir / UPDATER_FILE)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        pad = tokenizer.pad_token_id
        self.pad_id = tokenizer.eos_token_id if pad is None else pad
        actor = (
            ray.remote(PolicyActor)
            .options(num_cpus=self.live.cpus)
            .remote(
                str(model_dir),
                threads=self.live.threads,
                lora=self.live.lora.settings(),
                address=LOOPBACK,
                zero_stage=self.live.zero_stage,
                lr=self.live.lr,
                micro_batch_size=self.live.batch_size,
                seed=self.live.seed,
                # SFT's NLL is at temperature 1; GRPO's ratio at the one it samples at.
                temperature=self.live.temperature if self.live.algorithm == "grpo" else 1.0,
            )
        )
        self.policy = Worker(actor, "live PolicyActor")
        self.policy.run("ready")
        latest = self.state.latest
        if latest is not None:
            self.policy.run("load_state", latest["state"])
            # A crash may have come between saving the state and publishing: publish again.
            self._publish(latest)

    def poll(self) -> list[dict[str, Any]]:
        """Train and publish every closed round not consumed yet, in order; returns a record per
        round consumed (with "policy" None where it had no correct pair)."""
        done = []
        while True:
            index = self.state.next_round
            first, end = round_seqs(index, self.live.round_size)
            closed = ray.get(self.streams.closed_round.remote(self.stream, first, end))
            if closed is None:
                return done
            done.append(self._consume(index, closed))

    def close(self) -> None:
        """Stop the updater's policy rank and engine (its progress is on disk)."""
        ray.kill(self.policy.target)
        if self._engine is not None:
            self._engine.close()

    def _consume(self, index: int, closed: dict[str, Any]) -> dict[str, Any]:
        first, end = round_seqs(index, self.live.round_size)
        if self.live.algorithm == "grpo":
            stats = self._grpo(index, closed["references"])
        else:
            stats = self._sft(index, closed)
        if not stats.get("optimizer_steps"):
            log.info("live round %d (seqs %d-%d): nothing to learn from", index, first, end - 1)
            self.state.skipped.append(index)
            self.state.next_round = index + 1
            self.state.save(self.dir / UPDATER_FILE)
            return {"round": index, "policy": None, **stats}
        record = self._save(index, end - 1, stats)
        return record | {"boundaries": self._publish(record)}

    def _sft(self, index: int, closed: dict[str, Any]) -> dict[str, Any]:
        """Expert Iteration: SFT on the round's verifier-correct pairs (no step without one)."""
        pairs = closed["pairs"]
        if closed["passed_without_experience"]:
            log.warning(
                "live round %d: %d passed rounds have no kept answer and are not trained on",
                index,
                len(closed["passed_without_experience"]),
            )
        if not pairs:
            return {"pairs": 0}
        nll, tokens = 0.0, 0
        steps = shuffled_batches(
            len(pairs), self.live.batch_size, self.live.epochs, self.live.seed + index
        )
        for rows in steps:
            batch = build_batch(
                [pairs[i]["prompt_ids"] for i in rows],
                [pairs[i]["response_ids"] for i in rows],
                self.pad_id,
            )
            # Unit advantages on-policy: the clipped surrogate's gradient at ratio 1 is the
            # token-mean NLL gradient, so this optimizer step is plain SFT on the pairs.
            batch.advantages = torch.ones(len(rows))
            stats = self.policy.run("train_step", batch, logprob_sums=True, step=index)
            nll -= sum(stats["logprob_sums"])
            tokens += stats["tokens"]
        return {"pairs": len(pairs), "optimizer_steps": len(steps), "sft_nll": nll / tokens}

    def _grpo(self, index: int, prompts: list[dict[str, Any]]) -> dict[str, Any]:
        """GRPO on the round's shadow-verified prompts: `group_size` samples of each from the
        current version, rewarded 1 where the verifier finds the reference's answer, group
        advantages (arXiv:2402.03300), then PPO-clip steps of `batch_size` prompts against the
        log-probs from before the round's first step (no step without a prompt, or without a
        group that holds both outcomes)."""
        if not prompts:
            return {"prompts": 0}
        engine = self._rollout_engine()
        engine.load_weights(self.policy.run("export_weights", step=index).items())
        params = SamplingParams(
            temperature=self.live.temperature, top_p=1.0, max_tokens=self.live.max_tokens
        )
        requests = [
            GenerationRequest(
                prompt_ids=e["prompt_ids"],
                n=self.live.group_size,
                seed=(self.live.seed << 32) + e["seq"],
                request_id=str(i),
            )
            for i, e in enumerate(prompts)
        ]
        rollouts = Rollouts.from_results(
            engine.generate(requests, params),
            {str(i): e["reference"] for i, e in enumerate(prompts)},
        )
        with MathVerifier(num_workers=1) as verifier:
            verdicts = verifier.verify_batch(rollouts.texts, rollouts.golds)
        rollouts.rewards = np.array([float(status == "correct") for _, status in verdicts])
        # GRPO's own shaping: group advantages on the response tokens, the engine's log-probs
        batch, _ = shape_grpo(rollouts, GRPO_DEFAULTS, pad_id=self.pad_id)
        stats = {
            "prompts": len(prompts),
            "samples": len(rollouts),
            "reward_mean": float(rollouts.rewards.mean()),
        }
        if not batch.advantages.any():
            return stats
        # pi_old of every update of the round: the version before the round's first step
        batch.old_logp = self.policy.run("logprobs", batch, step=index)
        rows_of = group_rows(rollouts.group_ids)
        steps = shuffled_batches(
            len(prompts), self.live.batch_size, self.live.epochs, self.live.seed + index
        )
        for chosen in steps:
            part = batch.rows([r for i in chosen for r in rows_of[str(i)]])
            self.policy.run("train_step", part, step=index)
        return stats | {"optimizer_steps": len(steps)}

    def _rollout_engine(self) -> Any:
        """The transformers engine GRPO samples from (built once, on the served base)."""
        if self._engine is None:
            self._engine = make_backend("hf", self.model_dir, dtype=self.dtype)
        return self._engine

    def _save(self, index: int, trained_through: int, stats: dict[str, Any]) -> dict[str, Any]:
        """Adapter under its content-named version and the trainer state, then the progress."""
        partial = self.dir / "versions" / f".round-{index}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        self.policy.run("save_adapter", str(partial), step=index)
        version = adapter_version(index, partial)
        adapter = adapter_dir(self.dir, version)
        if adapter.exists():
            shutil.rmtree(partial)
        else:
            os.replace(partial, adapter)
        state = self.dir / "state" / f"round-{index}"
        shutil.rmtree(state, ignore_errors=True)
        self.policy.run("save_state", str(state), step=index)
        record = {
            "round": index,
            "policy": version,
            "adapter": str(adapter),
            "state": str(state),
            "trained_through": trained_through,
            **stats,
        }
        previous = self.state.latest
        self.state.published.append(record)
        self.state.next_round = index + 1
        self.state.save(self.dir / UPDATER_FILE)
        if previous is not None:
            shutil.rmtree(previous["state"], ignore_errors=True)  # only the newest is resumed
        log.info("live round %d -> %s (%s)", index, version, stats)
        return record

    def _publish(self, record: dict[str, Any]) -> dict[str, int]:
        """Deploy a saved version on every stream (idempotent); each stream's boundary seq."""
        return ray.get(
            self.streams.publish.remote(record["policy"], record["trained_through"], self.stream)
        )
