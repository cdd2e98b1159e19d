"""`rlvr calibrate` and `rlvr serve` end to end: the OpenAI client against the running Ray Serve app
on the tiny arithmetic model, bad input, a loopback load test, and a ControllerActor restart.

Each test owns one stream, so every decision is checked against a local CSAController replay.
The served calibration maps raw -> 0.05 + 0.25 raw with grid (0.05, 0.1225, 0.3) at alpha 0.5, so
every score is under the top threshold, which certifies after exactly 12 passed labels:
the first round bets 0, then each pass multiplies the wealth by 1.5, and 11 log 1.5 > log(2*3/0.1).
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from rlvr.algorithms.csa import Calibrator, CSAController, make_grid
from rlvr.config import load_config
from rlvr.serving.api import Calibration, boxed, checkpoint_fingerprint
from rlvr.tasks import load_task
from rlvr.tasks.prompts import prompt_messages
from rlvr.verifiers.extract import extract_answer
from rlvr.verifiers.math import verify_math
from workflows.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
SERVE_TINY = ROOT / "configs" / "serve-tiny.yaml"
STREAMS = ("e2e", "shadow", "bad", "load", "restart")
CERTIFY_AFTER = 12


@pytest.fixture(scope="module")
def sft_model() -> Path:
    """The SFT-warmed tiny model of configs/tiny.yaml (cached after the first build)."""
    from workflows.train import prepare

    return prepare(load_config(TINY))[0]


@pytest.fixture(scope="module")
def problems():
    cfg = load_config(TINY)
    return load_task(cfg.task)[1], cfg.task.instruction


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_rejects_bad_serve_config_before_starting(capsys, tmp_path):
    assert main(["serve", "--config", str(SERVE_TINY), "--set", "http.bogus=1"]) == 2
    assert "http.bogus: unknown key" in capsys.readouterr().err
    missing = f"model.path={tmp_path / 'nope'}"
    assert main(["serve", "--config", str(SERVE_TINY), "--set", missing]) == 2
    assert "model.path" in capsys.readouterr().err
    assert main(["calibrate", "--checkpoint", "tiny", "--data", str(tmp_path / "x.jsonl")]) == 2
    assert "--data" in capsys.readouterr().err


def test_calibrate_writes_map_and_grid_that_serve_accepts(sft_model, tmp_path, capsys):
    from rlvr.serving.config import load_serve_config
    from workflows.serve import prepare_serve

    out = tmp_path / "cal.json"
    argv = ["calibrate", "--checkpoint", str(sft_model), "--data", str(TINY), "--backend", "hf"]
    argv += ["--k", "4", "--max-tokens", "24", "--max-model-len", "256", "--cal-fraction", "0.25"]
    argv += ["--out", str(out), "--m", "6", "--alpha", "0.3", "0.5"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads(out.read_text())
    cal = Calibration.load(out)
    assert printed["path"] == str(out) and printed["version"] == cal.version
    # 25% of the 64 held-out problems, K = 4: raw scores are multiples of 1/4.
    assert saved["n_cal"] == 16 and len(cal.problem_ids) == 16
    assert set(cal.raw_scores) <= {0.0, 0.25, 0.5, 0.75, 1.0}
    assert saved["accuracy"] == sum(cal.passed) / 16
    refit = Calibrator.fit(cal.raw_scores, cal.passed)
    assert cal.calibrator.to_dict() == refit.to_dict()
    for alpha in ("0.3", "0.5"):
        try:
            expected = make_grid(refit(cal.raw_scores), float(alpha), 6).tolist()
        except ValueError as err:
            expected = {"error": str(err)}
        assert saved["grids"][alpha] == expected
    assert cal.checkpoint == checkpoint_fingerprint(sft_model)
    assert (cal.k, cal.temperature, cal.max_tokens) == (4, 0.7, 24)

    cfg = load_serve_config(
        SERVE_TINY,
        [f"model.path={sft_model}", f"csa.calibration={out}", "csa.streams.0.alpha=0.5"],
    )
    prepared = prepare_serve(cfg)
    assert prepared.specs["default"].grid == tuple(cal.grid(0.5, m=15).tolist())
    assert prepared.scorer == cal.version and prepared.policy == cal.checkpoint


def test_adapter_is_merged_once_into_the_served_weights(tmp_path, monkeypatch):
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from rlvr.models import resolve_model_path
    from workflows.calibrate import with_adapter

    base_dir = resolve_model_path("tiny")
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "cache"))
    # init_lora_weights=False starts B away from 0, so the adapter changes the outputs.
    lora = peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
    adapted = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), lora)
    adapted.save_pretrained(tmp_path / "adapter")
    merged_dir = with_adapter(base_dir, str(tmp_path / "adapter"))
    assert merged_dir.parent == tmp_path / "cache" / "models"
    assert with_adapter(base_dir, str(tmp_path / "adapter")) == merged_dir  # cached
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = adapted.eval()(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged_dir).eval()(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base_dir).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not torch.allclose(plain, want, atol=1e-4)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        with_adapter(base_dir, str(tmp_path))


# --------------------------------------------------------------------------- the running server


@pytest.fixture(scope="module")
def server(ray_cluster, sft_model, tmp_path_factory):
    """The app on a free loopback port: 2 replicas sharing 5 streams through one ControllerActor."""
    from ray import serve

    from rlvr.serving.config import load_serve_config
    from workflows.serve import prepare_serve, start_serving

    tmp = tmp_path_factory.mktemp("serve")
    cal = Calibration(
        calibrator=Calibrator([0.0, 1.0], [0.05, 0.3]),
        raw_scores=[0.0] * 10 + [1.0] * 10,
        passed=[True] * 10 + [False] * 10,
        k=4,
        temperature=0.7,
        top_p=1.0,
        max_tokens=16,
    )
    cal.save(tmp / "cal.json")
    port = free_port()
    spec = yaml.safe_load(SERVE_TINY.read_text())
    spec["name"] = "serve-test"
    spec["model"]["path"] = str(sft_model)
    spec["generation"]["backend"] = "hf"
    spec["csa"] = {
        "calibration": str(tmp / "cal.json"),
        "state_dir": str(tmp / "state"),
        "streams": [{"name": n, "alpha": 0.5, "m": 3} for n in STREAMS],
    }
    spec["http"]["port"] = port
    spec["replicas"] = {"num_replicas": 2, "cpus": 0, "max_ongoing_requests": 8}
    (tmp / "serve.yaml").write_text(yaml.safe_dump(spec))
    cfg = load_serve_config(tmp / "serve.yaml")
    prepared = prepare_serve(cfg)
    assert prepared.specs["e2e"].grid == pytest.approx((0.05, math.sqrt(0.05 * 0.3), 0.3))
    controller = start_serving(cfg, prepared)
    url = f"http://127.0.0.1:{port}"
    yield {
        "url": url,
        "cfg": cfg,
        "prepared": prepared,
        "controller": controller,
        "calibration": cal,
        "model": prepared.settings.served_name,
        "state_dir": tmp / "state",
    }
    serve.shutdown()
    ray_cluster.kill(controller, no_restart=True)


def replay(server, stream: str) -> CSAController:
    """A local controller with the stream's spec and versions, to replay its rounds."""
    ctrl = server["prepared"].specs[stream].controller()
    ctrl.switch_versions(policy=server["prepared"].policy, scorer=server["prepared"].scorer)
    return ctrl


def remote_state(server, stream: str) -> dict:
    import ray

    return ray.get(server["controller"].csa_state.remote(stream))


def feedback(url: str, seq: int, passed: bool, stream: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/feedback", json={"seq": seq, "passed": passed, "stream": stream}, timeout=30
    )


def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key="unused", max_retries=0)


@pytest.mark.ray
def test_openai_client_end_to_end(server, problems):
    client = openai_client(server)
    assert [m.id for m in client.models.list().data] == [server["model"]]
    cal, local = server["calibration"], replay(server, "e2e")
    tasks, instruction = problems
    for i in range(CERTIFY_AFTER + 2):
        messages = prompt_messages(tasks[i], instruction)
        if i % 2 == 0:
            resp = client.chat.completions.create(
                model=server["model"],
                messages=messages,
                seed=i,
                max_tokens=16,
                metadata={"csa_stream": "e2e"},
            )
            content = resp.choices[0].message.content
        else:
            resp = client.completions.create(
                model=server["model"],
                prompt=messages[0]["content"],
                seed=i,
                extra_body={"metadata": {"csa_stream": "e2e"}},
            )
            content = resp.choices[0].text
        csa = resp.csa
        assert csa["score"] == cal.score(csa["raw_score"]) and csa["k"] == 4
        assert csa["raw_score"] in (0.0, 0.25, 0.5, 0.75, 1.0)
        decision = local.decide(csa["score"])
        assert (csa["seq"], csa["released"], csa["threshold"]) == tuple(decision)
        assert csa["stream"] == "e2e" and csa["verification"] == "feedback"
        assert csa["versions"] == {
            "policy": server["prepared"].policy,
            "scorer": server["prepared"].scorer,
        }
        # Nothing is certified before 12 passed labels; then the top threshold 0.3 releases all.
        assert csa["released"] == (i >= CERTIFY_AFTER)
        if csa["released"]:
            # The released text is a sample carrying the majority answer.
            assert csa["threshold"] == 0.3 and extract_answer(content) == csa["answer"]
            assert (csa["answer"] is None) == (csa["raw_score"] == 1.0)
        else:
            assert content == server["cfg"].csa.fallback and csa["answer"] is None
        assert resp.usage.prompt_tokens > 0
        r = feedback(server["url"], csa["seq"], True, "e2e")
        assert r.status_code == 200, r.text
        local.observe(csa["seq"], True)
    assert remote_state(server, "e2e")["controller"] == local.state_dict()
    status = httpx.get(f"{server['url']}/v1/csa/status", params={"stream": "e2e"}).json()
    assert status["streams"]["e2e"]["released"] == 2
    assert status["streams"]["e2e"]["certified"] == [0.3]


@pytest.mark.ray
def test_shadow_verification_labels_every_round(server, problems):
    url, local = server["url"], replay(server, "shadow")
    client = openai_client(server)
    tasks, instruction = problems
    labels = {}
    seqs = []
    for i in range(CERTIFY_AFTER + 6):
        shadow = i >= CERTIFY_AFTER
        # The last request carries a wrong reference: its label must be a failure.
        reference = tasks[i].answer if i < CERTIFY_AFTER + 5 else "-987654"
        meta = {"csa_stream": "shadow"} | ({"reference": reference} if shadow else {})
        resp = client.chat.completions.create(
            model=server["model"],
            messages=prompt_messages(tasks[i], instruction),
            seed=100 + i,
            metadata=meta,
        )
        csa = resp.csa
        assert tuple(local.decide(csa["score"])) == (csa["seq"], csa["released"], csa["threshold"])
        seqs.append(csa["seq"])
        if not shadow:
            assert feedback(url, csa["seq"], True, "shadow").status_code == 200
            local.observe(csa["seq"], True)
            continue
        # Certified by now, so the majority answer is visible and we know what was verified.
        assert csa["released"] and csa["verification"] == "shadow"
        answer = csa["answer"]
        labels[csa["seq"]] = answer is not None and verify_math(boxed(answer), reference)[1] == (
            "correct"
        )
    assert labels[seqs[-1]] is False
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/v1/csa/status?stream=shadow").json()["streams"]["shadow"][
        "applied"
    ] < len(seqs):
        assert time.monotonic() < deadline, "shadow labels were not applied"
        time.sleep(0.2)
    for seq, passed in labels.items():
        local.observe(seq, passed)
    assert remote_state(server, "shadow")["controller"] == local.state_dict()
    # A shadow-labelled round is closed: late feedback is refused and changes nothing.
    r = feedback(url, seqs[-1], True, "shadow")
    assert r.status_code == 409 and r.json()["error"]["code"] == "already_labelled"
    assert remote_state(server, "shadow")["controller"] == local.state_dict()


def bad_requests(server) -> list[tuple[str, str, dict, int]]:
    """(method, path, httpx kwargs, expected status) for every kind of bad input."""
    model = server["model"]
    msgs = [{"role": "user", "content": "1+1?"}]
    chat = {"model": model, "messages": msgs, "metadata": {"csa_stream": "bad"}}
    big = json.dumps(chat | {"messages": [{"role": "user", "content": "x" * 70000}]})
    chunks = [big[i : i + 8192].encode() for i in range(0, len(big), 8192)]
    cc, cp, fb = "/v1/chat/completions", "/v1/completions", "/v1/feedback"
    as_json = {"content-type": "application/json"}
    text = json.dumps(chat)
    return [
        ("POST", cc, {"content": b"{not json", "headers": as_json}, 400),
        ("POST", cc, {"content": b"[1, 2]", "headers": as_json}, 400),
        # once 500s: a lone surrogate, an integer past int()'s digits, nesting past the parser
        (
            "POST",
            cc,
            {"content": text.replace("1+1?", "\\ud800").encode(), "headers": as_json},
            400,
        ),
        (
            "POST",
            cc,
            {
                "content": text[:-1].encode() + b', "seed": ' + b"9" * 5001 + b"}",
                "headers": as_json,
            },
            400,
        ),
        (
            "POST",
            cc,
            {"content": b'{"metadata": ' + b"[" * 30000 + b"]" * 30000 + b"}", "headers": as_json},
            400,
        ),
        # a browser's cross-site post without a preflight, and no type at all
        ("POST", cc, {"content": text.encode(), "headers": {"content-type": "text/plain"}}, 415),
        ("POST", fb, {"data": {"seq": "0", "passed": "true", "stream": "bad"}}, 415),
        ("POST", cc, {"content": text.encode()}, 415),
        ("GET", "/docs", {}, 404),
        ("GET", "/openapi.json", {}, 404),
        ("POST", cc, {"json": {"model": model}}, 400),
        ("POST", cc, {"json": chat | {"messages": "hi"}}, 400),
        ("POST", cc, {"json": chat | {"messages": []}}, 400),
        ("POST", cc, {"json": chat | {"max_tokens": "16"}}, 400),
        ("POST", cc, {"json": chat | {"max_tokens": 10**9}}, 400),
        ("POST", cc, {"json": chat | {"max_tokens": 0}}, 400),
        ("POST", cc, {"json": chat | {"n": 50}}, 400),
        ("POST", cc, {"json": chat | {"stream": True}}, 400),
        ("POST", cc, {"json": chat | {"temperature": "hot"}}, 400),
        ("POST", cc, {"json": chat | {"model": "gpt-x"}}, 404),
        ("POST", cc, {"json": chat | {"metadata": {"csa_stream": "nope"}}}, 404),
        ("POST", cc, {"content": big.encode(), "headers": as_json}, 413),
        ("POST", cc, {"content": iter(chunks), "headers": as_json}, 413),
        ("POST", cp, {"json": {"model": model, "prompt": 5}}, 400),
        ("POST", cp, {"json": {"model": model, "prompt": ["a", "b"]}}, 400),
        ("POST", fb, {"json": {}}, 400),
        ("POST", fb, {"json": {"seq": "0", "passed": True, "stream": "bad"}}, 400),
        ("POST", fb, {"json": {"seq": 0, "passed": "yes", "stream": "bad"}}, 400),
        ("POST", fb, {"json": {"seq": -1, "passed": True, "stream": "bad"}}, 400),
        ("POST", fb, {"json": {"seq": 0, "passed": True, "stream": "bad", "x": 1}}, 400),
        ("POST", fb, {"json": {"seq": 0, "passed": True, "stream": "nope"}}, 404),
        ("POST", fb, {"json": {"seq": 999, "passed": True, "stream": "bad"}}, 404),
        ("POST", fb, {"json": {"seq": 0, "passed": False, "stream": "bad"}}, 409),
        ("GET", "/v1/csa/status?stream=nope", {}, 404),
        ("GET", "/v1/nothing", {}, 404),
        ("GET", cc, {}, 405),
    ]


@pytest.mark.ray
def test_bad_input_is_4xx_json_and_changes_nothing(server):
    import openai

    url = server["url"]
    client = openai_client(server)
    raw = client.chat.completions.with_raw_response.create(
        model=server["model"],
        messages=[{"role": "user", "content": "2+2?"}],
        metadata={"csa_stream": "bad"},
    )
    # The replica reports its phases: generating the K samples, voting, the gate's decide call.
    phases = dict(p.strip().split(";dur=") for p in raw.headers["server-timing"].split(","))
    assert list(phases) == ["generate", "vote", "gate"]
    assert all(float(ms) > 0 for ms in phases.values())
    assert float(phases["generate"]) > float(phases["vote"])
    resp = raw.parse()
    assert feedback(url, resp.csa["seq"], True, "bad").status_code == 200
    before = {s: remote_state(server, s) for s in STREAMS}
    files = {p.name: p.read_bytes() for p in server["state_dir"].iterdir()}
    with httpx.Client(base_url=url, timeout=30) as http:
        for method, path, kwargs, status in bad_requests(server):
            r = http.request(method, path, **kwargs)
            assert r.status_code == status, (path, kwargs.get("json"), r.text)
            body = r.json()
            assert "error" in body or "detail" in body
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(
            model=server["model"], messages=[{"role": "user", "content": "x"}], n=2
        )
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    assert {s: remote_state(server, s) for s in STREAMS} == before
    assert {p.name: p.read_bytes() for p in server["state_dir"].iterdir()} == files


@pytest.mark.ray
def test_loopback_load_no_5xx_no_lost_or_double_labels(server, problems):
    url = server["url"]
    tasks, instruction = problems
    n_clients, per_client = 6, 8
    results, statuses, errors = [], [], []
    lock = threading.Lock()

    def client_loop(c: int) -> None:
        try:
            client = openai_client(server)
            with httpx.Client(base_url=url, timeout=60) as http:
                for j in range(per_client):
                    i = c * per_client + j
                    resp = client.chat.completions.create(
                        model=server["model"],
                        messages=prompt_messages(tasks[i % len(tasks)], instruction),
                        seed=1000 + i,
                        metadata={"csa_stream": "load"},
                    )
                    seq = resp.csa["seq"]
                    fb = {"seq": seq, "passed": seq % 3 != 0, "stream": "load"}
                    codes = [http.post("/v1/feedback", json=fb).status_code]
                    if seq % 5 == 0:  # a retried label must be refused, not applied twice
                        codes.append(http.post("/v1/feedback", json=fb).status_code)
                    with lock:
                        results.append(resp.csa)
                        statuses.extend(codes)
        except Exception as err:  # surfaced below: a thread cannot fail the test itself
            errors.append(err)

    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    total = n_clients * per_client
    seqs = sorted(r["seq"] for r in results)
    assert seqs == list(range(total))
    duplicates = sum(1 for s in seqs if s % 5 == 0)
    assert sorted(statuses) == [200] * total + [409] * duplicates
    status = httpx.get(f"{url}/v1/csa/status?stream=load").json()["streams"]["load"]
    assert (status["applied"], status["pending"], status["expired"]) == (total, 0, 0)
    # Decisions raced with labels, but the e-processes only see (score, label) in seq order.
    by_seq = {r["seq"]: r for r in results}
    local = replay(server, "load")
    for seq in range(total):
        local.decide(by_seq[seq]["score"])
    for seq in range(total):
        local.observe(seq, seq % 3 != 0)
    mine, theirs = local.state_dict(), remote_state(server, "load")["controller"]
    for key in ("ell", "n", "fails", "cert", "cert_seq", "qi", "next_seq", "applied"):
        assert theirs[key] == mine[key], key
    released = [seq for seq in range(total) if by_seq[seq]["released"]]
    assert theirs["released"] == len(released) == status["released"]
    assert theirs["released_fails"] == sum(1 for seq in released if seq % 3 == 0)


def getpid(actor) -> int:
    """Run inside the actor by __ray_call__: its process id."""
    import os

    return os.getpid()


@pytest.mark.ray
def test_controller_restart_restores_the_stream_exactly(server):
    import ray

    url, controller = server["url"], server["controller"]
    local = replay(server, "restart")
    with httpx.Client(base_url=url, timeout=60) as http:
        body = {
            "model": server["model"],
            "messages": [{"role": "user", "content": "5+3?"}],
            "metadata": {"csa_stream": "restart"},
        }
        for i in range(6):
            csa = http.post("/v1/chat/completions", json=body | {"seed": i}).json()["csa"]
            assert tuple(local.decide(csa["score"])) == (csa["seq"], csa["released"], None)
        # Mid-stream: seqs 1 and 4 stay open, 2-3 and 5 wait in the reorder buffer.
        for seq in (0, 2, 3, 5):
            assert feedback(url, seq, seq != 3, "restart").status_code == 200
            local.observe(seq, seq != 3)
        # One more decision after the last label: it lives only in the journal, not the snapshot.
        csa = http.post("/v1/chat/completions", json=body | {"seed": 6}).json()["csa"]
        assert tuple(local.decide(csa["score"])) == (6, csa["released"], None)
        before = remote_state(server, "restart")
        assert before["controller"] == local.state_dict()
        assert [seq for seq, _ in before["decided_at"]] == [1, 2, 3, 4, 5, 6]
        others = {s: remote_state(server, s) for s in STREAMS if s != "restart"}
        pid = ray.get(controller.__ray_call__.remote(getpid))

        ray.kill(controller, no_restart=False)
        # The kill is asynchronous: wait until a new process answers.
        deadline = time.monotonic() + 60
        new_pid = pid
        while new_pid == pid:
            assert time.monotonic() < deadline, "the ControllerActor did not come back"
            try:
                new_pid = ray.get(controller.__ray_call__.remote(getpid), timeout=10)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                time.sleep(0.2)
        after = remote_state(server, "restart")
        assert after == before
        assert {s: remote_state(server, s) for s in STREAMS if s != "restart"} == others

        # The stream goes on where it was: the open rounds take their labels, seqs continue.
        for seq in (1, 4, 6):
            assert feedback(url, seq, True, "restart").status_code == 200
            local.observe(seq, True)
        csa = http.post("/v1/chat/completions", json=body | {"seed": 9}).json()["csa"]
        assert tuple(local.decide(csa["score"])) == (csa["seq"], csa["released"], None)
        assert csa["seq"] == 7
    assert remote_state(server, "restart")["controller"] == local.state_dict()
