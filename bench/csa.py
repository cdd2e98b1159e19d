"""CSA bench: every comparison method on the same synthetic streams, the controller's per-round
overhead, and the served tiny model's HTTP latency with and without the CSA gate (CSA,
arXiv:2605.20270: Sec. 6, App. B.3).

Part 1 runs our synthetic G0 cells (i.i.d., improving drift, and four cells that break the
nondecreasing-frontier assumption on purpose) and the paper's shift cells (Sec. 6.3), replayed
orderings of one fixed calibrated item set. Part 2 times decide + observe per round, bare and
durable (snapshot + fsync). Part 3 serves the SFT-warmed tiny model twice side by side, gated and
ungated, same K, and alternates requests between them.

    .venv/bin/python bench/csa.py                  # all parts, a few minutes on 2 CPU cores
    .venv/bin/python bench/csa.py --skip-http      # parts 1 and 2 only
Writes bench/out/csa/{results.md, results.json, <cell>.png}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from rlvr.algorithms.csa import Calibrator, CSABatch, CSAController, make_grid
from rlvr.algorithms.csa.baselines import BASELINES
from rlvr.algorithms.csa.simulation import (
    REPLAY_CELLS,
    SYNTHETIC_CELLS,
    logistic_fail_prob,
    replay_cell,
    run_method,
    summarise,
    synthetic_cell,
)
from workflows.cluster import ray_env

ray_env()
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "csa"
DELTA = 0.1
G0_ALPHA = 0.3  # alpha of the paper's App. G setting; the 50-point linear grid is our choice
G0_GRID = np.linspace(0.02, 0.98, 50)
REPLAY_ALPHAS = (0.1, 0.2)  # the paper's shift cells ran alpha in {.05, .1, .2}
# Cells whose frontier drops within a stream (outside Theorem C.1): every ordering of the item set
# but the shuffled one puts easier items first somewhere.
ASSUMPTION_KEPT = ("G0 iid", "G0 improving", "replay iid ")
METHODS = ("csa", "csa-epoch", *BASELINES)
LABELS = {"csa": "CSA", "csa-epoch": "CSA-Epoch(1000)"}


def make_method(name: str, n: int, alpha: float, grid: np.ndarray):
    """A method by name on n streams (CSA's grid is shared with the marginal e-process)."""
    if name == "csa":
        return CSABatch(n, alpha, DELTA, grid)
    if name == "csa-epoch":
        return CSABatch(n, alpha, DELTA, grid, epoch_length=1000)
    return BASELINES[name](n, alpha, DELTA, grid)


def method_label(name: str) -> str:
    return LABELS.get(name) or BASELINES[name](1, 0.5, DELTA, G0_GRID).name


def item_set(n_items: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed item set: raw scores U(0, 1) and one G0 verifier label per item."""
    rng = np.random.default_rng(seed)
    raw = rng.random(n_items)
    passed = rng.random(n_items) >= logistic_fail_prob(raw, 0.5)
    return raw, passed


def cells(n_streams: int, horizon: int, seed: int) -> dict[str, tuple]:
    """name -> (streams, alpha, CSA grid).

    G0 cells use the fixed linear grid. The replay cells follow the paper's shift protocol: an
    isotonic calibrator and the grid are fit on a 20% CAL split (seed 42) and the other 80% of the
    items, scored by the calibrator, are replayed in the cell's order.
    """
    out = {}
    for i, name in enumerate(SYNTHETIC_CELLS):
        streams = synthetic_cell(name, n_streams, horizon, seed + i)
        out[f"G0 {name}"] = (streams, G0_ALPHA, G0_GRID)
    raw, passed = item_set(1000, seed)
    cal = np.random.default_rng(42).permutation(raw.size)[: raw.size // 5]
    rest = np.setdiff1d(np.arange(raw.size), cal)
    g = Calibrator.fit(raw[cal], passed[cal])
    scores = g(raw)
    for i, name in enumerate(REPLAY_CELLS):
        streams = replay_cell(name, scores[rest], passed[rest], n_streams, horizon, seed + 100 + i)
        for alpha in REPLAY_ALPHAS:
            out[f"replay {name} a={alpha:g}"] = (streams, alpha, make_grid(scores[cal], alpha))
    return out


def run_cells(n_streams: int, horizon: int, seed: int) -> tuple[dict, dict]:
    """Every method on every cell: summaries and the traces the plots need."""
    results, traces = {}, {}
    for cell, (streams, alpha, grid) in cells(n_streams, horizon, seed).items():
        results[cell], traces[cell] = {"alpha": alpha}, {"alpha": alpha}
        for name in METHODS:
            run = run_method(make_method(name, n_streams, alpha, grid), streams)
            s = summarise(run.released, streams.passed, alpha, DELTA)
            results[cell][name] = {
                "risk": float(s["risk"].mean()),
                "release_rate": float(s["release_rate"].mean()),
                "pathv_strict": int(s["pathv_strict"].sum()),
                "pathv_slack": int(s["pathv_slack"].sum()),
                "refused": int(s["refused"].sum()),
            }
            fails = run.released & ~streams.passed
            n = np.cumsum(run.released, axis=1)
            running = np.cumsum(fails, axis=1) / np.maximum(n, 1)
            # Display: NaN = gate closed (0), inf = release everything (1).
            shown = np.nan_to_num(run.threshold, nan=0.0, posinf=1.0)
            traces[cell][name] = (running.mean(axis=0), shown.mean(axis=0))
        print(f"  {cell}: done", flush=True)
    return results, traces


def _mark(cell: str) -> str:
    kept = cell in ASSUMPTION_KEPT or cell.startswith(ASSUMPTION_KEPT[-1])
    return cell if kept else cell + " *"


def cell_table(cell: str, rows: dict, n_streams: int) -> str:
    lines = [
        f"**{_mark(cell)}** (alpha = {rows['alpha']:g})",
        "",
        "| method | mean risk | release rate | PathV strict | PathV slack | refused |",
        "|---|---|---|---|---|---|",
    ]
    for name in METHODS:
        r = rows[name]
        lines.append(
            f"| {method_label(name)} | {r['risk']:.3f} | {r['release_rate']:.3f} "
            f"| {r['pathv_strict']}/{n_streams} | {r['pathv_slack']}/{n_streams} "
            f"| {r['refused']}/{n_streams} |"
        )
    return "\n".join(lines)


def summary_table(results: dict, n_streams: int) -> str:
    """Per cell and method: PathV strict / with slack, and the mean release rate (Table 2/5 view)."""
    lines = [
        "| cell | " + " | ".join(method_label(n) for n in METHODS) + " |",
        "|---|" + "---|" * len(METHODS),
    ]
    for cell, rows in results.items():
        cols = []
        for name in METHODS:
            r = rows[name]
            refused = " ref" if r["refused"] == n_streams else ""
            cols.append(f"{r['pathv_strict']}/{r['pathv_slack']} {r['release_rate']:.2f}{refused}")
        lines.append(f"| {_mark(cell)} | " + " | ".join(cols) + " |")
    lines += [
        "",
        f"Entry: PathV strict (max running risk after 500 releases > alpha) / PathV with slack "
        f"(running risk ever > alpha + slack(N)), in streams of {n_streams}, then the mean release "
        "rate; 'ref' = refused on every stream. * = the cell's frontier drops within a stream, "
        "outside the guarantee (Theorem C.1 needs a nondecreasing frontier).",
    ]
    return "\n".join(lines)


def plot(traces: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for cell, by_method in traces.items():
        fig, (ax_r, ax_q) = plt.subplots(1, 2, figsize=(12, 4.2))
        for name in METHODS:
            risk, thr = by_method[name]
            style = {"linewidth": 1, "alpha": 0.8}
            if name == "csa":
                style = {"linewidth": 2.4, "color": "black"}
            elif name == "csa-epoch":
                style = {"linewidth": 2.0, "color": "dimgray", "linestyle": "--"}
            ax_r.plot(risk, label=method_label(name), **style)
            ax_q.plot(thr, label=method_label(name), **style)
        ax_r.axhline(by_method["alpha"], color="black", linestyle="--", linewidth=1)
        ax_r.set(title=f"{cell}: running selective risk (mean of streams)", xlabel="round")
        ax_r.set_ylim(0, 0.7)
        ax_q.set(title="deployed threshold (mean; closed = 0, all = 1)", xlabel="round")
        ax_q.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out / f"{cell.replace(' ', '_').replace('=', '')}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


# --------------------------------------------------------------------------- part 2: overhead


def overhead(rounds: int, durable_rounds: int, seed: int) -> dict[str, dict[str, float]]:
    """Median and p90 microseconds of decide + observe per round, one stream, labels in order."""
    from rlvr.serving.stream_host import CSAStreamHost, StreamSpec

    st = synthetic_cell("iid", 1, rounds, seed)
    scores, passed = st.scores[0].tolist(), st.passed[0].tolist()
    out = {}
    for m in (15, 50):
        ctrl = CSAController(G0_ALPHA, DELTA, np.linspace(0.02, 0.98, m))
        times = []
        for s, p in zip(scores, passed, strict=True):
            t0 = time.perf_counter_ns()
            d = ctrl.decide(s)
            ctrl.observe(d.seq, p)
            times.append(time.perf_counter_ns() - t0)
        out[f"controller m={m}"] = _stats_us(times)
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        host = CSAStreamHost(tmp)
        host.open_stream("bench", StreamSpec(G0_ALPHA, DELTA, tuple(np.linspace(0.02, 0.98, 15))))
        decide, observe = [], []
        for s, p in zip(scores[:durable_rounds], passed[:durable_rounds], strict=True):
            t0 = time.perf_counter_ns()
            d = host.decide("bench", s)
            t1 = time.perf_counter_ns()
            host.observe("bench", d["seq"], p)
            decide.append(t1 - t0)
            observe.append(time.perf_counter_ns() - t1)
        host.close()
        out["durable host m=15: decide (journal line + fdatasync)"] = _stats_us(decide)
        out["durable host m=15: observe (snapshot + 2 fsyncs)"] = _stats_us(observe)
    return out


def _stats_us(ns: list[int]) -> dict[str, float]:
    a = np.asarray(ns) / 1000.0
    return {"median_us": float(np.median(a)), "p90_us": float(np.percentile(a, 90)), "n": a.size}


# --------------------------------------------------------------------------- part 3: HTTP latency


def server_timing(header: str) -> dict[str, float]:
    """Seconds per phase of a `Server-Timing: name;dur=ms, ...` header."""
    phases = (part.strip().split(";dur=") for part in header.split(","))
    return {name: float(ms) / 1e3 for name, ms in phases}


def http_latency(backend: str, repeats: int, warmup: int) -> dict:
    """Median request latency of the served tiny model, gated vs ungated, alternating requests."""
    import httpx
    import ray
    from ray import serve

    from rlvr.config import load_config
    from rlvr.serving.config import load_serve_config
    from rlvr.tasks import load_task
    from rlvr.tasks.prompts import prompt_messages
    from workflows.calibrate import EngineOptions, run_calibrate
    from workflows.serve import APP_NAME, build_app, prepare_serve, start_serving
    from workflows.train import prepare

    tiny = load_config(ROOT / "configs" / "tiny.yaml")
    model_dir = prepare(tiny)[0]
    problems = load_task(tiny.task)[1]
    cal_path = OUT / "tiny-calibration.json"
    _, cal = run_calibrate(
        str(model_dir),
        str(ROOT / "configs" / "tiny.yaml"),
        out=str(cal_path),
        backend="hf",
        cal_fraction=0.5,
        engine=EngineOptions(max_model_len=256),
        k=5,
        max_tokens=48,
        alphas=(0.3, 0.5),
    )
    state = OUT / "serve-state"
    shutil.rmtree(state, ignore_errors=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = load_serve_config(
        ROOT / "configs" / "serve-tiny.yaml",
        [
            "name=serve-bench",
            f"model.path={model_dir}",
            f"generation.backend={backend}",
            f"csa.calibration={cal_path}",
            f"csa.state_dir={state}",
            "csa.streams.0.alpha=0.5",
            f"http.port={port}",
            "replicas.cpus=0",
        ],
    )
    prepared = prepare_serve(cfg)
    ray.init(
        address="local",  # a cluster of its own, never one another process started
        num_cpus=os.cpu_count() or 2,
        namespace="rlvr",
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    try:
        controller = start_serving(cfg, prepared)  # held: the actor ends with its last handle
        serve.run(
            build_app(cfg, prepared, gate=False),
            name=f"{APP_NAME}-ungated",
            route_prefix="/ungated",
        )
        url = f"http://127.0.0.1:{port}"
        prefixes = {"gated": "", "ungated": "/ungated"}
        times: dict[str, list[float]] = {k: [] for k in prefixes}
        gate_s: list[float] = []  # the gated replica's own Server-Timing for its decide call
        released = 0
        with httpx.Client(base_url=url, timeout=120) as http:
            for i in range(warmup + repeats):
                order = list(prefixes) if i % 2 == 0 else list(prefixes)[::-1]
                for variant in order:
                    body = {
                        "model": prepared.settings.served_name,
                        "messages": prompt_messages(
                            problems[i % len(problems)], tiny.task.instruction
                        ),
                        "seed": i,
                    }
                    t0 = time.perf_counter()
                    r = http.post(f"{prefixes[variant]}/v1/chat/completions", json=body)
                    elapsed = time.perf_counter() - t0
                    r.raise_for_status()
                    if i >= warmup:
                        times[variant].append(elapsed)
                        if variant == "gated":
                            released += r.json()["csa"]["released"]
                            gate_s.append(server_timing(r.headers["server-timing"])["gate"])
        status = ray.get(controller.status.remote("default"))["default"]
        # The gate's own cost as a replica sees it: one actor call that journals the decision.
        probe = prepared.specs["default"].to_dict()
        ray.get(controller.open.remote("probe", probe))
        calls = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ray.get(controller.decide.remote("probe", 0.5))
            calls.append(time.perf_counter() - t0)
        gated, ungated = statistics.median(times["gated"]), statistics.median(times["ungated"])
        return {
            "backend": backend,
            "k": cal.k,
            "max_tokens": cal.max_tokens,
            "repeats": repeats,
            "gated_median_ms": gated * 1e3,
            "ungated_median_ms": ungated * 1e3,
            "gated_p90_ms": float(np.percentile(times["gated"], 90) * 1e3),
            "ungated_p90_ms": float(np.percentile(times["ungated"], 90) * 1e3),
            "overhead_pct": (gated / ungated - 1) * 100,
            "gate_in_replica_median_ms": statistics.median(gate_s) * 1e3,
            "gate_in_replica_pct": statistics.median(gate_s) / ungated * 100,
            "decide_call_median_ms": statistics.median(calls) * 1e3,
            "decide_call_p90_ms": float(np.percentile(calls, 90) * 1e3),
            "gated_released": int(released),
            "stream_decided": status["decided"],
        }
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=100, help="streams per cell")
    ap.add_argument("--horizon", type=int, default=3000, help="rounds per stream")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overhead-rounds", type=int, default=20000)
    ap.add_argument("--durable-rounds", type=int, default=300)
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--http-repeats", type=int, default=40)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)

    print(f"part 1: {len(METHODS)} methods x {args.streams} streams x {args.horizon} rounds")
    t0 = time.perf_counter()
    results, traces = run_cells(args.streams, args.horizon, args.seed)
    synth_s = time.perf_counter() - t0
    pngs = plot(traces, OUT)
    md = [
        f"# CSA bench (delta={DELTA}, {args.streams} streams x {args.horizon} rounds per cell)",
        "",
        "## Summary: pathwise violations and release rate",
        "",
        summary_table(results, args.streams),
        "",
        "## Per cell",
        "",
    ]
    md += [cell_table(c, rows, args.streams) + "\n" for c, rows in results.items()]

    print("part 2: per-round overhead")
    over = overhead(args.overhead_rounds, args.durable_rounds, args.seed)
    md += [
        "## decide + observe per round (microseconds)",
        "",
        "| controller | median | p90 | rounds |",
    ]
    md += ["|---|---|---|---|"]
    md += [
        f"| {k} | {v['median_us']:.1f} | {v['p90_us']:.1f} | {v['n']} |" for k, v in over.items()
    ]

    http = None
    if not args.skip_http:
        print(f"part 3: HTTP latency ({args.backend})")
        http = http_latency(args.backend, args.http_repeats, warmup=5)
        md += [
            "",
            f"## HTTP latency, served tiny model ({http['backend']}, K={http['k']}, "
            f"max_tokens={http['max_tokens']}, {http['repeats']} alternating requests each)",
            "",
            "| | median ms | p90 ms |",
            "|---|---|---|",
            f"| ungated | {http['ungated_median_ms']:.1f} | {http['ungated_p90_ms']:.1f} |",
            f"| CSA gate | {http['gated_median_ms']:.1f} | {http['gated_p90_ms']:.1f} |",
            f"| decide call alone (driver -> StreamsActor, journal fdatasync) "
            f"| {http['decide_call_median_ms']:.1f} | {http['decide_call_p90_ms']:.1f} |",
            f"| gate inside the gated replica (its Server-Timing `gate`) "
            f"| {http['gate_in_replica_median_ms']:.1f} | |",
            "",
            f"Gate overhead on the median, side by side: {http['overhead_pct']:+.1f}% "
            "(two replicas, each with its own engine); the gated replica's own gate time is "
            f"{http['gate_in_replica_pct']:.1f}% of the ungated median. "
            f"Released {http['gated_released']} of {http['repeats']} timed gated requests.",
        ]
    md += ["", f"Part 1 took {synth_s:.0f} s. Plots: " + ", ".join(p.name for p in pngs)]
    text = "\n".join(md) + "\n"
    (OUT / "results.md").write_text(text)
    (OUT / "results.json").write_text(
        json.dumps({"cells": results, "overhead": over, "http": http}, indent=1)
    )
    print(text)


if __name__ == "__main__":
    main()
