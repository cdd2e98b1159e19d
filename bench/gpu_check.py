"""The CUDA paths checked in one call on one GPU, in under 8 minutes, as one table.

    python bench/gpu_check.py                      # from the repository root, on the GPU machine

It needs torch, transformers, peft and accelerate; what else it imports (DeepSpeed and its
requirements, pydantic for `rlvr.config`, pytest for the `gpu` tests) it installs, when missing
or older, from the wheels in ``wheels/`` (``--wheels``) with ``pip install --no-index --no-deps``
before anything else runs (carry that ignored folder with the repository). Fetch them once where
PyPI is reachable, at the versions of .venv:

    make gpu-wheels          # = .venv/bin/python bench/gpu_check.py --download-wheels wheels

which runs `pip wheel --no-deps --no-build-isolation -w wheels deepspeed==<.venv's>` (PyPI has
only its source; DS_BUILD_OPS=0, so the wheel holds no compiled op), `pip download --no-deps -d
wheels` for the pure-Python ones and, for CPython 3.11-3.13 on manylinux x86_64, `pip download
--no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 --python-version 3.X` for the
compiled ones. With DeepSpeed 0.19.8: deepspeed 2.1 MB, pydantic-core 2.2 MB x 3, pygments
1.2 MB, msgpack 0.5 MB x 3, pydantic 0.5 MB, pytest 0.4 MB, ninja 0.2 MB, packaging 0.1 MB,
einops, hjson, typing-extensions, pluggy, py-cpuinfo, annotated-types, typing-inspection,
iniconfig (< 0.1 MB each): 12.5 MB. Neither Ray nor vLLM is imported (too large to carry); a
`gpu` test file that needs one is left out with its reason.

Sections, each in a process of its own (a crash, a hang or a CUDA error in one is its FAIL row,
and the others still run), stopped from starting past ``--budget`` seconds (default 450) and
killed past ``--limit`` (default 540):
  reference      on the CPU, fp32, ZeRO 0: the tiny model and a randomly initialised Qwen2 of
                 about 0.5B parameters (hidden 1024, 24 layers, 16 heads, 4 KV heads, MLP 5120,
                 vocabulary 49,152, tied head: 0.49B) built here, full fine-tune and LoRA: one
                 PolicyTrainer step's log-probs, loss, entropy, grad norm, gradients and weights.
  nucleus        the trainer's top-p replay (`nucleus_mask`, `nucleus_log_mass`) on 128 rows of
                 bf16 logits full of ties at the 0.5B's vocabulary, top-p 0.5 to 0.99: on CUDA
                 against torch's CUDA sort-based filter (the calls of vLLM's PyTorch fallback):
                 the same kept tokens in every row, cut tied groups included, outside flags
                 and log mass; the replay on CUDA against the CPU's (rows whose tied group is
                 cut otherwise, informational); and vLLM's own `apply_top_k_top_p` (its Triton
                 pivot search on CUDA) only where vllm imports, else SKIP. vLLM's FlashInfer
                 sampler draws without a mask and is not compared (`cuda_checks.nucleus_ties`).
  trainer-tiny,  PolicyTrainer's CUDA path, ZeRO 0 and 2, fp32 and bf16, full and LoRA, against
  trainer-0.5b   the reference (the 0.5B compares its first, last and non-layer tensors).
  lm-head        the LM head at loss tokens only (`FusedHeadLogprob`) and shared-prefix packing
                 against the plain forward through full logits, on the 0.5B in bf16: values,
                 gradients, time and peak memory.
  ipc            the colocated hand-over (`weight_sync.share_buffer`): a trained 0.5B rank's
                 export, 256 MiB bf16 buckets, by CUDA IPC to a second process on the same GPU:
                 bytes, time, and every tensor's SHA-256 on both sides.
  throughput     one 0.5B bf16 ZeRO-0 train step of 32 x 1024 tokens at micro-batch token
                 budgets 4096, 8192, 16384 (and 16384 with the head at loss tokens): tokens/s,
                 MFU and peak memory.
  gpu-tests      `pytest -m gpu` on the test files that carry the marker.
Without CUDA it says so and runs the reference alone (what `make test` checks, at ``--scale
small``: the same code on a 2-layer model). ``--all-on-cpu`` runs every section on the CPU, to
try the script itself before a GPU call. The table and a JSON of every number go to $OUT if set,
else bench/out/gpu_check/; each section's log to logs/ beside them. Exit 1 if any row FAILs.

Tolerances are derived, not tuned. With unit roundoff u (fp32: 2^-24, or 2^-11 where fp32
matmuls run as TF32; bf16: 2^-9) a reduction of n terms rounds to about sqrt(n) u relative (a
random walk of rounding errors), and S such reductions chained through the model (6 per layer
and the head, forward and backward) add in quadrature: two correct fp32 implementations agree
to K u sqrt(S n) with n the widest reduction (hidden, MLP, vocabulary or tokens). In bf16 every
operand and output is rounded (u per stage, whatever n, accumulation being fp32), so bf16
against the fp32 reference agrees to K u_bf16 sqrt(S). K = 4 (four standard deviations). From
that relative error rel and the reference's largest |logit| Z: a log-prob moves by at most
2 rel Z, the loss by max|A| (e^(2 rel Z) - 1) (it is the ratio exp(logp - logp_ref) times A),
the entropy by 2 rel Z^2, the grad norm by rel, and each gradient tensor's RMS error by rel times
the larger of its RMS and the model's (a gradient that is zero in exact arithmetic, as a key
bias's, is rounding noise of its neighbours' size). Weights: AdamW's first step is
w - lr g / (|g| + eps), so each updated weight must lie within |w0_dev - w0_ref| (bf16 rounding
of the start) + lr |f(g_dev) - f(g_ref)| (f(g) = g / (|g| + eps), from both captured gradients:
a gradient near 0 may change sign) + one ulp of its dtype + fp32 arithmetic of the reference's.
Gradient clipping is off there, so that first step is exactly that formula.
MFU is model FLOPs per second over the device's dense bf16 peak (`PEAK_BF16_TFLOPS`), model
FLOPs per token 6 N + 12 L h T (PaLM, appendix B; N parameters, L layers, h hidden, T sequence
length), whatever the step skipped (the head at loss tokens only).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for folder in (ROOT, ROOT / "bench"):  # the GPU machine runs the repository as it is, uninstalled
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from cuda_checks.models import SCALES  # noqa: E402
from cuda_checks.report import DONE, FAIL, PASS, SKIPPED_TIME, Row, markdown_table, read_rows  # noqa: E402
from cuda_checks.sections import CPU_SECTIONS, SECTIONS, run_section  # noqa: E402

OUT = ROOT / "bench" / "out" / "gpu_check"

CARRIED = (
    ("deepspeed", "deepspeed"),
    ("hjson", "hjson"),
    ("cpuinfo", "py-cpuinfo"),
    ("msgpack", "msgpack"),
    ("ninja", "ninja"),
    ("einops", "einops"),
    ("typing_extensions", "typing-extensions"),
    ("pydantic_core", "pydantic-core"),
    ("pydantic", "pydantic"),
    ("annotated_types", "annotated-types"),
    ("typing_inspection", "typing-inspection"),
    ("packaging", "packaging"),
    ("pluggy", "pluggy"),
    ("iniconfig", "iniconfig"),
    ("pygments", "pygments"),
    ("pytest", "pytest"),
)
"""(module, distribution) the checks import beyond torch, transformers, peft and accelerate
(whose numpy, psutil and tqdm DeepSpeed also needs): DeepSpeed's requirements, pydantic
(`rlvr.config`), pytest (the `gpu` tests)."""
COMPILED = ("pydantic-core", "msgpack", "ninja")
"""Carried distributions whose wheels are per CPython version and platform."""
CARRIED_PYTHONS = ("3.11", "3.12", "3.13")
"""(pytest on 3.10 would also need exceptiongroup and tomli.)"""


# ---------------------------------------------------------------------------- carried wheels


def _wheel_versions(wheels: Path) -> dict[str, str]:
    """Distribution (normalised) -> version of the wheels in ``wheels``."""
    found = {}
    for path in wheels.glob("*.whl"):
        name, version = path.name.split("-")[:2]
        found[_normalise(name)] = version
    return found


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def install_carried_wheels(wheels: Path) -> Row:
    """Install, from ``wheels`` alone and without dependencies, each carried distribution that
    is missing or older than its wheel; a row says what was installed or what is missing."""
    from packaging.version import Version

    start = time.perf_counter()
    available = _wheel_versions(wheels) if wheels.is_dir() else {}
    wanted, missing = [], []
    for _, dist in CARRIED:
        have, carried = _installed(dist), available.get(_normalise(dist))
        if carried is not None and (have is None or Version(have) < Version(carried)):
            wanted.append(f"{dist}=={carried}")
        elif have is None:
            missing.append(dist)
    if wanted:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
            + ["--find-links", str(wheels), *wanted],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            return Row(
                "setup", "carried wheels", FAIL, done.stderr[-500:], time.perf_counter() - start
            )
    importlib.invalidate_caches()
    status = FAIL if missing else PASS
    result = f"installed {', '.join(wanted) or 'nothing'}"
    if missing:
        result += f"; missing with no wheel in {wheels}: {', '.join(missing)} (make gpu-wheels)"
    return Row("setup", "carried wheels", status, result, time.perf_counter() - start)


def download_wheels(dest: Path) -> None:
    """Fetch every carried wheel at this environment's versions into ``dest`` (needs PyPI)."""
    dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    pins = {dist: _installed(dist) for _, dist in CARRIED}
    absent = [dist for dist, version in pins.items() if version is None]
    if absent:
        raise SystemExit(f"not installed here, so no version to carry: {', '.join(absent)}")
    commands = [
        pip
        + ["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dest)]
        + [f"deepspeed=={pins['deepspeed']}"]
    ]
    pure = [f"{d}=={v}" for d, v in pins.items() if d not in (*COMPILED, "deepspeed")]
    commands.append(pip + ["download", "-q", "--no-deps", "-d", str(dest), *pure])
    platforms = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64"]
    for python in CARRIED_PYTHONS:
        compiled = [f"{d}=={pins[d]}" for d in COMPILED]
        commands.append(
            pip
            + ["download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
            + [arg for p in platforms for arg in ("--platform", p)]
            + ["--python-version", python, *compiled]
        )
    for command in commands:
        print("$", "python", " ".join(command[1:]), flush=True)
        subprocess.run(command, check=True, env={**os.environ, "DS_BUILD_OPS": "0"})
    total = 0
    for path in sorted(dest.glob("*.whl")):
        total += path.stat().st_size
        print(f"{path.stat().st_size / 2**20:7.2f} MiB  {path.name}")
    print(f"{total / 2**20:7.2f} MiB  in all")


def environment_row(on_gpu: bool, all_on_cpu: bool) -> Row:
    """Versions, the device and the fp32 matmul precision (the fp32 tolerances assume no TF32)."""
    import torch

    parts = [f"Python {sys.version.split()[0]}", f"torch {torch.__version__}"]
    for dist in ("transformers", "peft", "deepspeed"):
        parts.append(f"{dist} {_installed(dist) or 'missing'}")
    if on_gpu:
        parts.append(f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})")
        parts.append(f"fp32 matmul precision {torch.get_float32_matmul_precision()}")
    elif all_on_cpu:
        parts.append("every section on the CPU (--all-on-cpu)")
    else:
        parts.append("no CUDA device: the CPU reference half only")
    return Row("setup", "environment", DONE, " · ".join(parts))


def run_check(args: argparse.Namespace) -> int:
    """Install what is missing, run the sections one process each within the time budget,
    print and write the table; 1 if any row failed."""
    import torch

    start = time.time()
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = [install_carried_wheels(args.wheels)]
    on_gpu = torch.cuda.is_available() and not args.all_on_cpu
    rows.append(environment_row(on_gpu, args.all_on_cpu))
    sections = SECTIONS if on_gpu or args.all_on_cpu else CPU_SECTIONS
    if args.sections:
        sections = [s for s in sections if s in args.sections]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    try:
        for section in sections:
            if time.time() - start > args.budget:
                rows.append(
                    Row(section, "(all)", SKIPPED_TIME, f"past the {args.budget:.0f} s budget")
                )
                continue
            rows += run_section_process(section, work, env, start, args, out)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    table = markdown_table(rows)
    title = "GPU check"
    if not on_gpu:
        title += (
            ", every section on the CPU"
            if args.all_on_cpu
            else ": the CPU reference half (no CUDA)"
        )
    elapsed = time.time() - start
    text = (
        f"# {title}\n\n{table}\n\n{time.strftime('%Y-%m-%d %H:%M:%S')}, {elapsed:.0f} s in all.\n"
    )
    print(text, flush=True)
    (out / "gpu_check.md").write_text(text)
    record = {"seconds": elapsed, "scale": args.scale, "rows": [asdict(r) for r in rows]}
    (out / "gpu_check.json").write_text(json.dumps(record, indent=1, default=str))
    return 1 if any(r.status == FAIL for r in rows) else 0


def run_section_process(
    section: str, work: Path, env: dict[str, str], start: float, args: argparse.Namespace, out: Path
) -> list[Row]:
    """One section in its own process, killed past ``--limit``; its rows, and a FAIL row if the
    process did not end well."""
    rows_file = work / f"{section}.rows.jsonl"
    rows_file.unlink(missing_ok=True)
    log = out / "logs" / f"{section}.log"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--section",
        section,
        "--work",
        str(work),
        "--rows",
        str(rows_file),
        "--deadline",
        str(start + args.budget),
        "--scale",
        args.scale,
    ]
    section_env = dict(env)
    if section in CPU_SECTIONS or args.all_on_cpu:
        section_env["CUDA_VISIBLE_DEVICES"] = ""  # DeepSpeed then picks its CPU accelerator
    began = time.perf_counter()
    problem = None
    with log.open("w") as sink:
        try:
            done = subprocess.run(
                command,
                cwd=ROOT,
                env=section_env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                timeout=max(1.0, start + args.limit - time.time()),
            )
            if done.returncode != 0:
                problem = f"exit {done.returncode}"
        except subprocess.TimeoutExpired:
            problem = f"killed at the {args.limit:.0f} s limit"
    rows = read_rows(rows_file)
    if problem or not rows:
        tail = log.read_text(errors="replace")[-600:].strip().replace("\n", " ⏎ ")
        rows.append(
            Row(
                section,
                "(process)",
                FAIL,
                f"{problem or 'no rows'}: {tail}",
                time.perf_counter() - began,
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--budget", type=float, default=450.0, help="seconds after which no section or case starts"
    )
    parser.add_argument(
        "--limit", type=float, default=540.0, help="seconds after which a running section is killed"
    )
    parser.add_argument(
        "--scale", choices=sorted(SCALES), default="0.5b", help="the large model (small: 2 layers)"
    )
    parser.add_argument(
        "--wheels", type=Path, default=ROOT / "wheels", help="carried wheels to install from"
    )
    parser.add_argument(
        "--out", type=Path, default=OUT, help="where the table goes when $OUT is unset"
    )
    parser.add_argument(
        "--work", default=None, help="models and references (default: a temporary folder)"
    )
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=None, help="only these")
    parser.add_argument("--all-on-cpu", action="store_true", help="every section, on the CPU")
    parser.add_argument(
        "--download-wheels",
        type=Path,
        default=None,
        metavar="DIR",
        help="fetch the carried wheels and exit",
    )
    parser.add_argument("--section", choices=SECTIONS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=math.inf, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.download_wheels:
        download_wheels(args.download_wheels)
        return
    if args.section:
        run_section(args.section, Path(args.work), args.rows, args.deadline, SCALES[args.scale])
        return
    sys.exit(run_check(args))


if __name__ == "__main__":
    main()
