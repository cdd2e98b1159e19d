"""bench/gpu_check.py on a machine without CUDA: its CPU reference half runs and exits 0, a bf16
trainer step passes against that reference within the derived tolerances, and a wrong gradient,
log-prob or weight fails them; the nucleus section's cases pass on the CPU's sort and fail a
filter that keeps whole tied groups."""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("bench_gpu_check", ROOT / "bench" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = gpu_check
SPEC.loader.exec_module(gpu_check)  # puts bench/ on sys.path for its parts

from cuda_checks import nucleus_ties  # noqa: E402
from cuda_checks.models import SCALES, check_batch  # noqa: E402
from cuda_checks.report import Report, read_rows  # noqa: E402
from cuda_checks.sections import peak_bf16_flops, reference_path, section_nucleus  # noqa: E402
from cuda_checks.trainer_step import (  # noqa: E402
    LR,
    compare_runs,
    load_run,
    relative_tolerance,
    train_once,
    ulp,
)

from rlvr.models.tiny import VOCAB_SIZE as TINY_VOCAB  # noqa: E402


@pytest.fixture(scope="module")
def cpu_half(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    """The check as `make test` runs it where there is no GPU: the reference half, at the small
    scale (a 2-layer model in place of the 0.5B)."""
    base = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("OUT", None)
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--scale", "small"]
        + ["--work", str(base / "work"), "--out", str(base / "out")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done, base


def test_without_cuda_it_runs_the_reference_half_and_exits_0(cpu_half):
    done, base = cpu_half
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "the CPU reference half (no CUDA)" in done.stdout
    record = json.loads((base / "out" / "gpu_check.json").read_text())
    rows = {(r["section"], r["case"]): r["status"] for r in record["rows"]}
    expected = ["build models", "tiny full", "tiny LoRA", "large full", "large LoRA"]
    assert [rows[("reference", case)] for case in expected] == ["done"] * 5
    assert {section for section, _ in rows} == {"setup", "reference"}
    assert (base / "out" / "gpu_check.md").read_text().count("| reference |") == 5
    for model in ("tiny", "large"):
        for lora in (False, True):
            assert reference_path(base / "work", model, lora).is_file()


@pytest.fixture(scope="module")
def bf16_run(cpu_half):
    """A bf16 ZeRO-0 LoRA step of the tiny model on this process's device, and its reference."""
    _, base = cpu_half
    ref = load_run(reference_path(base / "work", "tiny", True))
    batch = check_batch(TINY_VOCAB)
    got = train_once(
        base / "work" / "tiny",
        batch,
        zero_stage=0,
        dtype="bfloat16",
        lora=True,
        old_logp=ref.logp,
        names=list(ref.grads),
    )
    return ref, got, batch


def test_a_bf16_step_passes_against_the_fp32_reference(bf16_run):
    ref, got, batch = bf16_run
    verdict = compare_runs(ref, got, batch, "bfloat16")
    assert verdict.passed, verdict.summary()
    # bf16 really differs from the fp32 reference, and AdamW moved every adapter B weight
    assert verdict.ratios["logp"] > 0 and verdict.ratios["grads"] > 0
    moved = [(got.after[n] - got.before[n]).abs().max() for n in got.grads if "lora_B" in n]
    assert moved and all(m > LR / 2 for m in moved)


def test_a_wrong_gradient_log_prob_or_weight_fails(bf16_run):
    ref, got, batch = bf16_run
    name = next(n for n in got.grads if "lora_B" in n)
    flipped = copy.deepcopy(got)
    flipped.grads[name] = -flipped.grads[name]
    assert compare_runs(ref, flipped, batch, "bfloat16").ratios["grads"] > 1
    shifted = copy.deepcopy(got)
    shifted.logp = shifted.logp + 0.5 * batch.response_mask
    assert compare_runs(ref, shifted, batch, "bfloat16").ratios["logp"] > 1
    # one adapter weight a full AdamW step off (lr) where the gradients agree in sign
    stepped = copy.deepcopy(got)
    agree = torch.sign(got.grads[name]) == torch.sign(ref.grads[name])
    stepped.after[name].view(-1)[int(agree.view(-1).nonzero()[0])] += LR
    verdict = compare_runs(ref, stepped, batch, "bfloat16")
    assert verdict.weights_over == 1 and not verdict.passed


def test_tolerances_follow_their_derivation():
    tiny = {"layers": 2, "hidden": 256, "intermediate": 512, "vocab": 1024, "tokens": 150}
    stages = 2 * (6 * 2 + 1)
    # K u sqrt(S n) with n the widest reduction (the vocabulary here), K u_bf16 sqrt(S) in bf16
    assert relative_tolerance("float32", tiny) == pytest.approx(
        4 * 2**-24 * math.sqrt(stages * 1024)
    )
    assert relative_tolerance("bfloat16", tiny) == pytest.approx(4 * 2**-9 * math.sqrt(stages))
    x = torch.tensor([1.0, 1.5, -0.02], dtype=torch.float64)
    assert ulp(x, torch.bfloat16).tolist() == [2**-7, 2**-7, 2**-6 * 2**-7]
    assert ulp(x, torch.float32).tolist() == [2**-23, 2**-23, 2**-6 * 2**-23]


def test_peak_flops_by_device_name():
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops("NVIDIA L4") == 121e12
    assert peak_bf16_flops("an unknown device") is None


def test_carried_wheels_are_installed_here(tmp_path):
    """Everything the check carries is installed in the project's environment, so an empty
    wheel folder installs nothing and misses nothing."""
    row = gpu_check.install_carried_wheels(tmp_path)
    assert (row.status, row.result) == ("PASS", "installed nothing")


CPU = torch.device("cpu")


def test_the_nucleus_replay_keeps_what_the_sort_rule_keeps_ties_included():
    status, result, data = nucleus_ties.sort_rule_case(CPU, vocab=1024, rows=32)
    assert status == "PASS", result
    numbers = data["top_p"].values()
    # the bf16 logits put the boundary inside a tied group in some rows at every top-p
    assert all(n["rows_cut_in_ties"] > 0 for n in numbers)
    assert all(n["rows_differ"] == 0 and n["dropped_not_flagged"] == 0 for n in numbers)


def test_a_filter_keeping_whole_tied_groups_fails_the_comparison():
    """A pivot rule that keeps every token tied with the sort's lowest kept one: it differs from
    the replay exactly in the rows whose boundary cuts a tied group."""

    def whole_groups(logits: torch.Tensor, top_p: float) -> torch.Tensor:
        kept = torch.isfinite(nucleus_ties.top_p_filter(logits, top_p))
        floor = logits.masked_fill(~kept, float("inf")).min(dim=-1, keepdim=True).values
        return logits.masked_fill(logits < floor, float("-inf"))

    def load(device: torch.device):
        return (lambda logits, k, p: whole_groups(logits, float(p[0]))), "pivot"

    status, result, data = nucleus_ties.vllm_case(CPU, vocab=1024, rows=32, load=load)
    assert status == "FAIL", result
    for n in data["top_p"].values():
        assert n["rows_differ"] == n["rows_cut_in_ties"] > 0


def test_the_nucleus_section_writes_its_rows(tmp_path, monkeypatch):
    """The section in the check's framework on the CPU: vLLM's case SKIPs where vllm does not
    import (importing it here would take longer than the section), the CPU comparison has
    nothing to compare."""

    def no_vllm(device: torch.device):
        raise ImportError("No module named 'vllm'")

    monkeypatch.setattr(nucleus_ties, "_load_vllm", no_vllm)
    monkeypatch.setattr(nucleus_ties, "ROWS", 16)
    rows_file = tmp_path / "nucleus.rows.jsonl"
    section_nucleus(Report(rows_file, math.inf), tmp_path, SCALES["small"])
    rows = {r.case: r for r in read_rows(rows_file)}
    assert [r.status for r in rows.values()] == ["PASS", "SKIP", "SKIP"]
    assert "No module named 'vllm'" in rows["replay = vLLM's filter"].result
