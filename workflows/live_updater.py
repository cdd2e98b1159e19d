"""The live updater: Expert-Iteration LoRA updates from served, verified traffic (arXiv:2605.20270
Sec. 6.2; digest 2.8 and 3.2).

EI round r is seqs [r * round_size, (r + 1) * round_size) of the live stream. Once every one of
them is applied (closed: labelled, or expired as a failure), a PolicyActor (DeepSpeed, LoRA) takes
`epochs` passes of SFT over the round's verifier-correct pairs (`live.algorithm: sft`, the paper's
Expert Iteration) or of GRPO over its shadow-verified prompts (`grpo`: fresh samples of the current
version, rewarded against each prompt's reference), the adapter is saved under a content-named
version, and the ControllerActor publishes it at the next seq of every stream,
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

import ray
import torch
from transformers import AutoTokenizer

from actors.policy import PolicyActor
from rlvr.algorithms.advantages import group_advantages
from rlvr.generation import make_backend
from rlvr.generation.base import GenerationRequest, SamplingParams
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
from rlvr.verifiers.math import MathVerifier

log = logging.getLogger(__name__)


class LiveUpdater:
    """Consumes the live stream's closed EI rounds and publishes one LoRA version per round that
    has verifier-correct pairs; `poll()` does all the work that is ready."""

    def __init__(self, cfg: ServeConfig, model_dir: str | Path, controller: Any):
        self.live = cfg.live
        self.model_dir, self.dtype = Path(model_dir), cfg.model.dtype
        self._engine: Any = None
        self.stream = cfg.live_stream()
        self.controller = controller
        self.dir = cfg.live_dir().resolve()
        (self.dir / "versions").mkdir(parents=True, exist_ok=True)
        (self.dir / "state").mkdir(exist_ok=True)
        self.state = UpdaterState.load(self.dir / UPDATER_FILE)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        pad = tokenizer.pad_token_id
        self.pad_id = tokenizer.eos_token_id if pad is None else pad
        self.policy = (
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
        ray.get(self.policy.ready.remote())
        latest = self.state.latest
        if latest is not None:
            ray.get(self.policy.load_state.remote(latest["state"]))
            # A crash may have come between saving the state and publishing: publish again.
            self._publish(latest)

    def poll(self) -> list[dict[str, Any]]:
        """Train and publish every closed round not consumed yet, in order; returns a record per
        round consumed (with "policy" None where it had no correct pair)."""
        done = []
        while True:
            index = self.state.next_round
            first, end = round_seqs(index, self.live.round_size)
            closed = ray.get(self.controller.csa_closed_round.remote(self.stream, first, end))
            if closed is None:
                return done
            done.append(self._consume(index, closed))

    def close(self) -> None:
        """Stop the updater's policy rank and engine (its progress is on disk)."""
        ray.kill(self.policy)
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
            stats = ray.get(self.policy.train_step.remote(batch, logprob_sums=True))
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
        engine.load_weights(ray.get(self.policy.export_weights.remote()).items())
        params = SamplingParams(
            temperature=self.live.temperature, top_p=1.0, max_tokens=self.live.max_tokens
        )
        requests = [
            GenerationRequest(
                prompt_ids=e["prompt_ids"],
                n=self.live.group_size,
                seed=(self.live.seed << 32) + e["seq"],
            )
            for e in prompts
        ]
        results = engine.generate(requests, params)
        samples = [(i, s) for i, result in enumerate(results) for s in result.samples]
        golds = [prompts[i]["reference"] for i, _ in samples]
        with MathVerifier(num_workers=1) as verifier:
            verdicts = verifier.verify_batch([s.text for _, s in samples], golds)
        rewards = [float(status == "correct") for _, status in verdicts]
        groups = [i for i, _ in samples]
        advantages = torch.as_tensor(group_advantages(rewards, groups), dtype=torch.float32)
        rollouts = {
            "prompts": len(prompts),
            "samples": len(samples),
            "reward_mean": sum(rewards) / len(rewards),
        }
        if not advantages.any():
            return rollouts
        rows_of = {i: [r for r, g in enumerate(groups) if g == i] for i in range(len(prompts))}

        def batch_of(rows: list[int]) -> Any:
            return build_batch(
                [prompts[groups[r]]["prompt_ids"] for r in rows],
                [samples[r][1].token_ids for r in rows],
                self.pad_id,
                rollout_logprobs=[samples[r][1].logprobs for r in rows],
            )

        everything = list(range(len(samples)))
        old_logp = ray.get(self.policy.logprobs.remote(batch_of(everything)))
        steps = shuffled_batches(
            len(prompts), self.live.batch_size, self.live.epochs, self.live.seed + index
        )
        for chosen in steps:
            rows = [r for i in chosen for r in rows_of[i]]
            batch = batch_of(rows)
            batch.advantages = advantages[rows]
            batch.old_logp = old_logp[rows, : batch.input_ids.shape[1]]
            ray.get(self.policy.train_step.remote(batch))
        return rollouts | {"optimizer_steps": len(steps)}

    def _rollout_engine(self) -> Any:
        """The transformers engine GRPO samples from (built once, on the served base)."""
        if self._engine is None:
            self._engine = make_backend("hf", self.model_dir, dtype=self.dtype)
        return self._engine

    def _save(self, index: int, trained_through: int, stats: dict[str, Any]) -> dict[str, Any]:
        """Adapter under its content-named version and the trainer state, then the progress."""
        partial = self.dir / "versions" / f".round-{index}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        ray.get(self.policy.save_adapter.remote(str(partial)))
        version = adapter_version(index, partial)
        adapter = adapter_dir(self.dir, version)
        if adapter.exists():
            shutil.rmtree(partial)
        else:
            os.replace(partial, adapter)
        state = self.dir / "state" / f"round-{index}"
        shutil.rmtree(state, ignore_errors=True)
        ray.get(self.policy.save_state.remote(str(state)))
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
            self.controller.csa_publish.remote(
                record["policy"], record["trained_through"], self.stream
            )
        )
