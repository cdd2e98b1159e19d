"""A frozen policy against live updates on the same traffic, side by side (the CSA paper's live
protocol, arXiv:2605.20270 Sec. 6.2).

Two deployments run in one Serve instance, from the same checkpoint, calibration and stream spec:
`frozen` (live off) and `live` (every `--round-size` requests a LoRA update trained on that
round's verifier-correct answers, published at a seq boundary). The task is the preset's, with
operands up to --max-operand so that it has a distinct training problem for every request: the
calibration is fitted first on its held-out problems (`rlvr calibrate`), and the traffic is its
training problems in a seeded order, every request shadow-verified against its reference. Request
i of each round goes to both deployments with the same prompt and seed, alternating which goes
first. Between rounds the updater runs once (the protocol's one update per round) and the bench
waits until the live replica serves the new version.

Per round and side: the release rate, the accuracy of all answers and of the released ones, the
realised selective risk since the start against alpha + slack(N) (Sec. 2.11 of the digest), the
deployed threshold and epoch. Per update: its pairs, SFT NLL and time, the seconds from
publication to the first answer of the new version, and the latencies of a client that keeps
two requests in flight on the live deployment's `probe` stream from before the update until the
switch (the switch must cost no failure and at most one weight swap of waiting). Writes
results.md, results.json and csa_live.png into --out.

    .venv/bin/python bench/csa_live.py --model tiny --rounds 4 --round-size 24
    .venv/bin/python bench/csa_live.py --model smollm2 --rounds 5 --round-size 32 \
        --max-operand 15 --temperature 0.3 --alpha 0.5 --epochs 4
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from workflows.cluster import ray_env

ray_env()
ROOT = Path(__file__).resolve().parent.parent
PRESETS = {"tiny": "tiny.yaml", "smollm2": "smollm2-arith.yaml"}
CLIENT_KEY = "bench-live-client-key-0000001"
OPERATOR_KEY = "bench-live-operator-key-00001"
SIDES = ("frozen", "live")


def calibrate_model(args: argparse.Namespace, model_dir: Path, data: Path, out: Path) -> Path:
    """Fit the score map on the held-out problems of the task in `data` (as `rlvr calibrate`)."""
    from workflows.calibrate import EngineOptions, run_calibrate

    path, cal = run_calibrate(
        str(model_dir),
        str(data),
        out=str(out / "cal.json"),
        backend=args.backend,
        cal_fraction=1.0,
        alphas=(args.alpha,),
        engine=EngineOptions(
            max_model_len=args.max_model_len, kv_cache_gib=0.25, enforce_eager=True
        ),
        k=args.k,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
    )
    print(f"calibration: {len(cal.passed)} problems, accuracy {sum(cal.passed) / len(cal.passed)}")
    return path


def serve_configs(args: argparse.Namespace, model_dir: Path, cal: Path, work: Path, port: int):
    """The two deployments' configs: identical but for their names, state and `live`."""
    from rlvr.serving.config import load_serve_config

    epochs = f", epoch_length: {args.epoch_length}" if args.epoch_length else ""
    configs = {}
    for side in SIDES:
        overrides = [
            f"name=bench-{side}",
            f"model.path={model_dir}",
            f"generation.backend={args.backend}",
            f"generation.max_model_len={args.max_model_len}",
            "generation.kv_cache_gib=0.25",
            "generation.enforce_eager=true",
            "generation.torch_threads=2",  # the sides take turns: each may use both cores
            f"csa.calibration={cal}",
            f"csa.state_dir={work / side / 'csa'}",
            f"csa.streams=[{{name: traffic, alpha: {args.alpha}{epochs}}}, "
            f"{{name: probe, alpha: {args.alpha}}}]",
            f"http.port={port}",
            f"http.api_keys=[{CLIENT_KEY}]",
            "replicas.cpus=0",
        ]
        if side == "live":
            overrides += [
                "live.enabled=true",
                "live.stream=traffic",
                f"live.round_size={args.round_size}",
                f"live.algorithm={args.algorithm}",
                f"live.epochs={args.epochs}",
                f"live.lr={args.lr}",
                "live.cpus=0",
                "live.poll_s=0.5",
                f"live.dir={work / side / 'live'}",
            ]
        configs[side] = load_serve_config(None, overrides)
    return configs


class Client:
    """Posts chat completions to either deployment and keeps each one's latency with its csa."""

    def __init__(self, url: str, model: str, instruction: str):
        self.url, self.model, self.instruction = url, model, instruction

    def ask(self, side: str, problem: Any, seed: int, stream: str = "traffic") -> dict[str, Any]:
        from rlvr.tasks.prompts import prompt_messages

        body = {
            "model": self.model,
            "messages": prompt_messages(problem, self.instruction),
            "seed": seed,
            "metadata": {"csa_stream": stream, "reference": problem.answer},
        }
        start = time.perf_counter()
        r = httpx.post(
            f"{self.url}/{side}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {CLIENT_KEY}"},
            timeout=600,
        )
        return {"status": r.status_code, "latency_s": time.perf_counter() - start} | (
            r.json()["csa"] if r.status_code == 200 else {}
        )


class Probe:
    """Two client threads keeping requests in flight on the live side's probe stream."""

    def __init__(self, client: Client, problems: list[Any]):
        self.client, self.problems = client, problems
        self.answers: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(c,)) for c in range(2)]

    def _run(self, c: int) -> None:
        i = 0
        while not self._stop.is_set():
            problem = self.problems[(2 * i + c) % len(self.problems)]
            self.answers.append(self.client.ask("live", problem, 10**9 + 2 * i + c, "probe"))
            i += 1

    def __enter__(self) -> Probe:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def wait_for(self, version: str, timeout_s: float = 300) -> float:
        """Seconds until a probe answer generated by `version` comes back."""
        start = time.perf_counter()
        while not any(a.get("policy_version") == version for a in self.answers):
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"no answer from {version} within {timeout_s} s")
            time.sleep(0.05)
        return time.perf_counter() - start


def wait_closed(controller: Any, end: int) -> None:
    """Until every label of seqs below `end` is applied (the shadow verifier runs behind)."""
    import ray

    deadline = time.monotonic() + 600
    while ray.get(controller.closed_round.remote("traffic", 0, end)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"labels below seq {end} were not applied in 600 s")
        time.sleep(0.2)


def audit_lines(work: Path, side: str) -> list[dict]:
    """The audit file of one side's traffic stream: its applied rounds and its events."""
    lines = (work / side / "csa" / "traffic.audit.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def recertifications(work: Path, side: str) -> list[dict]:
    """Each epoch start of one side's traffic stream and the rounds it took to release again
    (None: it never did)."""
    lines = audit_lines(work, side)
    starts = [line for line in lines if line.get("event") == "epoch"]
    released = [line["seq"] for line in lines if line.get("action") == "release"]
    out = []
    for e in starts:
        first = next((seq for seq in released if seq >= e["first_seq"]), None)
        out.append(
            {
                "epoch": e["epoch"],
                "reason": e["reason"],
                "first_seq": e["first_seq"],
                "rounds_to_release": None if first is None else first - e["first_seq"],
            }
        )
    return out


def round_row(side: str, index: int, answers: list[dict], audit: list[dict], alpha: float):
    """One round's figures for one side; risk and its bound are cumulative since round 0."""
    from rlvr.algorithms.csa import selective_risk_slack

    passed = {line["seq"]: line["label"] == "pass" for line in audit}
    released = [a for a in answers if a["released"]]
    so_far = [line for line in audit if line["action"] == "release"]
    n = len(so_far)
    return {
        "side": side,
        "round": index,
        "release_rate": len(released) / len(answers),
        "accuracy": sum(passed[a["seq"]] for a in answers) / len(answers),
        "released_accuracy": (
            sum(passed[a["seq"]] for a in released) / len(released) if released else None
        ),
        "risk": sum(line["label"] != "pass" for line in so_far) / max(n, 1),
        "bound": alpha + float(selective_risk_slack(n, 0.1)) if n else None,
        "released_so_far": n,
        "threshold": answers[-1]["threshold"],
        "epoch": answers[-1]["epoch"],
        "policy": answers[-1]["policy_version"],
        "median_latency_s": statistics.median(a["latency_s"] for a in answers),
    }


def update_between_rounds(updater: Any, index: int, client: Client, problems: list[Any]) -> dict:
    """Run the updater once under probe load and time the switch to what it published."""
    with Probe(client, problems) as probe:
        start = time.perf_counter()
        records = updater.poll()
        update: dict[str, Any] = {"after_round": index, "update_s": time.perf_counter() - start}
        if records and records[-1]["policy"]:
            record = records[-1]
            keys = ("policy", "pairs", "optimizer_steps", "sft_nll", "reward_mean")
            update |= {k: record[k] for k in keys if k in record}
            update["switch_s"] = probe.wait_for(record["policy"])
            time.sleep(1.0)  # a few answers of the new version after the switch
    latencies = [a["latency_s"] for a in probe.answers]
    return update | {
        "probe_requests": len(probe.answers),
        "probe_failures": sum(a["status"] != 200 for a in probe.answers),
        "probe_median_latency_s": statistics.median(latencies) if latencies else None,
        "probe_max_latency_s": max(latencies, default=None),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=list(PRESETS), default="tiny")
    ap.add_argument("--backend", choices=["hf", "vllm"], help="default: hf (tiny), vllm")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--round-size", type=int, default=24)
    ap.add_argument("--alpha", type=float, help="default: 0.5 (tiny), 0.4")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.7, help="of the K samples")
    ap.add_argument("--max-tokens", type=int, help="default: 24 (tiny), 96")
    ap.add_argument("--algorithm", choices=["sft", "grpo"], default="sft", help="live updates")
    ap.add_argument("--epochs", type=int, default=2, help="passes per update")
    ap.add_argument("--lr", type=float, help="default: 1e-3 (tiny), 2e-4")
    ap.add_argument("--epoch-length", type=int, help="CSA-Epoch reset every N requests")
    ap.add_argument("--max-operand", type=int, help="largest operand: 20 (tiny), 30")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="default: bench/out/csa_live/MODEL")
    args = ap.parse_args()
    tiny = args.model == "tiny"
    args.backend = args.backend or ("hf" if tiny else "vllm")
    args.alpha = args.alpha or (0.5 if tiny else 0.4)
    args.max_tokens = args.max_tokens or (24 if tiny else 96)
    args.max_model_len = 256 if tiny else 512
    args.lr = args.lr or (1e-3 if tiny else 2e-4)
    args.max_operand = args.max_operand or (20 if tiny else 30)
    out = Path(args.out or ROOT / "bench" / "out" / "csa_live" / args.model)
    work = out / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    import ray
    from ray import serve

    from rlvr.config import load_config
    from rlvr.models import resolve_model_path
    from rlvr.tasks import load_task
    from workflows.live_updater import LiveUpdater
    from workflows.serve import prepare_serve, start_serving
    from workflows.train import prepare

    preset_path = ROOT / "configs" / PRESETS[args.model]
    model_dir = prepare(load_config(preset_path))[0] if tiny else resolve_model_path("smollm2")
    # The task: the preset's, with as many training problems as requests (the traffic) and
    # operands up to --max-operand so that there are that many; calibration on its held-out set.
    needed = args.rounds * args.round_size
    spec = yaml.safe_load(preset_path.read_text())
    spec["task"]["n_train"] = needed
    spec["task"].setdefault("difficulty", {})["max_operand"] = args.max_operand
    data = work / "task.yaml"
    data.write_text(yaml.safe_dump(spec))
    preset = load_config(data)
    cal = calibrate_model(args, model_dir, data, work)
    train, held_out = load_task(preset.task)
    problems = random.Random(args.seed).sample(train, needed)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    configs = serve_configs(args, model_dir, cal, work, port)
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    prepared = {side: prepare_serve(cfg) for side, cfg in configs.items()}
    controllers = {
        side: start_serving(cfg, prepared[side], app_name=side, route_prefix=f"/{side}")
        for side, cfg in configs.items()
    }
    live = prepared["live"].settings
    updater = LiveUpdater(configs["live"], live.model_dir, controllers["live"])
    client = Client(f"http://127.0.0.1:{port}", live.served_name, preset.task.instruction)
    rows, updates = [], []
    try:
        for index in range(args.rounds):
            answers: dict[str, list[dict]] = {side: [] for side in SIDES}
            for i in range(args.round_size):
                problem = problems[index * args.round_size + i]
                for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                    answer = client.ask(side, problem, args.seed * 10**6 + index * 10**3 + i)
                    if answer["status"] != 200:
                        raise RuntimeError(f"{side}: HTTP {answer['status']}")
                    answers[side].append(answer)
            for side in SIDES:
                wait_closed(controllers[side], (index + 1) * args.round_size)
                audit = [line for line in audit_lines(work, side) if "event" not in line]
                rows.append(round_row(side, index, answers[side], audit, args.alpha))
                print(json.dumps(rows[-1]), flush=True)
            if index + 1 < args.rounds:
                updates.append(update_between_rounds(updater, index, client, held_out))
                print(json.dumps(updates[-1]), flush=True)
        epochs = {side: recertifications(work, side) for side in SIDES}
    finally:
        updater.close()
        serve.shutdown()
        ray.shutdown()
    write_results(args, out, rows, updates, epochs)


def write_results(
    args: argparse.Namespace,
    out: Path,
    rows: list[dict],
    updates: list[dict],
    epochs: dict[str, list[dict]],
):
    """results.json, a results.md table per side, the updates and epochs, and csa_live.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (out / "results.json").write_text(
        json.dumps(
            {"args": vars(args), "rounds": rows, "updates": updates, "epochs": epochs}, indent=1
        )
    )

    def fmt(x: Any) -> str:
        return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)

    cols = [
        "round",
        "release_rate",
        "accuracy",
        "released_accuracy",
        "risk",
        "bound",
        "released_so_far",
        "threshold",
        "epoch",
        "policy",
        "median_latency_s",
    ]
    lines = [
        f"# Frozen vs live: {args.model} ({args.backend}), {args.rounds} rounds of "
        f"{args.round_size} requests, alpha {args.alpha}, K {args.k} at T {args.temperature}, "
        f"{args.max_tokens} tokens, operands up to {args.max_operand}, "
        f"LoRA {args.algorithm} {args.epochs} epochs at lr {args.lr}",
        "",
        "| side | " + " | ".join(cols) + " |",
        "|" + "---|" * (len(cols) + 1),
    ]
    for row in sorted(rows, key=lambda r: (r["side"], r["round"])):
        lines.append(f"| {row['side']} | " + " | ".join(fmt(row[c]) for c in cols) + " |")
    ucols = [
        "after_round",
        "policy",
        "pairs",
        "optimizer_steps",
        "sft_nll",
        "update_s",
        "switch_s",
        "probe_requests",
        "probe_failures",
        "probe_median_latency_s",
        "probe_max_latency_s",
    ]
    lines += ["", "| " + " | ".join(ucols) + " |", "|" + "---|" * len(ucols)]
    lines += ["| " + " | ".join(fmt(u.get(c)) for c in ucols) + " |" for u in updates]
    for side in SIDES:
        starts = epochs[side] or "none after the first"
        lines.append(f"\nEpoch starts ({side}): {starts}")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for side in SIDES:
        mine = [r for r in rows if r["side"] == side]
        x = [r["round"] for r in mine]
        axes[0].plot(x, [r["release_rate"] for r in mine], "o-", label=side)
        axes[1].plot(x, [r["accuracy"] for r in mine], "o-", label=side)
        axes[2].plot(x, [r["risk"] for r in mine], "o-", label=f"{side} risk")
        bound = [(r["round"], r["bound"]) for r in mine if r["bound"] is not None]
        if bound:
            axes[2].plot(*zip(*bound, strict=True), "x:", label=f"{side}: alpha + slack(N)")
    axes[2].axhline(args.alpha, color="grey", lw=0.8, label="alpha")
    for ax, title in zip(
        axes, ("release rate", "accuracy (all answers)", "realised risk"), strict=True
    ):
        ax.set_xlabel("EI round")
        ax.set_xticks(range(args.rounds))
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "csa_live.png", dpi=120)


if __name__ == "__main__":
    main()
