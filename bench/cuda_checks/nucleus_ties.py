"""The trainer's replay of the engine's top-p nucleus (`rlvr.algorithms.nucleus`) on the check's
device, on bf16 logits full of ties, whose boundary often cuts a tied group.

Covered: `nucleus_mask` / `nucleus_log_mass` against `top_p_filter`, the calls of vLLM's PyTorch
sort-based filter (`apply_top_k_top_p_pytorch`), on the same CUDA device (which tokens of a tied
group it keeps depends on the device's sort); and the replay on CUDA against the replay on the
CPU (an engine on the CPU beside a trainer on the GPU). Not covered without vLLM on the machine:
vLLM's CUDA sampler draws with FlashInfer (`forward_cuda`, rejection sampling with no mask to
compare) where FlashInfer supports the GPU, else filters with its Triton pivot search
(`apply_top_k_top_p_triton`) where Triton is installed, and runs the sort replayed here only with
neither. Where vllm imports, `apply_top_k_top_p` (whichever it dispatches to) is compared too.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from cuda_checks.report import DONE, FAIL, PASS, SKIP, CaseOutcome
from rlvr.algorithms.nucleus import nucleus_log_mass, nucleus_mask, top_p_filter

TOP_PS = (0.5, 0.9, 0.95, 0.99)
ROWS = 128
"""Rows of logits each case compares (when not given)."""
TEMPERATURE = 0.9
MASS_TOL = 1e-6
"""|log mass| difference allowed between the replay and the sort rule's kept mass: the same
float32 softmax summed by the same call, so 0 when the kept sets agree (a few ulps of margin)."""

TopPFilter = Callable[[torch.Tensor, float], torch.Tensor]
"""(logits [N, vocab], top_p) -> the logits with every token outside the nucleus at -inf."""


def tied_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """bf16 logits as an engine's model computes them, at row scales from peaked to flat, made
    float32 and divided by the temperature as vLLM's sampler does (CPU, ``[rows, vocab]``)."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(rows, 1, generator=gen) * 4.0 + 0.5
    logits = (torch.randn(rows, vocab, generator=gen) * scale).to(torch.bfloat16)
    return logits.float().div_(TEMPERATURE)


def straddling_rows(logits: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: the row's smallest kept logit ties its largest dropped one (the boundary
    cuts a tied group: only the sort's order of the ties decides which stay)."""
    lowest_kept = logits.masked_fill(~kept, float("inf")).min(dim=-1).values
    highest_dropped = logits.masked_fill(kept, float("-inf")).max(dim=-1).values
    return lowest_kept == highest_dropped


def compare_with(logits: torch.Tensor, reference: TopPFilter) -> tuple[bool, str, dict]:
    """The replay against ``reference`` on ``logits``' device at every `TOP_PS`: the same kept
    set in every row, a target drawn inside it never flagged outside, a target it drops always
    flagged, and the nucleus log mass of the kept set. (all agree, result text, numbers)."""
    numbers: dict[str, dict] = {}
    gen = torch.Generator(device=logits.device).manual_seed(0)
    for top_p in TOP_PS:
        kept = nucleus_mask(logits, top_p)
        ref = torch.isfinite(reference(logits.clone(), top_p))
        inside = ref.float().multinomial(1, generator=gen)[:, 0]
        dropped = logits.masked_fill(ref, float("inf")).argmin(dim=-1)
        has_dropped = ~ref.all(dim=-1)
        log_mass, out_inside = nucleus_log_mass(logits, inside, top_p)
        _, out_dropped = nucleus_log_mass(logits, dropped, top_p)
        want = logits.softmax(dim=-1).masked_fill(~ref, 0.0).sum(dim=-1).log()
        numbers[str(top_p)] = {
            "rows_differ": int((kept != ref).any(dim=-1).sum()),
            "tokens_differ": int((kept != ref).sum()),
            "rows_cut_in_ties": int(straddling_rows(logits, kept).sum()),
            "inside_flagged_outside": int(out_inside.sum()),
            "dropped_not_flagged": int((has_dropped & ~out_dropped).sum()),
            "max_abs_log_mass_diff": float((log_mass - want).abs().max()),
        }
    agree = all(
        n["rows_differ"] == n["inside_flagged_outside"] == n["dropped_not_flagged"] == 0
        and n["max_abs_log_mass_diff"] <= MASS_TOL
        for n in numbers.values()
    )
    cut = sum(n["rows_cut_in_ties"] for n in numbers.values())
    differ = sum(n["rows_differ"] for n in numbers.values())
    flags = sum(n["inside_flagged_outside"] + n["dropped_not_flagged"] for n in numbers.values())
    mass = max(n["max_abs_log_mass_diff"] for n in numbers.values())
    rows, vocab = logits.shape
    text = (
        f"{rows} rows x {vocab} at top-p {'/'.join(map(str, TOP_PS))}: {cut} boundaries cut a "
        f"tied group · {differ} rows keep other tokens · {flags} wrong outside flags · "
        f"max |log mass diff| {mass:.2g}"
    )
    return agree, text, numbers


def sort_rule_case(device: torch.device, vocab: int, rows: int | None = None) -> CaseOutcome:
    """The replay against the sort-based rule it replays, both on ``device``, and their times."""
    logits = tied_logits(rows or ROWS, vocab).to(device)
    agree, text, numbers = compare_with(logits, top_p_filter)
    times = {}
    for name, fn in (("nucleus_mask", nucleus_mask), ("sort rule", top_p_filter)):
        fn(logits, 0.95)  # warm-up (CUDA: kernels load)
        _sync(device)
        start = time.perf_counter()
        fn(logits, 0.95)
        _sync(device)
        times[name] = time.perf_counter() - start
    text += " · " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items())
    return PASS if agree else FAIL, text, {"top_p": numbers, "seconds_at_0.95": times}


def cpu_case(device: torch.device, vocab: int, rows: int | None = None) -> CaseOutcome:
    """The replay on ``device`` against the replay on the CPU: informational, since the CPU's
    sort may order a tied group otherwise (an engine on the CPU keeps the CPU's choice)."""
    if device.type == "cpu":
        return SKIP, "the check runs on the CPU: nothing to compare", {}
    logits = tied_logits(rows or ROWS, vocab)
    numbers = {}
    for top_p in TOP_PS:
        on_device = nucleus_mask(logits.to(device), top_p).cpu()
        on_cpu = nucleus_mask(logits, top_p)
        mass_device, _ = nucleus_log_mass(
            logits.to(device), logits.argmax(dim=-1).to(device), top_p
        )
        mass_cpu, _ = nucleus_log_mass(logits, logits.argmax(dim=-1), top_p)
        numbers[str(top_p)] = {
            "rows_differ": int((on_device != on_cpu).any(dim=-1).sum()),
            "rows_cut_in_ties": int(straddling_rows(logits, on_cpu).sum()),
            "max_abs_log_mass_diff": float((mass_device.cpu() - mass_cpu).abs().max()),
        }
    differ = sum(n["rows_differ"] for n in numbers.values())
    cut = sum(n["rows_cut_in_ties"] for n in numbers.values())
    mass = max(n["max_abs_log_mass_diff"] for n in numbers.values())
    text = (
        f"{differ} of {cut} boundaries in a tied group keep other tokens than on the CPU · "
        f"max |log mass diff| {mass:.2g}"
    )
    return DONE, text, {"top_p": numbers}


def vllm_case(
    device: torch.device,
    vocab: int,
    rows: int | None = None,
    load: Callable[[], Callable] | None = None,
) -> CaseOutcome:
    """The replay against vLLM's own `apply_top_k_top_p` on ``device``, where vllm imports
    (``load``: how to get it, for tests); SKIP with the reason otherwise."""
    try:
        apply_top_k_top_p, path = (load or _load_vllm)(device)
    except ImportError as err:
        return SKIP, f"vllm does not import here ({err}): its CUDA paths are not compared", {}

    def reference(logits: torch.Tensor, top_p: float) -> torch.Tensor:
        return apply_top_k_top_p(logits, None, torch.full((len(logits),), top_p, device=device))

    agree, text, numbers = compare_with(tied_logits(rows or ROWS, vocab).to(device), reference)
    return PASS if agree else FAIL, f"{path}: {text}", {"top_p": numbers, "path": path}


def _load_vllm(device: torch.device) -> tuple[Callable, str]:
    """vLLM's top-k/top-p filter and which path it takes on ``device``; ImportError without vllm."""
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    triton = HAS_TRITON and device.type == "cuda"
    return apply_top_k_top_p, "Triton pivot search" if triton else "PyTorch sort"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
