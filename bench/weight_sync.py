"""Weight sync after a step: Ray's object store vs the bucketed collective broadcast, 1 and 2 engines.

    .venv/bin/python bench/weight_sync.py --sizes 25m,100m,350m,1b --dtypes float32,bfloat16

Models are Llama-shaped with random weights (32k vocabulary, untied head, the tiny model's
tokenizer), written to a temporary directory. Per model and dtype one PolicyActor (ZeRO-0, LoRA r 8
on every projection; no optimizer step, which the export does not need) and two vLLM
GeneratorActors start once; then, with both engines and with engine 0 alone, the two transports
(`workflows.weight_sync`) push in turn, one untimed push each first, then `--repeats` timed
pushes each, medians reported. A point whose estimated peak exceeds the memory available at its
start is left out, and the table says so.

Per push: the total as the trainer sees it; export (policy: building the export, or packing the
buckets), load (the slowest engine's loader) and transport (object store: total - export - load;
collective: rank 0's time inside broadcasts, waiting for the engines included: the stages of the
collective overlap bucket by bucket, so they need not add up to the total); the peak RSS growth
of every actor over the push (VmHWM reset before it; object-store reads count, being mapped
shared memory). A least-squares fit of t = a + S / b over the points of one transport and engine
count gives a fixed cost a and an effective bandwidth b, S being the model's bytes in the
engines' dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from workflows.cluster import quiet_driver, ray_env

ray_env()
quiet_driver()
ROOT = Path(__file__).resolve().parent.parent
VOCAB = 32000
HEAD_DIM = 64
SIZES = {
    # name: (hidden, layers, intermediate); multi-head attention with 64-wide heads
    "25m": (256, 8, 768),
    "100m": (512, 16, 1536),
    "350m": (1024, 20, 2816),
    "1b": (2048, 16, 5632),
}
# LoRA keeps the optimizer to the adapters (a full bf16 fine-tune's fp32 master copy would need
# ~19 bytes a parameter, more than this machine has beside two engines at 1B); the export merges
# them, as a LoRA run's does.
POLICY = {"zero_stage": 0, "lora": {"enabled": True, "r": 8, "alpha": 16}}
ENGINE = {"max_model_len": 128, "enforce_eager": True, "kv_cache_gib": 0.1}
TRANSPORTS = ("object_store", "collective")
CAVEAT = (
    "One CPU node: the collective is gloo over loopback TCP and the object store is shared "
    "memory. These figures say nothing about NCCL bandwidth between GPUs or across nodes; they "
    "compare host copies, serialisation and peak memory."
)
MEMORY_NOTE = (
    "Peak +MiB: the actor's VmHWM over the push less its RSS before it, so memory an earlier push "
    "freed and this one reuses does not count; the object store's own copy (shared memory of the "
    "raylet) shows only where an actor maps it."
)


def build_model(out: Path, size: str, tokenizer_dir: Path) -> int:
    """A random Llama of `size` in `out` (bf16 safetensors) with the tiny tokenizer; its params."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    hidden, layers, intermediate = SIZES[size]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // HEAD_DIM,
        num_key_value_heads=hidden // HEAD_DIM,
        head_dim=HEAD_DIM,
        max_position_embeddings=ENGINE["max_model_len"],
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def memory_need(size: str, dtype: str) -> float:
    """GiB a point may take at its peak: ~10 model copies (the policy's model, its export and the
    serialised object; each engine's model and the object it reads; the object store's copy)."""
    hidden, layers, intermediate = SIZES[size]
    params = 2 * VOCAB * hidden + layers * (4 * hidden**2 + 3 * hidden * intermediate)
    return 10 * params * (4 if dtype == "float32" else 2) / 2**30


def available_memory() -> float:
    """GiB the kernel could hand out now (MemAvailable): other work shares this machine."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def actor_classes() -> tuple[type, type]:
    """PolicyActor and GeneratorActor that also time their sync methods and report peak RSS."""
    from actors.generator import GeneratorActor
    from actors.policy import PolicyActor

    class Probe:
        last: dict[str, float] = {}

        def probe(self, reset: bool) -> dict[str, float]:
            """The last sync's stage times and this process's peak RSS growth since `reset`."""
            status = Path("/proc/self/status").read_text()
            kib = {
                k: int(v.split()[0])
                for k, v in (ln.split(":", 1) for ln in status.splitlines())
                if k in ("VmRSS", "VmHWM")
            }
            if reset:
                Path("/proc/self/clear_refs").write_text("5")
                self.base_kib = kib["VmRSS"]
                self.last = {}
                return {}
            return {**self.last, "peak_mib": max(0, kib["VmHWM"] - self.base_kib) / 1024}

    class TimedPolicy(Probe, PolicyActor):
        def export_weights(self) -> dict:
            start = time.perf_counter()
            weights = super().export_weights()
            self.last = {"export_s": time.perf_counter() - start}
            return weights

        def broadcast_weights(self, buckets: list) -> dict[str, float]:
            stats = super().broadcast_weights(buckets)
            self.last = {"export_s": stats["export_s"], "transport_s": stats["transport_s"]}
            return stats

    class TimedGenerator(Probe, GeneratorActor):
        def update_weights(self, named_tensors: dict) -> int:
            start = time.perf_counter()
            version = super().update_weights(named_tensors)
            self.last = {"load_s": time.perf_counter() - start}
            return version

        def receive_weights(self, buckets: list) -> dict[str, float]:
            stats = super().receive_weights(buckets)
            self.last = {"load_s": stats["load_s"]}
            return stats

    return TimedPolicy, TimedGenerator


class Members:
    """The `workers` (and weight version) a weight sync drives."""

    def __init__(self, workers: list) -> None:
        self.workers = workers
        self.weight_version = 0


def measure_model(
    model_dir: Path, dtype: str, repeats: int, bucket_mb: float, bar: tqdm
) -> list[dict[str, Any]]:
    """Rows of (engines, transport) medians for one model and dtype."""
    import ray
    import torch

    from workflows.weight_sync import CollectiveSync, ObjectStoreSync
    from workflows.workers import Worker

    policy_cls, generator_cls = actor_classes()
    policy = (
        ray.remote(policy_cls)
        .options(num_cpus=0.1)
        .remote(str(model_dir), threads=1, dtype=dtype, micro_batch_size=1, **POLICY)
    )
    engines = [
        ray.remote(generator_cls)
        .options(num_cpus=0.1)
        .remote("vllm", str(model_dir), threads=1, dtype=dtype, **ENGINE)
        for _ in range(2)
    ]
    handles = [policy, *engines]
    ray.get([h.ready.remote() for h in handles])
    rows = []
    try:
        # Both engines first: engine 1 then leaves at the version engine 0 also holds.
        for count in (2, 1):
            policy_members = Members([Worker(policy, "PolicyActor")])
            engine_members = Members(
                [Worker(h, f"GeneratorActor {i}") for i, h in enumerate(engines[:count])]
            )
            syncs = {
                "object_store": ObjectStoreSync(policy_members, engine_members),
                "collective": CollectiveSync(
                    policy_members, engine_members, getattr(torch, dtype), int(bucket_mb * 2**20)
                ),
            }
            members = [policy, *engines[:count]]
            samples: dict[str, list[dict[str, float]]] = {t: [] for t in TRANSPORTS}
            for repeat in range(repeats + 1):
                for transport in TRANSPORTS:
                    ray.get([m.probe.remote(True) for m in members])
                    start = time.perf_counter()
                    syncs[transport].push()
                    total = time.perf_counter() - start
                    probes = ray.get([m.probe.remote(False) for m in members])
                    if repeat:
                        samples[transport].append(_sample(transport, total, probes))
                    bar.update()
            syncs["collective"].close()
            nbytes = sum(b.nbytes for b in syncs["collective"].buckets)
            for transport, ss in samples.items():
                medians = {k: statistics.median(s[k] for s in ss) for k in ss[0]}
                rows.append({"engines": count, "transport": transport, "bytes": nbytes, **medians})
    finally:
        for h in handles:
            ray.kill(h, no_restart=True)
    return rows


def _sample(transport: str, total: float, probes: list[dict[str, float]]) -> dict[str, float]:
    policy, *engines = probes
    load = max(e["load_s"] for e in engines)
    transport_s = (
        policy["transport_s"] if transport == "collective" else total - policy["export_s"] - load
    )
    return {
        "total_s": total,
        "export_s": policy["export_s"],
        "transport_s": transport_s,
        "load_s": load,
        "policy_peak_mib": policy["peak_mib"],
        "engine_peak_mib": max(e["peak_mib"] for e in engines),
    }


def fit(rows: list[dict[str, Any]]) -> dict[tuple[str, int], tuple[float, float]]:
    """Per (transport, engines): least-squares (a seconds, b MiB/s) of total_s = a + bytes / b."""
    import numpy as np

    out = {}
    for transport in TRANSPORTS:
        for count in (1, 2):
            pts = [
                (r["bytes"], r["total_s"])
                for r in rows
                if r["transport"] == transport and r["engines"] == count
            ]
            if len(pts) < 2:
                continue
            x = np.array([[1.0, s / 2**20] for s, _ in pts])
            (a, slope), *_ = np.linalg.lstsq(x, np.array([t for _, t in pts]), rcond=None)
            out[transport, count] = (float(a), float(1 / slope) if slope > 0 else float("inf"))
    return out


def format_table(rows: list[dict[str, Any]], fits: dict, header: str) -> str:
    lines = [
        header,
        "",
        f"> {CAVEAT}",
        "",
        MEMORY_NOTE,
        "",
        "| model | params | dtype | MiB | engines | transport | total s | export s | transport s | load s | policy peak +MiB | engine peak +MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['params'] / 1e6:.0f}M | {r['dtype']} | {r['bytes'] / 2**20:.0f} | {r['engines']} | "
            f"{r['transport']} | {r['total_s']:.2f} | {r['export_s']:.2f} | {r['transport_s']:.2f} | {r['load_s']:.2f} | "
            f"{r['policy_peak_mib']:.0f} | {r['engine_peak_mib']:.0f} |"
        )
    lines += [
        "",
        "Fit of the total over model bytes S: t = a + S / b",
        "",
        "| transport | engines | a (s) | b (MiB/s) |",
        "|---|---|---|---|",
    ]
    for (transport, count), (a, b) in fits.items():
        lines.append(f"| {transport} | {count} | {a:.2f} | {b:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="25m,100m,350m", help=f"comma-separated, of {sorted(SIZES)}")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument(
        "--skip",
        action="append",
        default=[],
        help="SIZE:DTYPE points to leave out (e.g. 1b:float32)",
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="timed pushes per transport and engine count"
    )
    ap.add_argument("--bucket-mb", type=float, default=64.0, help="collective bucket size")
    ap.add_argument("--note", default="", help="a sentence for the table's header")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "weight_sync")
    args = ap.parse_args()
    import ray

    from actors.controller import NAMESPACE
    from rlvr.models.tiny import build_tiny_model

    points = [
        (s, d)
        for s in args.sizes.split(",")
        for d in args.dtypes.split(",")
        if f"{s}:{d}" not in args.skip
    ]
    ray.init(
        address="local",  # a cluster of its own, never one another process started
        num_cpus=os.cpu_count() or 2,
        namespace=NAMESPACE,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = build_tiny_model(Path(tmp) / "tiny")
        bar = tqdm(total=len(points) * 2 * 2 * (args.repeats + 1), desc="pushes")
        built: dict[str, int] = {}
        for size, dtype in points:
            need, free = memory_need(size, dtype), available_memory()
            if need > free:
                args.skip.append(f"{size}:{dtype} (needs ~{need:.0f} GiB, {free:.0f} available)")
                bar.update(2 * 2 * (args.repeats + 1))
                continue
            model_dir = Path(tmp) / size
            if size not in built:
                built[size] = build_model(model_dir, size, tokenizer_dir)
            for row in measure_model(model_dir, dtype, args.repeats, args.bucket_mb, bar):
                rows.append({"model": size, "params": built[size], "dtype": dtype, **row})
            write(rows, args, time.perf_counter() - start)  # a point at a time: a stop keeps them
        bar.close()
    write(rows, args, time.perf_counter() - start)
    ray.shutdown()
    print((args.out / "cpu.md").read_text())


def write(rows: list[dict[str, Any]], args: argparse.Namespace, seconds: float) -> None:
    header = (
        f"Weight sync, {os.cpu_count()} CPU cores shared with other work, bucket "
        f"{args.bucket_mb:g} MiB, medians of {args.repeats} pushes per row (transports "
        f"alternating), {seconds:.0f}s in all"
        + (f"; left out: {', '.join(args.skip)}" if args.skip else "")
        + (f". {args.note}" if args.note else "")
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu.md").write_text(format_table(rows, fit(rows), header) + "\n")
    (args.out / "cpu.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
