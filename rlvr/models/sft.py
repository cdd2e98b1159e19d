"""Supervised warm-up on reference solutions, so RL on a freshly built model starts above zero.

Loss on the response tokens only (prompt rendered as the task renders it, then the solution and EOS).
Cached by a content hash of (model files, problems, hyperparameters): a repeat call returns at once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from rlvr.answers import last_boxed
from rlvr.envs.rollout import EnvSettings
from rlvr.envs.traces import tool_call_examples
from rlvr.models.tiny import build_lock, publish_dir, staging_dir
from rlvr.tasks.base import Problem
from rlvr.tasks.prompts import DEFAULT_INSTRUCTION, render_prompt

MARKER = "rlvr_sft.json"
WARMUP_STEPS = 20


def _fingerprint(model_dir: Path, problems: list[Problem], params: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in model_dir.iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda fh=fh: fh.read(1 << 24), b""):
                h.update(chunk)
    for p in problems:
        h.update(f"{p.id}\0{p.prompt}\0{p.solution}\0".encode())
        if p.messages:
            h.update(json.dumps(p.messages).encode() + b"\0")
    h.update(json.dumps(params, sort_keys=True).encode())
    return h.hexdigest()[:20]


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask and labels that are -100 outside the response."""
    width = max(len(a) + len(b) for a, b in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (prompt, response) in enumerate(examples):
        end = len(prompt) + len(response)
        ids[i, :end] = torch.tensor(prompt + response)
        labels[i, len(prompt) : end] = torch.tensor(response)
        attn[i, :end] = 1
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def sft_warmup(
    model_dir: str | Path,
    problems: list[Problem],
    out_dir: str | Path,
    steps: int = 300,
    lr: float = 1e-3,
    seed: int = 0,
    batch_size: int = 16,
    instruction: str = DEFAULT_INSTRUCTION,
    chat_template: bool = True,
    tool_traces: EnvSettings | None = None,
) -> Path:
    """Fine-tune `model_dir` on `problems`' reference solutions (or, with `tool_traces`, on
    traces that call that environment's tool and then answer: `rlvr.envs.traces`); returns
    `out_dir`.

    Plain torch AdamW on CPU, `steps` steps of `batch_size` problems drawn with `seed`, a short
    linear warm-up then linear decay of `lr`. Prompts are rendered as RL will render them
    (`chat_template`, task.chat_template), so the warm-up teaches the format RL samples in. The
    result is an HF directory (model + tokenizer); if `out_dir` already holds the result for the
    same inputs it is returned untouched.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, out = Path(model_dir), Path(out_dir)
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError("SFT warm-up needs steps >= 1, batch_size >= 1 and lr > 0")
    if not problems or not all(p.solution for p in problems):
        raise ValueError("SFT warm-up needs problems, each with a reference solution")
    params = {
        "steps": steps,
        "lr": lr,
        "seed": seed,
        "batch_size": batch_size,
        "instruction": instruction,
        "chat_template": chat_template,
    }
    if tool_traces is not None:
        params["tool_traces"] = tool_traces.described()
    fingerprint = _fingerprint(model_dir, problems, params)
    with build_lock(out):
        marker = out / MARKER
        if marker.is_file() and json.loads(marker.read_text()).get("fingerprint") == fingerprint:
            return out

        torch.manual_seed(seed)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        if tool_traces is not None:
            examples = tool_call_examples(tool_traces, tokenizer, problems)
        else:
            examples = [
                (
                    render_prompt(tokenizer, p, instruction, chat_template),
                    tokenizer(p.solution, add_special_tokens=False)["input_ids"] + [eos],
                )
                for p in problems
            ]
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / WARMUP_STEPS) * max(0.0, 1 - s / steps)
        )
        draw = torch.Generator().manual_seed(seed)
        model.train()
        loss = torch.tensor(float("nan"))
        # minutes on a real model: the bar says how far, the loss whether it learns
        bar = tqdm(range(steps), desc=f"SFT warm-up {model_dir.name}", unit="step", leave=False)
        for _ in bar:
            picked = torch.randint(len(examples), (batch_size,), generator=draw).tolist()
            loss = model(**_batch([examples[i] for i in picked], pad)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            bar.set_postfix(loss=f"{loss.item():.3f}")

        staging = staging_dir(out)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / MARKER).write_text(
            json.dumps({"fingerprint": fingerprint, "final_loss": loss.item(), **params})
        )
        return publish_dir(staging, out)


def boxed_answer_matches(response: str, gold: str) -> bool:
    """Whether the last `\\boxed{}` of `response` equals `gold` (spaces, commas and `$` ignored)."""
    boxed = last_boxed(response)
    if boxed is None:
        return False

    def norm(s: str) -> str:
        return "".join(c for c in s if c not in " ,$")

    return norm(boxed) == norm(gold)


@torch.no_grad()
def completions(
    model_dir: str | Path,
    problems: list[Problem],
    instruction: str = DEFAULT_INSTRUCTION,
    max_new_tokens: int = 64,
    batch_size: int = 32,
    chat_template: bool = True,
    **sampling: Any,
) -> Iterator[tuple[Problem, list[int]]]:
    """Each problem with its transformers completion's token ids (through the first EOS), in
    batches; `sampling` goes to `generate` (do_sample, temperature, top_p; greedy by default)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    sampling.setdefault("do_sample", False)
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        prompts = [render_prompt(tokenizer, p, instruction, chat_template) for p in chunk]
        width = max(map(len, prompts))
        # Left padding keeps every prompt's last token at the same position for generate().
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in prompts])
        attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in prompts])
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            **sampling,
        )
        for problem, completion in zip(chunk, out[:, width:].tolist(), strict=True):
            yield problem, completion[: completion.index(eos) + 1 if eos in completion else None]


def greedy_accuracy(
    model_dir: str | Path,
    problems: list[Problem],
    instruction: str = DEFAULT_INSTRUCTION,
    max_new_tokens: int = 64,
    batch_size: int = 32,
    chat_template: bool = True,
) -> float:
    """Fraction of `problems` whose greedy transformers completion boxes the gold answer.

    The check used to report what SFT warm-up buys before RL starts (not the training reward,
    which goes through the verifiers).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    done = completions(model_dir, problems, instruction, max_new_tokens, batch_size, chat_template)
    correct = sum(
        boxed_answer_matches(tokenizer.decode(ids, skip_special_tokens=True), problem.answer)
        for problem, ids in done
    )
    return correct / len(problems)
