"""Generation backends behind one interface (`base.GenerationBackend`), picked by name.

Backends are imported only when made: importing vLLM takes seconds and changes process-wide state.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from rlvr.generation.base import GenerationBackend

BACKENDS: dict[str, str] = {
    "vllm": "rlvr.generation.vllm_backend:VLLMBackend",
    "hf": "rlvr.generation.hf_backend:HFBackend",
}
"""Backend name (config key generation.backend) -> 'module:class'."""


def make_backend(name: str, model_path: str | Path, **kwargs: Any) -> GenerationBackend:
    """Start the backend registered as `name` on an HF-format model directory.

    kwargs go to the backend's constructor (e.g. dtype, max_model_len, kv_cache_gib for vLLM;
    dtype, device for hf).
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown generation backend {name!r}; choose from {sorted(BACKENDS)}")
    module_name, class_name = BACKENDS[name].split(":")
    backend_class = getattr(importlib.import_module(module_name), class_name)
    return backend_class(model_path, **kwargs)
