"""Checks of a resolved model directory against the run that will use it, before any actor starts:
a HF directory, a context length it supports, head sizes vLLM's CPU kernels take, LoRA targets that
name some layer of it, a chat template that only appends where rollouts are multi-turn."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlvr.config.core import ConfigError
from rlvr.envs.chat import PROBE_SCHEMA, ChatRenderer, check_append_only

VLLM_CPU_HEAD_SIZES = (32, 64, 128)


def check_model_dir(model_dir: Path, max_model_len: int, vllm_on_cpu: bool) -> None:
    """The directory holds a HF config whose context fits `max_model_len`, and, where vLLM runs on
    CPU (`rlvr.config.vllm_on_cpu`), whose head size its CPU attention kernels accept (GPU kernels
    take others)."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"invalid config: model.path: {model_dir} holds no config.json (not a HF model directory)"
        )
    hf = json.loads(config_file.read_text())
    hf = hf.get("text_config") or hf  # a multimodal config nests its language model's
    head_dim = hf.get("head_dim")
    if head_dim is None and "hidden_size" in hf and "num_attention_heads" in hf:
        head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    if vllm_on_cpu and head_dim is not None and head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ConfigError(
            f"invalid config: model.path: head size {head_dim} is not supported by vLLM's CPU kernels "
            f"(supported: {VLLM_CPU_HEAD_SIZES}); use generation.backend=hf, GPUs for the engines "
            "or another model"
        )
    if max_model_len > hf.get("max_position_embeddings", max_model_len):
        raise ConfigError(
            f"invalid config: generation.max_model_len: {max_model_len} exceeds the model's "
            f"max_position_embeddings {hf['max_position_embeddings']}"
        )


def check_lora_targets(model_dir: Path, target_modules: Sequence[str]) -> None:
    """`model.lora.target_modules` must name some layer of the model (the defaults fit Qwen2 and
    Llama, not every architecture): PEFT would refuse only inside the PolicyActor."""
    from transformers import AutoConfig

    from rlvr.generation.hf_backend import hf_weight_names

    params, _ = hf_weight_names(AutoConfig.from_pretrained(model_dir))
    modules = {name.rsplit(".", 1)[0] for name in params}
    if not any(m == t or m.endswith(f".{t}") for m in modules for t in target_modules):
        leaves = sorted({m.rsplit(".", 1)[-1] for m in modules})
        raise ConfigError(
            f"invalid config: model.lora.target_modules: none of {list(target_modules)} is a "
            f"layer of {model_dir} (its layers: {', '.join(leaves)})"
        )


def check_multi_turn_template(tokenizer: Any, model_dir: Path, env_kind: str, parser: str) -> None:
    """Multi-turn rollouts (`env.kind` other than 'none') splice each turn's ids after the
    previous turns', so the model's chat template must only append (rlvr.envs.chat:
    `check_append_only`); a template that does not would fail every trajectory after its first
    turn, so it is refused here, naming the model and env.kind."""
    try:
        check_append_only(ChatRenderer(tokenizer, [PROBE_SCHEMA], parser))
    except ValueError as err:
        raise ConfigError(
            f"invalid config: model.path: the chat template of {model_dir} cannot run "
            f"multi-turn rollouts (env.kind={env_kind!r}): {err}"
        ) from None
