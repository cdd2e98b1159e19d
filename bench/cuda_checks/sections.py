"""The sections of the check, each run in a process of its own by `bench/gpu_check.py`: they
write their rows as they go and leave the device to the next. DeepSpeed (the trainer) is imported
where used: on a GPU machine it comes from the carried wheels, installed after this loads."""

from __future__ import annotations

import gc
import hashlib
import math
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from cuda_checks import ROOT
from cuda_checks.models import Scale, build_large_model, check_batch, group_batch
from cuda_checks.nucleus_ties import cpu_case, sort_rule_case, vllm_case
from cuda_checks.report import DONE, FAIL, PASS, CaseOutcome, Report
from cuda_checks.trainer_step import (
    LR,
    MICRO_BATCH,
    TRAINER_CASES,
    compare_runs,
    load_run,
    relative_tolerance,
    release,
    save_run,
    train_once,
)
from rlvr.models.tiny import VOCAB_SIZE as TINY_VOCAB
from rlvr.models.tiny import build_tiny_model
from rlvr.training.batch import token_entropy, token_logprobs
from rlvr.training.lm_head import loss_token_stats
from rlvr.training.weight_sync import (
    SharedBucketReceiver,
    local_device,
    pack,
    plan_buckets,
    share_buffer,
)

PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)
"""Dense bf16 tensor-core TFLOPS from NVIDIA's datasheets, by a substring of the device name
(first match; the H100 SXM is "H100 80GB HBM3")."""


def compute_device() -> torch.device:
    """The GPU where CUDA is, else the CPU (the reference, `--all-on-cpu`)."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def section_reference(report: Report, work: Path, scale: Scale) -> None:
    """Build both models and take the CPU fp32 reference of each, full and LoRA."""

    def models() -> CaseOutcome:
        build_tiny_model(work / "tiny", seed=0)
        build_large_model(work / "large", scale, work / "tiny")
        return (
            DONE,
            f"tiny and {scale.params / 1e6:,.1f}M parameters, fp32",
            {"params": scale.params},
        )

    report.case("reference", "build models", models)
    for model, vocab in (("tiny", TINY_VOCAB), ("large", scale.vocab)):
        for lora in (False, True):

            def reference(model: str = model, vocab: int = vocab, lora: bool = lora) -> CaseOutcome:
                batch = check_batch(vocab)
                run = train_once(work / model, batch, zero_stage=0, dtype="float32", lora=lora)
                save_run(run, reference_path(work, model, lora))
                result = (
                    f"loss {run.loss:.6f} · entropy {run.entropy:.4f} · grad norm "
                    f"{run.grad_norm:.4g} · largest logit {run.logit_scale:.3g} · "
                    f"{len(run.grads)} tensors kept"
                )
                return DONE, result, {"loss": run.loss, "grad_norm": run.grad_norm}

            report.case("reference", f"{model} {'LoRA' if lora else 'full'}", reference)


def reference_path(work: Path, model: str, lora: bool) -> Path:
    return work / f"reference-{model}-{'lora' if lora else 'full'}.pt"


def section_trainer(report: Report, work: Path, model: str, vocab: int) -> None:
    """Every `TRAINER_CASES` setting on this process's device against the reference."""
    section = "trainer-tiny" if model == "tiny" else "trainer-0.5b"
    batch = check_batch(vocab)
    for stage, dtype, lora in TRAINER_CASES:

        def case(stage: int = stage, dtype: str = dtype, lora: bool = lora) -> CaseOutcome:
            ref = load_run(reference_path(work, model, lora))
            got = train_once(
                work / model,
                batch,
                zero_stage=stage,
                dtype=dtype,
                lora=lora,
                old_logp=ref.logp,
                names=list(ref.grads),
            )
            verdict = compare_runs(ref, got, batch, dtype)
            return (
                PASS if verdict.passed else FAIL,
                verdict.summary(),
                {"ratios": verdict.ratios, **verdict.data},
            )

        name = (
            f"ZeRO {stage} {'fp32' if dtype == 'float32' else 'bf16'} {'LoRA' if lora else 'full'}"
        )
        report.case(section, name, case)


class DeviceClock:
    """Wall time and peak memory of a block on ``device`` (memory only on CUDA)."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self.sync()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        self.t0 = time.perf_counter()

    def stop(self) -> tuple[float, float | None]:
        """(seconds, peak GiB above what was allocated at `start`, None on CPU)."""
        self.sync()
        seconds = time.perf_counter() - self.t0
        if self.device.type != "cuda":
            return seconds, None
        return seconds, (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**30


def _gib(value: float | None) -> str:
    return "n/a (CPU)" if value is None else f"{value:.2f} GiB"


def section_lm_head(report: Report, work: Path, scale: Scale) -> None:
    """The plain forward through full logits, the head at loss tokens only and shared-prefix
    packing, on the large model in bf16: values and gradients against the plain path (each
    within the bf16 tolerance of exact, so within twice it of each other), time, peak memory."""

    device = compute_device()
    model = AutoModelForCausalLM.from_pretrained(work / "large", dtype=torch.bfloat16).to(device)
    batch = group_batch(
        scale.vocab, scale.groups, scale.group_size, scale.prompt_len, scale.response_len
    )
    mb = batch.to(device)
    mask = mb.response_mask
    weights = (mb.advantages[:, None] * mask) / mask.sum()
    config = {
        "layers": scale.layers,
        "hidden": scale.hidden,
        "intermediate": scale.intermediate,
        "vocab": scale.vocab,
        "tokens": int(batch.attention_mask.sum()),
    }
    rel = 2 * relative_tolerance("bfloat16", config)  # two bf16 paths, each within rel of exact
    with torch.no_grad():
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        z = float(logits[mb.attention_mask.bool()].abs().max())
        del logits
    clock = DeviceClock(device)

    def plain() -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False
        ).logits
        return token_logprobs(logits, mb.input_ids), token_entropy(logits)

    variants = {
        "plain (full logits)": plain,
        f"head at loss tokens ({scale.head_chunk}-token chunks)": lambda: loss_token_stats(
            model, mb, 1.0, scale.head_chunk
        )[:2],
        "shared prefix + head at loss tokens": lambda: loss_token_stats(
            model, mb, 1.0, scale.head_chunk, shared_prefix=True
        )[:2],
    }
    reference: dict[str, Any] = {}

    def step(
        stats: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        logp, entropy = stats()
        (logp * weights).sum().backward()
        return logp.detach(), entropy

    for name, stats in variants.items():

        def case(name: str = name, stats: Callable = stats) -> CaseOutcome:
            logp, entropy = step(stats)  # also the warm-up of the timed repeats
            grads = {n: p.grad for n, p in model.named_parameters()}
            times, peaks = [], []
            for _ in range(3):
                clock.start()
                step(stats)
                seconds, peak = clock.stop()
                times.append(seconds)
                peaks.append(peak)
            timing = {"seconds": statistics.median(times), "peak_gib": peaks[-1]}
            if not reference:
                reference.update(logp=logp, entropy=entropy, grads=grads, seconds=timing["seconds"])
                return DONE, f"{timing['seconds']:.3f} s fwd+bwd · peak {_gib(peaks[-1])}", timing
            ratios = {
                "logp": float((logp - reference["logp"])[mask].abs().max()) / (2 * rel * z),
                "entropy": float((entropy - reference["entropy"])[mask].abs().max())
                / (2 * rel * z * z),
            }
            model_rms = math.sqrt(
                sum(float(g.float().pow(2).sum()) for g in reference["grads"].values())
            )
            model_rms /= math.sqrt(sum(g.numel() for g in reference["grads"].values()))
            worst = max(
                float((grads[n].float() - g.float()).pow(2).mean().sqrt())
                / (rel * max(float(g.float().pow(2).mean().sqrt()), model_rms))
                for n, g in reference["grads"].items()
            )
            ratios["grads"] = worst
            speedup = reference["seconds"] / timing["seconds"]
            passed = all(r <= 1.0 for r in ratios.values())
            result = " · ".join(f"{k} {v:.2g}" for k, v in ratios.items())
            result += (
                f" · {timing['seconds']:.3f} s ({speedup:.2f}x plain) · peak {_gib(peaks[-1])}"
            )
            return (
                PASS if passed else FAIL,
                result,
                {"ratios": ratios, **timing, "relative_tolerance": rel},
            )

        report.case("lm-head", name, case)
        gc.collect()


def _engine_side(conn: Any, buckets: list[Any]) -> None:
    """The second process of `section_ipc`: take every bucket by hand-over, time it, then send
    back each tensor's SHA-256."""

    device = local_device()

    def fetch(bucket: Any) -> Any:
        conn.send("next")
        return conn.recv()

    start = time.perf_counter()
    with SharedBucketReceiver(buckets, fetch, device) as received:
        tensors = dict(received)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    conn.send(("done", seconds, received.transport_s, {n: _digest(t) for n, t in tensors.items()}))


def _digest(tensor: Any) -> str:
    """SHA-256 of a tensor's bytes."""
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).cpu().numpy()).hexdigest()


def section_ipc(report: Report, work: Path, scale: Scale) -> None:
    """A trained rank's export handed bucket by bucket to a second process on the same device,
    as a colocated engine takes it."""

    from rlvr.training.policy_trainer import PolicyTrainer

    def case() -> CaseOutcome:
        trainer = PolicyTrainer(
            work / "large",
            zero_stage=2,
            dtype="bfloat16",
            lr=LR,
            micro_batch_size=MICRO_BATCH,
            seed=0,
        )
        try:
            trainer.train_step(check_batch(scale.vocab))
            buckets = plan_buckets(trainer.export_manifest(), torch.bfloat16, scale.bucket_bytes)
            context = multiprocessing.get_context("spawn")
            ours, theirs = context.Pipe()
            engine = context.Process(target=_engine_side, args=(theirs, buckets))
            engine.start()
            stream = trainer.iter_export_weights()
            handed, ipc = 0, 0
            while (message := ours.recv()) == "next":
                buffer = pack(buckets[handed], stream, trainer.device)  # alive until the next ask
                shared = share_buffer(buffer)
                ipc += shared.tensor is None
                ours.send(shared)
                handed += 1
            engine.join(timeout=120)
            _, seconds, transport_s, received = message
            sent = {n: _digest(t.to(torch.bfloat16)) for n, t in trainer.iter_export_weights()}
        finally:
            release(trainer)
        nbytes = sum(b.nbytes for b in buckets)
        equal = sent == received
        by = (
            "CUDA IPC handles"
            if ipc == handed
            else f"{handed - ipc} of {handed} as tensors (no CUDA)"
        )
        result = (
            f"{nbytes / 2**30:.3f} GiB in {handed} buckets by {by} · {seconds:.3f} s "
            f"({nbytes / 2**30 / seconds:.1f} GiB/s; copy-out {transport_s:.3f} s) · "
            f"{len(received)} tensors, SHA-256 {'equal' if equal else 'DIFFERENT'}"
        )
        passed = equal and handed == len(buckets) and engine.exitcode == 0
        data = {
            "bytes": nbytes,
            "buckets": handed,
            "seconds": seconds,
            "transport_s": transport_s,
            "equal": equal,
        }
        return PASS if passed else FAIL, result, data

    size = (
        f"{scale.bucket_bytes >> 20} MiB"
        if scale.bucket_bytes >= 1 << 20
        else f"{scale.bucket_bytes >> 10} KiB"
    )
    report.case("ipc", f"export to a second process, {size} bf16 buckets", case)


def peak_bf16_flops(device_name: str) -> float | None:
    """The device's dense bf16 FLOPS from `PEAK_BF16_TFLOPS`, None for a device not in it."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops * 1e12
    return None


def section_throughput(report: Report, work: Path, scale: Scale) -> None:
    """Train steps of the large model in bf16 at ZeRO 0 (one rank) per micro-batch token budget:
    the median of 3 after one warm-up."""

    from rlvr.training.policy_trainer import PolicyTrainer

    device = compute_device()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = peak_bf16_flops(name)
    seq = scale.prompt_len + scale.response_len
    batch = group_batch(
        scale.vocab, scale.throughput_rows, 1, scale.prompt_len, scale.response_len, whole=True
    )
    tokens = int(batch.attention_mask.sum())
    flops_per_token = 6 * scale.params + 12 * scale.layers * scale.hidden * seq
    settings = [(budget, 0) for budget in scale.budgets] + [(scale.budgets[-1], scale.head_chunk)]
    for budget, chunk in settings:

        def case(budget: int = budget, chunk: int = chunk) -> CaseOutcome:
            trainer = PolicyTrainer(
                work / "large",
                zero_stage=0,
                dtype="bfloat16",
                lr=1e-6,
                micro_batch_tokens=budget,
                lm_head_chunk=chunk,
                seed=0,
            )
            try:
                trainer.train_step(batch)
                clock = DeviceClock(device)
                times, peaks = [], []
                for _ in range(3):
                    clock.start()
                    trainer.train_step(batch)
                    seconds, gib = clock.stop()
                    times.append(seconds)
                    peaks.append(gib)
            finally:
                release(trainer)
            seconds = statistics.median(times)
            rate = tokens / seconds
            mfu = None if peak is None else rate * flops_per_token / peak
            shown = "n/a (device not in PEAK_BF16_TFLOPS)" if mfu is None else f"{100 * mfu:.1f}%"
            result = (
                f"{tokens} tokens in {seconds:.3f} s · {rate:,.0f} tokens/s · MFU {shown} · "
                f"peak {_gib(max(peaks) if peaks[0] is not None else None)} above the trainer"
            )
            data = {
                "tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": rate,
                "mfu": mfu,
                "peak_gib": peaks,
                "device": name,
            }
            return DONE, result, data

        head = f", head at loss tokens ({chunk})" if chunk else ""
        report.case("throughput", f"budget {budget} tokens{head}", case)


def section_gpu_tests(report: Report, work: Path, scale: Scale) -> None:
    """`pytest -m gpu` on the files that use the marker; a file that cannot be collected for a
    missing module (Ray, vLLM) is left out, with its reason."""
    files = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if "mark.gpu" in p.read_text()
    )

    def pytest(*args: str) -> subprocess.CompletedProcess:
        import importlib.util

        if importlib.util.find_spec("pytest") is None:
            raise RuntimeError("pytest is not installed (carry its wheels: make gpu-wheels)")
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=max(10.0, report.deadline + 60 - time.time()),
        )

    def case() -> CaseOutcome:
        listed = pytest("--collect-only", "-q", "--continue-on-collection-errors", *files)
        left_out = {}
        for path in files:
            block = re.search(
                rf"ERROR collecting {re.escape(path)}.*?(?=\n_{{3,}}|\Z)", listed.stdout, re.S
            )
            if block:
                missing = re.search(r"No module named '([\w.]+)'", block.group(0))
                if missing is None:
                    raise RuntimeError(f"{path} does not collect:\n{block.group(0)[-800:]}")
                left_out[path] = missing.group(1)
        runnable = [f for f in files if f not in left_out]
        notes = [f"{f} left out: needs {m}, not installed" for f, m in left_out.items()]
        if not runnable:
            return DONE, "; ".join(["no runnable file", *notes]), {"left_out": left_out}
        done = pytest("-q", *runnable)
        print(done.stdout[-20000:], done.stderr[-5000:], sep="\n", flush=True)
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        summary = lines[-1].strip("= ") if lines else "(no output)"
        failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        status = PASS if done.returncode == 0 else FAIL
        result = "; ".join([f"{len(runnable)} files: {summary}", *failed, *notes])
        return status, result[:800], {"returncode": done.returncode, "left_out": left_out}

    report.case("gpu-tests", "pytest -m gpu", case)


def section_nucleus(report: Report, work: Path, scale: Scale) -> None:
    """The trainer's top-p replay on bf16 logits full of ties (`cuda_checks.nucleus_ties`), at
    the large model's vocabulary: against the sort rule on this device, the replay on the CPU,
    and vLLM's own filter where vllm imports."""
    device = compute_device()
    report.case("nucleus", "replay = sort rule", lambda: sort_rule_case(device, scale.vocab))
    report.case("nucleus", "replay vs the CPU's", lambda: cpu_case(device, scale.vocab))
    report.case("nucleus", "replay = vLLM's filter", lambda: vllm_case(device, scale.vocab))


SECTIONS: dict[str, Callable[[Report, Path, Scale], None]] = {
    "reference": section_reference,
    "nucleus": section_nucleus,
    "trainer-tiny": lambda report, work, scale: section_trainer(report, work, "tiny", TINY_VOCAB),
    "lm-head": section_lm_head,
    "ipc": section_ipc,
    "throughput": section_throughput,
    "trainer-0.5b": lambda report, work, scale: section_trainer(report, work, "large", scale.vocab),
    "gpu-tests": section_gpu_tests,
}
"""In running order: the reference first (every trainer row compares with it), the top-p
replay (seconds), then what has never run on a GPU, then the trainer on the 0.5B (slowest), then the tests that have."""
CPU_SECTIONS = ("reference",)
"""Sections that run on the CPU wherever the check runs (the reference is CPU fp32 by
definition); the others run where CUDA is."""


def run_section(name: str, work: Path, rows_file: Path, deadline: float, scale: Scale) -> None:
    """Run section ``name``, its rows into ``rows_file``, no case starting past ``deadline``."""
    SECTIONS[name](Report(rows_file, deadline), work, scale)
