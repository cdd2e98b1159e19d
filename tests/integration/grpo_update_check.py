"""Body of test_grpo_update, run as its own process: an in-process vLLM engine and a DeepSpeed
trainer share process-global torch.distributed state, and vLLM's teardown would leave DeepSpeed's
cached groups stale for every later test of the session (the actors keep them in separate processes).

Usage: python grpo_update_check.py MODEL_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from rlvr.config import load_config
from rlvr.generation.base import GenerationRequest, SamplingParams
from rlvr.methods.grpo.shaping import shape_grpo
from rlvr.tasks import load_task
from rlvr.tasks.prompts import render_prompt
from rlvr.training.rollouts import Rollouts
from rlvr.verifiers.math import MathVerifier

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def main(model_dir: str) -> None:
    from rlvr.generation.vllm_backend import VLLMBackend
    from rlvr.training.policy_trainer import PolicyTrainer

    cfg = load_config(None, ["generation.group_size=4", "training.lr=1e-3"])
    problems = load_task(load_config(TINY).task)[0]
    engine = VLLMBackend(model_dir, dtype="float32", max_model_len=256, kv_cache_gib=0.25, seed=0)
    trainer = PolicyTrainer(model_dir, zero_stage=2, lr=1e-3, micro_batch_size=16, seed=0)
    try:
        tok = trainer.tokenizer
        batch_problems = problems[:8]
        requests = [
            GenerationRequest(
                render_prompt(tok, p, cfg.task.instruction), n=8, request_id=p.id, seed=100 * i
            )
            for i, p in enumerate(batch_problems)
        ]
        params = SamplingParams(temperature=1.0, max_tokens=32, seed=11)
        rollouts = Rollouts.from_results(
            engine.generate(requests, params), {p.id: p.answer for p in batch_problems}
        )
        with MathVerifier(num_workers=1, timeout=5.0) as verifier:
            scored = verifier.verify_batch(rollouts.texts, rollouts.golds)
        rollouts.rewards = np.array([r for r, _ in scored])
        assert len(rollouts) == 64
        assert {s for _, s in scored} <= {"correct", "wrong", "no_answer"}

        batch, stats = shape_grpo(rollouts, cfg, pad_id=tok.pad_token_id)
        assert stats["nonzero_advantage_frac"] > 0, (
            "some group must hold both solved and failed samples"
        )
        before = trainer.logprobs(batch)
        metrics = trainer.train_step(batch)
        after = trainer.logprobs(batch)
        assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        changed = (after - before).abs()[batch.response_mask]
        assert changed.max() > 0  # the update moved the policy on the sampled tokens

        # sync: the engine now generates from the updated weights, exactly as a fresh HF copy would
        weights = trainer.export_weights()
        engine.load_weights(weights.items())
        greedy = SamplingParams(temperature=0.0, max_tokens=16)
        out = engine.generate(requests[:2], greedy)
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        ref.load_state_dict(weights, strict=False)
        for req, res in zip(requests[:2], out, strict=True):
            ids = torch.tensor([req.prompt_ids])
            gen = ref.generate(
                ids, max_new_tokens=16, do_sample=False, eos_token_id=tok.eos_token_id
            )
            hf_tokens = gen[0, len(req.prompt_ids) :].tolist()
            hf_tokens = (
                hf_tokens[: hf_tokens.index(tok.eos_token_id) + 1]
                if tok.eos_token_id in hf_tokens
                else hf_tokens
            )
            assert res.samples[0].token_ids == hf_tokens
    finally:
        engine.close()


if __name__ == "__main__":
    main(sys.argv[1])
    print("grpo update check passed")
