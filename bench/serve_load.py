"""`rlvr serve` under abuse and load, over loopback, on the SFT-warmed tiny model.

Part 1 sends `--fuzz` seeded malformed and hostile requests (`rlvr.serving.fuzz`: every one must
get a 4xx JSON error and change no stream), tallied by category and status class. Part 2 runs
`--clients` concurrent clients, each posting `--requests` completions and labelling every answer,
a fifth of them twice at once from two threads (one label must apply, the other get 409): latency
percentiles, throughput, and the stream's state against the labels sent. Part 3 repeats part 2
while one of the two replicas is killed: how many requests failed, how many rounds lost their
answer (they stay open until their label timeout), how long Serve took to replace it.

    .venv/bin/python bench/serve_load.py                     # 10,000 fuzz cases, about 10 minutes
    .venv/bin/python bench/serve_load.py --fuzz 2000 --backend hf
Writes bench/out/serve_load/{results.md, results.json}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from rlvr.serving.fuzz import CATEGORIES, Credentials, fuzz_cases, tally
from workflows.cluster import ray_env

ray_env()
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "serve_load"
CLIENT_KEY = "bench-client-key-000000000001"
OPERATOR_KEY = "bench-operator-key-0000000001"
CLIENT = {"authorization": f"Bearer {CLIENT_KEY}"}
OPERATOR = {"authorization": f"Bearer {OPERATOR_KEY}"}
STREAMS = ("fuzz", "load", "kill", "health")


def start(backend: str) -> dict[str, Any]:
    """Serve the tiny model on a free loopback port: 2 replicas, 3 streams, keys set."""
    import ray

    from rlvr.algorithms.csa import Calibrator
    from rlvr.config import load_config
    from rlvr.serving.api import Calibration
    from rlvr.serving.config import load_serve_config
    from workflows.serve import prepare_serve, start_serving
    from workflows.train import prepare

    model_dir = prepare(load_config(ROOT / "configs" / "tiny.yaml"))[0]
    state = OUT / "state"
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True)
    # A fixed score map (raw -> 0.05 + 0.25 raw) whose top threshold certifies after 12 passes.
    cal = Calibration(
        calibrator=Calibrator([0.0, 1.0], [0.05, 0.3]),
        raw_scores=[0.0] * 10 + [1.0] * 10,
        passed=[True] * 10 + [False] * 10,
        k=4,
        temperature=0.7,
        top_p=1.0,
        max_tokens=16,
    )
    cal.save(state / "cal.json")
    (state / "operator.key").write_text(OPERATOR_KEY + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    overrides = [
        "name=serve-load",
        f"model.path={model_dir}",
        f"generation.backend={backend}",
        f"csa.calibration={state / 'cal.json'}",
        f"csa.state_dir={state / 'csa'}",
        f"csa.streams=[{', '.join(f'{{name: {n}, alpha: 0.5, m: 3}}' for n in STREAMS)}]",
        f"http.port={port}",
        f"http.api_keys=[{CLIENT_KEY}]",
        f"http.operator_key_file={state / 'operator.key'}",
        "replicas.num_replicas=2",
        "replicas.cpus=0",
    ]
    cfg = load_serve_config(ROOT / "configs" / "serve-tiny.yaml", overrides)
    prepared = prepare_serve(cfg)
    ray.init(
        address="local",  # a cluster of its own, never one another process started
        num_cpus=os.cpu_count() or 2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    controller = start_serving(cfg, prepared)
    return {
        "url": f"http://127.0.0.1:{port}",
        "cfg": cfg,
        "controller": controller,
        "model": prepared.settings.served_name,
        "max_tokens": cal.max_tokens,
    }


def stream_state(server: dict[str, Any], stream: str) -> dict[str, Any]:
    import ray

    return ray.get(server["controller"].state.remote(stream))


def chat(server: dict[str, Any], stream: str, seed: int) -> dict[str, Any]:
    return {
        "model": server["model"],
        "messages": [{"role": "user", "content": f"{seed % 17} + {seed % 5}?"}],
        "seed": seed,
        "metadata": {"csa_stream": stream},
    }


# --------------------------------------------------------------------------- part 1


def fuzz(server: dict[str, Any], n: int, seed: int) -> dict[str, Any]:
    """Send `n` seeded hostile cases; tally them and check that no stream changed."""
    creds = Credentials(
        CLIENT_KEY,
        OPERATOR_KEY,
        server["model"],
        "fuzz",
        server["cfg"].http.max_body_bytes,
        server["max_tokens"],
    )
    before = {s: stream_state(server, s) for s in STREAMS}
    results, not_json, seconds = [], 0, []
    start_t = time.perf_counter()
    with httpx.Client(base_url=server["url"], timeout=60) as http:
        for case in fuzz_cases(n, creds, seed):
            t = time.perf_counter()
            r = http.request(case.method, case.path, content=case.body, headers=case.headers)
            seconds.append(time.perf_counter() - t)
            results.append((case.category, r.status_code))
            try:
                r.json()
            except ValueError:
                not_json += 1
        healthy = http.post("/v1/chat/completions", json=chat(server, "health", 0), headers=CLIENT)
    wall = time.perf_counter() - start_t
    after = {s: stream_state(server, s) for s in STREAMS}
    # The health check decided one round on its own stream; the others must be untouched.
    unchanged = all(after[s] == before[s] for s in STREAMS if s != "health")
    return {
        "n": n,
        "table": tally(results),
        "not_json": not_json,
        "unchanged": unchanged,
        "healthy_after": healthy.status_code == 200,
        "p50_ms": 1e3 * statistics.median(seconds),
        "wall_s": wall,
    }


# --------------------------------------------------------------------------- parts 2 and 3


def load(
    server: dict[str, Any], stream: str, clients: int, requests: int, kill_after: int | None
) -> dict[str, Any]:
    """`clients` threads post completions and label each answer (every fifth twice at once);
    with `kill_after`, one replica is killed once that many answers came back."""
    import ray

    latencies: list[float] = []
    statuses: list[int] = []
    labels: list[tuple[int, int]] = []
    duplicate_codes: list[int] = []
    lock = threading.Lock()

    def label(http: httpx.Client, seq: int) -> int:
        """Post the label, retrying a 5xx as a client would (a 409 then means it got in)."""
        body = {"seq": seq, "passed": seq % 3 != 0, "stream": stream}
        for attempt in range(5):
            code = http.post("/v1/feedback", json=body, headers=OPERATOR).status_code
            if code < 500:
                return code
            time.sleep(0.2 * 2**attempt)
        return code

    def client(c: int) -> None:
        with httpx.Client(base_url=server["url"], timeout=120) as http:
            for j in range(requests):
                t = time.perf_counter()
                r = http.post(
                    "/v1/chat/completions",
                    json=chat(server, stream, 10_000 * c + j),
                    headers=CLIENT,
                )
                dt = time.perf_counter() - t
                with lock:
                    statuses.append(r.status_code)
                    if r.status_code == 200:
                        latencies.append(dt)
                if r.status_code != 200:
                    continue
                seq = r.json()["csa"]["seq"]
                if seq % 5 == 0:  # the same label twice, at the same moment
                    codes: list[int] = []
                    twin = threading.Thread(target=lambda c=codes, s=seq: c.append(label(http, s)))
                    twin.start()
                    mine = label(http, seq)
                    twin.join()
                    with lock:
                        labels.append((seq, mine))
                        duplicate_codes.extend(sorted([mine, *codes]))
                else:
                    code = label(http, seq)
                    with lock:
                        labels.append((seq, code))

    replicas_before = _replicas()
    start_t = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    killed_at = replaced_s = None
    if kill_after is not None:
        while len(labels) < kill_after:
            time.sleep(0.01)
        name, handle = replicas_before[0]
        killed_at = time.perf_counter()
        ray.kill(handle, no_restart=True)
    for t in threads:
        t.join()
    wall = time.perf_counter() - start_t
    if killed_at is not None:
        before = {n for n, _ in replicas_before}
        # Until a new replica exists and Serve reports two running again.
        while _running_replicas() < 2 or not {n for n, _ in _replicas()} - before:
            time.sleep(0.2)
        replaced_s = time.perf_counter() - killed_at
    state = stream_state(server, stream)["controller"]
    applied_or_waiting = {seq for seq, *_ in state["labels"]}
    lost = {seq for seq, *_ in state["pending"]} - applied_or_waiting
    ok = [seq for seq, code in labels if code in (200, 409)]
    latencies.sort()
    return {
        "clients": clients,
        "requests": clients * requests,
        "answered": len(latencies),
        "failed": sum(code != 200 for code in statuses),
        "p50_ms": 1e3 * latencies[len(latencies) // 2] if latencies else None,
        "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        if latencies
        else None,
        "throughput_rps": len(latencies) / wall,
        "labels_sent": len(labels) + len(duplicate_codes) // 2,
        "duplicates": len(duplicate_codes) // 2,
        "duplicates_one_200_one_409": all(
            duplicate_codes[i : i + 2] == [200, 409] for i in range(0, len(duplicate_codes), 2)
        ),
        "labels_applied_once": state["applied"] + len(applied_or_waiting) == len(set(ok)),
        "rounds_lost_with_their_answer": len(lost),
        "replica_replaced_s": replaced_s,
    }


def _running_replicas() -> int:
    """Replicas of the app that Serve reports RUNNING (started and answering health checks)."""
    from ray import serve

    from workflows.serve import APP_NAME

    app = serve.status().applications[APP_NAME]
    return app.deployments["CSAServer"].replica_states.get("RUNNING", 0)


def _replicas() -> list[tuple[str, Any]]:
    import ray

    found = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::") and "CSAServer" in a["name"]
    ]
    return sorted((a["name"], ray.get_actor(a["name"], namespace=a["namespace"])) for a in found)


# --------------------------------------------------------------------------- report


def report(args: argparse.Namespace, out: dict[str, Any]) -> str:
    f = out["fuzz"]
    lines = [
        "# rlvr serve under abuse and load",
        "",
        f"Tiny model, {args.backend} backend, 2 replicas, K=4, over loopback; "
        f"{os.cpu_count()} CPU cores.",
        "",
        f"## Fuzz: {f['n']} seeded cases (seed {args.seed}), {f['wall_s']:.0f} s, "
        f"p50 {f['p50_ms']:.1f} ms",
        "",
        "| category | 2xx | 4xx | 5xx |",
        "|---|---|---|---|",
    ]
    for cat in CATEGORIES:
        row = f["table"].get(cat, {})
        lines.append(f"| {cat} | {row.get('2xx', 0)} | {row.get('4xx', 0)} | {row.get('5xx', 0)} |")
    lines += [
        "",
        f"Non-JSON answers: {f['not_json']}. Streams unchanged: {f['unchanged']}. "
        f"Healthy after: {f['healthy_after']}.",
        "",
        "## Load",
        "",
        "| run | requests | answered | failed | p50 ms | p99 ms | answers/s | labels sent | "
        "duplicate pairs | one 200 + one 409 each | applied once | rounds lost | replaced in s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("load", "replica killed"):
        r = out[name]
        replaced = "" if r["replica_replaced_s"] is None else f"{r['replica_replaced_s']:.1f}"
        lines.append(
            f"| {name} | {r['requests']} | {r['answered']} | {r['failed']} | {r['p50_ms']:.0f} | "
            f"{r['p99_ms']:.0f} | {r['throughput_rps']:.2f} | {r['labels_sent']} | "
            f"{r['duplicates']} | {r['duplicates_one_200_one_409']} | "
            f"{r['labels_applied_once']} | {r['rounds_lost_with_their_answer']} | {replaced} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fuzz", type=int, default=10_000, help="fuzz cases")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=12, help="completions per client")
    parser.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    args = parser.parse_args()
    from ray import serve

    OUT.mkdir(parents=True, exist_ok=True)
    server = start(args.backend)
    try:
        out = {
            "fuzz": fuzz(server, args.fuzz, args.seed),
            "load": load(server, "load", args.clients, args.requests, None),
            "replica killed": load(
                server, "kill", args.clients, args.requests, args.clients * args.requests // 4
            ),
        }
    finally:
        serve.shutdown()
    text = report(args, out)
    (OUT / "results.md").write_text(text)
    (OUT / "results.json").write_text(json.dumps(out, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
