"""Supervised warm-up on reference solutions, so RL on a freshly built model starts above zero.

Loss on the response tokens only (prompt rendered by the chat template, then the solution and EOS).
Cached by a content hash of (model files, problems, hyperparameters): a repeat call returns at once.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from rlvr.tasks.base import Problem
from rlvr.tasks.prompts import render_prompt

MARKER = "rlvr_sft.json"


def _fingerprint(model_dir: Path, problems: list[Problem], params: dict) -> str:
    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("tokenizer.json")):
        h.update(f.read_bytes())
    for p in problems:
        h.update(f"{p.prompt}\0{p.solution}\0".encode())
    h.update(json.dumps(params, sort_keys=True).encode())
    return h.hexdigest()[:20]


def sft_warmup(
    model_dir: str | Path,
    problems: list[Problem],
    out_dir: str | Path,
    steps: int = 300,
    lr: float = 1e-3,
    batch_size: int = 16,
    seed: int = 0,
    instruction: str = "Put your final answer in \\boxed{}.",
) -> Path:
    """Fine-tune `model_dir` on `problems`' solutions for `steps` AdamW steps; returns the new dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, out = Path(model_dir), Path(out_dir)
    params = {
        "steps": steps,
        "lr": lr,
        "batch_size": batch_size,
        "seed": seed,
        "instruction": instruction,
    }
    fp = _fingerprint(model_dir, problems, params)
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("fingerprint") == fp:
        return out
    if not problems or not all(p.solution for p in problems):
        raise ValueError("SFT warm-up needs problems with reference solutions")

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    examples = []
    for p in problems:
        prompt = render_prompt(tokenizer, p, instruction)
        response = tokenizer(p.solution, add_special_tokens=False)["input_ids"] + [
            tokenizer.eos_token_id
        ]
        examples.append((prompt, response))

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * max(0.0, 1 - s / steps)
    )
    gen = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for _ in range(steps):
        idx = torch.randint(len(examples), (batch_size,), generator=gen).tolist()
        batch = [examples[i] for i in idx]
        width = max(len(a) + len(b) for a, b in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (a, b) in enumerate(batch):
            ids[i, : len(a) + len(b)] = torch.tensor(a + b)
            labels[i, len(a) : len(a) + len(b)] = torch.tensor(b)
            attn[i, : len(a) + len(b)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())

    staging = out.with_name(out.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / MARKER).write_text(
        json.dumps({"fingerprint": fp, "final_loss": losses[-1], **params})
    )
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out
