"""Model sources: the locally built tiny model, bundled SmolLM2, or any local HF directory."""

from __future__ import annotations

import os
from pathlib import Path

from rlvr.models.smollm2 import materialize_smollm2
from rlvr.models.tiny import TinyArch, build_tiny_model

TINY_MODELS: dict[str, TinyArch] = {"tiny": "qwen2", "tiny-llama": "llama"}
"""`model.path` names of the locally built tiny models, and their architectures."""
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def cache_dir() -> Path:
    """Root of built artefacts: $RLVR_CACHE or ~/.cache/rlvr (models go under `models/`)."""
    return Path(os.environ.get("RLVR_CACHE", Path.home() / ".cache" / "rlvr"))


def resolve_model_path(spec: str, seed: int = 0) -> Path:
    """The model directory a config's `model.path` names.

    'tiny' ('tiny-llama') builds (once) the tiny Qwen2 (Llama) model for `seed`, 'smollm2'
    materializes (once) the bundled SmolLM2; anything else must be an existing local Hugging Face
    model directory. Raises FileNotFoundError saying what is missing.
    """
    if spec in TINY_MODELS:
        out = cache_dir() / "models" / f"{spec}-seed{seed}"
        return build_tiny_model(out, seed=seed, arch=TINY_MODELS[spec])
    if spec == "smollm2":
        return materialize_smollm2(cache_dir() / "models" / "smollm2-135m-instruct")
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model path {spec!r} is neither 'tiny', 'tiny-llama', 'smollm2' nor an existing "
            "directory"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model path {spec!r} holds no config.json (not a Hugging Face model directory)"
        )
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise FileNotFoundError(
            f"model path {spec!r} holds no weights (expected one of {', '.join(WEIGHT_FILES)})"
        )
    return path


__all__ = [
    "TINY_MODELS",
    "build_tiny_model",
    "cache_dir",
    "materialize_smollm2",
    "resolve_model_path",
]
