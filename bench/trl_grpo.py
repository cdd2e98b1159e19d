"""TRL's GRPOTrainer on a prompt file, timed per optimizer step: `bench/vs_trl.py` runs it.

Runs in TRL's own environment (`make trl-env` builds .venv-trl), never in the project's, so it
imports nothing from the project. Each optimizer step is split into generation (generate + score,
`_generate_and_score_completions`), forward + loss (`compute_loss`) and the rest of the step
(backward, clipping and the optimizer), and written as JSON lines to --out.

    .venv-trl/bin/python bench/trl_grpo.py --model DIR --prompts prompts.json --out steps.jsonl
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from math_verify import parse, verify
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def boxed_reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
    """1.0 where math-verify finds the reference answer in the completion, else 0.0."""
    return [
        float(bool(verify(parse(f"${a}$"), parse(c))))
        for c, a in zip(completions, answer, strict=True)
    ]


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that adds up the seconds of generation and of forward + loss, and the tokens
    generated, since `StepTimer` last read them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seconds = {"generate": 0.0, "forward": 0.0}
        self.tokens = 0

    def _generate_and_score_completions(self, inputs):
        t0 = time.perf_counter()
        out = super()._generate_and_score_completions(inputs)
        self.seconds["generate"] += time.perf_counter() - t0
        self.tokens += int(out["completion_mask"].sum())
        return out

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        t0 = time.perf_counter()
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.seconds["forward"] += time.perf_counter() - t0
        return out


class StepTimer(TrainerCallback):
    """Writes one JSON line per optimizer step: its wall time and split."""

    def __init__(self, trainer: TimedGRPOTrainer, out: Path):
        self.trainer, self.out = trainer, out
        self.last = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now, t = time.perf_counter(), self.trainer
        step_s, gen, fwd = now - self.last, t.seconds["generate"], t.seconds["forward"]
        record = {
            "step": state.global_step - 1,
            "time_step": step_s,
            "time_generate": gen,
            "time_forward": fwd,
            "time_backward_optimizer": step_s - gen - fwd,
            "time_train": step_s - gen,
            "tokens_generated": t.tokens,
        }
        with self.out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        t.seconds, t.tokens = {"generate": 0.0, "forward": 0.0}, 0
        self.last = now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory")
    ap.add_argument("--prompts", required=True, help='JSON list of {"prompt": text, "answer": str}')
    ap.add_argument("--out", required=True, help="JSON lines, one per optimizer step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--micro-batch", type=int, default=8, help="completions per forward/backward")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--lora", help="JSON keyword arguments of peft.LoraConfig (default: full FT)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rows = json.loads(Path(args.prompts).read_text())
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
    completions = args.prompts_per_step * args.group_size
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=args.micro_batch,
            gradient_accumulation_steps=completions // args.micro_batch,
            num_generations=args.group_size,
            max_completion_length=args.max_tokens,
            temperature=args.temperature,
            top_p=1.0,
            learning_rate=args.lr,
            max_steps=args.steps,
            seed=args.seed,
            use_cpu=True,
            bf16=False,
            save_strategy="no",
            logging_steps=1,
            report_to=[],
            disable_tqdm=True,
            model_init_kwargs={"dtype": torch.float32},
        )
        peft = LoraConfig(**json.loads(args.lora)) if args.lora else None
        trainer = TimedGRPOTrainer(
            model=args.model,
            reward_funcs=boxed_reward,
            args=config,
            train_dataset=dataset,
            peft_config=peft,
        )
        trainer.add_callback(StepTimer(trainer, Path(args.out)))
        trainer.train()


if __name__ == "__main__":
    main()
