"""Live learning over real HTTP on the tiny model: verified traffic -> the updater's EI rounds
(LoRA SFT in a DeepSpeed PolicyActor) -> published versions -> replicas switching at a seq
boundary. Checks rule R2 on every applied round, that the served weights are the trained ones,
and that restarting the updater or a replica loses and repeats nothing.

Each round has 6 requests: 3 shadow-verified (metadata.reference) and 3 labelled through POST
/v1/feedback as passed, so every round has verifier-correct answers to train on.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from rlvr.models.checkpoints import merged_lora_weights
from rlvr.tasks.prompts import prompt_messages
from tests.integration.bounds import HANG_S

ROOT = Path(__file__).resolve().parents[2]
CLIENT_KEY = "live-client-key-for-the-tests-01"
OPERATOR_KEY = "live-operator-key-for-the-tests-1"
ROUND = 6
STREAM = "live"
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def live_server(ray_cluster, sft_model, fixed_calibration, tmp_path_factory):
    from ray import serve

    from rlvr.serving.config import load_serve_config
    from workflows.serve import prepare_serve, start_serving

    tmp = tmp_path_factory.mktemp("live")
    cal = fixed_calibration
    cal.save(tmp / "cal.json")
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    spec = yaml.safe_load((ROOT / "configs" / "serve-tiny.yaml").read_text())
    spec |= {"name": "live-test"}
    spec["model"]["path"] = str(sft_model)
    spec["generation"]["backend"] = "hf"
    spec["csa"] = {
        "calibration": str(tmp / "cal.json"),
        "state_dir": str(tmp / "state"),
        "streams": [{"name": STREAM, "alpha": 0.5, "m": 3}, {"name": "other", "alpha": 0.5}],
    }
    spec["http"] |= {"port": port, "api_keys": [CLIENT_KEY]}
    (tmp / "operator.key").write_text(OPERATOR_KEY + "\n")
    spec["http"]["operator_key_file"] = str(tmp / "operator.key")
    spec["replicas"] = {"num_replicas": 2, "cpus": 0, "max_ongoing_requests": 8}
    # A large learning rate, so that two steps visibly move the tiny model's adapter.
    spec["live"] = {
        "enabled": True,
        "stream": STREAM,
        "round_size": ROUND,
        "epochs": 2,
        "batch_size": 3,
        "lr": 1e-2,
        "lora": {"enabled": True, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "cpus": 0,
        "poll_s": 0.2,
        "dir": str(tmp / "live"),
    }
    (tmp / "serve.yaml").write_text(yaml.safe_dump(spec))
    cfg = load_serve_config(tmp / "serve.yaml")
    prepared = prepare_serve(cfg)
    controller = start_serving(cfg, prepared)
    yield {
        "url": f"http://127.0.0.1:{port}",
        "cfg": cfg,
        "prepared": prepared,
        "controller": controller,
        "model": prepared.settings.served_name,
        "state_dir": tmp / "state",
    }
    serve.shutdown()
    ray_cluster.kill(controller, no_restart=True)


def serve_round(server, problems, index: int) -> list[dict]:
    """One EI round of requests: the first half shadow-verified, the rest labelled passed by the
    operator; returns each response's csa object once every label is applied."""
    import ray

    tasks, instruction = problems
    out = []
    for i in range(ROUND):
        task = tasks[index * ROUND + i]
        meta = {"csa_stream": STREAM} | ({"reference": task.answer} if i < ROUND // 2 else {})
        body = {
            "model": server["model"],
            "messages": prompt_messages(task, instruction),
            "seed": 1000 * index + i,
            "metadata": meta,
        }
        r = httpx.post(
            f"{server['url']}/v1/chat/completions", json=body, headers=auth(CLIENT_KEY), timeout=60
        )
        assert r.status_code == 200, r.text
        csa = r.json()["csa"]
        if i >= ROUND // 2:
            label = {"seq": csa["seq"], "passed": True, "stream": STREAM}
            r = httpx.post(
                f"{server['url']}/v1/feedback", json=label, headers=auth(OPERATOR_KEY), timeout=60
            )
            assert r.status_code == 200, r.text
        out.append(csa)
    deadline = time.monotonic() + HANG_S
    end = (index + 1) * ROUND
    while ray.get(server["controller"].closed_round.remote(STREAM, 0, end)) is None:
        assert time.monotonic() < deadline, "the round's shadow labels were not applied"
        time.sleep(0.1)
    return out


def test_verified_rounds_become_versions_the_replicas_serve(live_server, problems):
    import ray

    from workflows.live_updater import LiveUpdater

    server, cfg = live_server, live_server["cfg"]
    base = server["prepared"].policy
    updater = LiveUpdater(cfg, server["prepared"].settings.model_dir, server["controller"])
    assert updater.poll() == []  # no round is closed yet

    round0 = serve_round(server, problems, 0)
    assert {c["policy_version"] for c in round0} == {base}
    assert [c["seq"] for c in round0] == list(range(ROUND))
    [v1] = updater.poll()
    assert v1["round"] == 0 and v1["trained_through"] == ROUND - 1
    assert v1["policy"].startswith("live-0@") and v1["pairs"] >= ROUND // 2
    assert v1["optimizer_steps"] == 2 * -(-v1["pairs"] // 3)
    # Published at the next seq of every stream; only the live stream's record says what trained it.
    assert v1["boundaries"] == {STREAM: ROUND, "other": 0}
    assert updater.poll() == []
    # What replicas load is what the updater trained: its merged weights, to fp32 rounding.
    trained = updater.policy.run("export_weights")
    served = dict(merged_lora_weights(server["prepared"].settings.model_dir, v1["adapter"]))
    for name, tensor in trained.items():
        torch.testing.assert_close(served[name], tensor, rtol=0, atol=1e-6)
    assert any(not torch.equal(served[n], t) for n, t in base_weights(server).items())

    wait_for_version(server, v1["policy"])
    round1 = serve_round(server, problems, 1)
    assert {c["policy_version"] for c in round1} == {v1["policy"]}
    assert {c["versions"]["policy"] for c in round1} == {v1["policy"]}

    # A restarted updater resumes after round 0: it trains round 1 once, then finds nothing.
    updater.close()
    updater = LiveUpdater(cfg, server["prepared"].settings.model_dir, server["controller"])
    [v2] = updater.poll()
    assert v2["round"] == 1 and v2["trained_through"] == 2 * ROUND - 1
    assert v2["policy"] not in (base, v1["policy"])
    updater.close()
    updater = LiveUpdater(cfg, server["prepared"].settings.model_dir, server["controller"])
    assert updater.poll() == []
    assert [p["round"] for p in updater.state.published] == [0, 1]

    # A replica killed and replaced serves the newest version from its first request on.
    name, handle = replicas()[0]
    ray.kill(handle, no_restart=True)
    deadline = time.monotonic() + HANG_S
    while len(names := {n for n, _ in replicas()}) < 2 or name in names:
        assert time.monotonic() < deadline, "Serve did not replace the killed replica"
        time.sleep(0.5)
    wait_for_version(server, v2["policy"])
    round2 = serve_round(server, problems, 2)
    assert {c["policy_version"] for c in round2} == {v2["policy"]}
    updater.close()

    # R2 on every applied round: its serving policy was trained only on earlier labels.
    trained_through = {v1["policy"]: v1["trained_through"], v2["policy"]: v2["trained_through"]}
    audit_path = server["state_dir"] / f"{STREAM}.audit.jsonl"
    audit = [json.loads(line) for line in audit_path.read_text().splitlines()]
    rounds = [line for line in audit if "event" not in line]
    assert [line["seq"] for line in rounds] == list(range(3 * ROUND))
    for line in rounds:
        assert trained_through.get(line["served_policy"], -1) < line["seq"]
    status = httpx.get(
        f"{server['url']}/v1/csa/status", params={"stream": STREAM}, headers=auth(OPERATOR_KEY)
    ).json()["streams"][STREAM]
    assert [(v["seq"], v["policy"]) for v in status["version_history"]] == [
        (0, base),
        (ROUND, v1["policy"]),
        (2 * ROUND, v2["policy"]),
    ]


def wait_for_version(server, version: str) -> None:
    """Requests on the other stream until 8 in a row were generated by `version`: each replica's
    own thread switches within a poll of the publication, traffic or not."""
    in_a_row, deadline = 0, time.monotonic() + HANG_S
    while in_a_row < 8:
        assert time.monotonic() < deadline, f"the replicas did not switch to {version}"
        body = {
            "model": server["model"],
            "messages": [{"role": "user", "content": "3+4?"}],
            "metadata": {"csa_stream": "other"},
        }
        r = httpx.post(
            f"{server['url']}/v1/chat/completions", json=body, headers=auth(CLIENT_KEY), timeout=60
        )
        assert r.status_code == 200, r.text
        in_a_row = in_a_row + 1 if r.json()["csa"]["policy_version"] == version else 0


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def replicas() -> list[tuple[str, object]]:
    """(name, handle) of the live deployment's replicas."""
    import ray

    return [
        (a["name"], ray.get_actor(a["name"], namespace=a["namespace"]))
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::") and "CSAServer" in a["name"]
    ]


def base_weights(server) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    model_dir = Path(server["prepared"].settings.model_dir)
    return {k: v for f in model_dir.glob("*.safetensors") for k, v in load_file(f).items()}


def test_the_grpo_option_samples_verifies_and_publishes(live_server, problems):
    """`live.algorithm: grpo` on the live stream's closed rounds: each round's 3 shadow-verified
    prompts get 8 fresh samples from the current version, verified against their references;
    a round with a group that holds both outcomes becomes a version, published after its seqs.
    (At the tiny model's accuracy, about 0.15 a sample, a group of 8 holds both outcomes with
    probability 0.73: 12 groups all without are a 1e-7 event.)"""
    import ray

    from workflows.live_updater import LiveUpdater

    server, cfg = live_server, live_server["cfg"]
    controller = server["controller"]
    decided = ray.get(controller.status.remote(STREAM))[STREAM]["next_seq"]
    for index in range(decided // ROUND, 4):
        serve_round(server, problems, index)
    grpo = cfg.live.model_copy(
        update={
            "algorithm": "grpo",
            "group_size": 8,
            "max_tokens": 24,
            "epochs": 1,
            "batch_size": 3,
            "dir": str(Path(cfg.live_dir()).with_name("live-grpo")),
        }
    )
    updater = LiveUpdater(
        cfg.model_copy(update={"live": grpo}), server["prepared"].settings.model_dir, controller
    )
    try:
        records = updater.poll()
    finally:
        updater.close()
    assert [r["round"] for r in records] == [0, 1, 2, 3]
    assert all(r["prompts"] == ROUND // 2 and r["samples"] == 8 * ROUND // 2 for r in records)
    assert all(0 <= r["reward_mean"] <= 1 for r in records)
    published = [r for r in records if r["policy"]]
    assert published and all(r["policy"].startswith(f"live-{r['round']}@") for r in published)
    for r in published:
        assert r["trained_through"] == (r["round"] + 1) * ROUND - 1 < r["boundaries"][STREAM]
    assert ray.get(controller.versions.remote(STREAM))["policy"] == published[-1]["policy"]
