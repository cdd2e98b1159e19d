"""Model sources: the locally built tiny model, bundled SmolLM2, or any local HF directory."""

from __future__ import annotations

import os
from pathlib import Path

from rlvr.models.smollm2 import materialize_smollm2
from rlvr.models.tiny import build_tiny_model


def cache_dir() -> Path:
    """Where built models live: $RLVR_CACHE or ~/.cache/rlvr."""
    return Path(os.environ.get("RLVR_CACHE", Path.home() / ".cache" / "rlvr"))


def resolve_model_path(spec: str, seed: int = 0) -> Path:
    """'tiny' -> built tiny model, 'smollm2' -> materialized SmolLM2, else an existing HF directory."""
    if spec == "tiny":
        return build_tiny_model(cache_dir() / "models" / f"tiny-seed{seed}", seed=seed)
    if spec == "smollm2":
        return materialize_smollm2(cache_dir() / "models" / "smollm2-135m-instruct")
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model path {spec!r} is neither 'tiny', 'smollm2' nor an existing directory"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model path {spec!r} holds no config.json (not a Hugging Face model directory)"
        )
    return path


__all__ = ["build_tiny_model", "cache_dir", "materialize_smollm2", "resolve_model_path"]
