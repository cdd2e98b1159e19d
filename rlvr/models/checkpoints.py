"""HF model directories as runs and servers handle them: a cheap content fingerprint (the policy
version CSA records), and PEFT LoRA adapters merged into base weights, streamed tensor by tensor
(a live weight swap) or written once as a cached model directory (a served checkpoint)."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlvr.models import cache_dir
from rlvr.models.tiny import publish_dir, staging_dir

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_EDGE = 1 << 20


def checkpoint_fingerprint(model_dir: str | Path) -> str:
    """Policy version of an HF model directory: its name plus a digest of config and weights.

    Reads config.json and the first and last MiB of every weight file (headers and some tensor
    bytes), so it is cheap for large models yet changes with any retrained checkpoint in practice.
    """
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    for f in sorted(model_dir.iterdir()):
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES):
            size = f.stat().st_size
            h.update(f"{f.name}\0{size}\0".encode())
            with f.open("rb") as fh:
                h.update(fh.read(_EDGE))
                fh.seek(max(0, size - _EDGE))
                h.update(fh.read(_EDGE))
    return f"{model_dir.name}@{h.hexdigest()[:12]}"


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights")
    return files


def merged_lora_weights(
    base_dir: str | Path, adapter_dir: str | Path
) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's weights (HF names, as saved) with a PEFT LoRA adapter merged in:
    W + s * B @ A per adapted linear layer, s = lora_alpha / r (/ sqrt(r) with rsLoRA), what
    `merge_and_unload` computes, read from the two directories without building a model."""
    base_dir, adapter_dir = Path(base_dir), Path(adapter_dir)
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapter_dir}: a {config['peft_type']} adapter, not LoRA")
    r = int(config["r"])
    scale = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
    lora: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(adapter_dir / ADAPTER_WEIGHTS, framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            module, _, part = key.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
            lora.setdefault(f"{module}.weight", {})[part.split(".")[0]] = f.get_tensor(key)
    files = _weight_files(base_dir)
    names: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt") as f:
            names.update(f.keys())
    missing = set(lora) - names
    if missing:
        raise ValueError(f"{adapter_dir}: adapted layers not in {base_dir}: {sorted(missing)[:3]}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                weight = f.get_tensor(name)
                ab = lora.get(name)
                if ab is not None:
                    delta = (ab["B"].double() @ ab["A"].double()) * scale
                    if config.get("fan_in_fan_out"):
                        delta = delta.T
                    weight = (weight.double() + delta).to(weight.dtype)
                yield name, weight


def merge_adapter(base_dir: Path, adapter_dir: Path) -> Path:
    """An HF directory with the PEFT adapter merged into the base weights (`merged_lora_weights`),
    built once and cached by the two directories' fingerprints."""
    key = hashlib.sha256(
        f"{checkpoint_fingerprint(base_dir)}\0{checkpoint_fingerprint(adapter_dir)}".encode()
    ).hexdigest()[:12]
    out = cache_dir() / "models" / f"merged-{base_dir.name}-{adapter_dir.name}-{key}"
    if (out / "config.json").is_file():
        return out
    staging = staging_dir(out)
    for f in base_dir.iterdir():
        if (
            f.is_file()
            and not f.name.endswith(_WEIGHT_SUFFIXES)
            and f.name != "model.safetensors.index.json"
        ):
            shutil.copy2(f, staging / f.name)
    weights = {name: t.contiguous() for name, t in merged_lora_weights(base_dir, adapter_dir)}
    save_file(weights, staging / "model.safetensors", metadata={"format": "pt"})
    return publish_dir(staging, out)


def with_adapter(model_dir: Path, adapter: str | None) -> Path:
    """`model_dir`, or a cached copy with the PEFT adapter directory `adapter` merged in."""
    if adapter is None:
        return model_dir
    adapter_dir = Path(adapter).expanduser()
    if not (adapter_dir / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(f"adapter {adapter!r} holds no adapter_config.json")
    return merge_adapter(model_dir, adapter_dir)
