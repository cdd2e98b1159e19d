"""`rlvr calibrate` and `rlvr serve` end to end: the OpenAI client against the running Ray Serve app
on the tiny arithmetic model, bad input, a loopback load test, and a StreamsActor restart.

Each test owns one stream, so every decision is checked against a local CSAController replay.
The served calibration maps raw -> 0.05 + 0.25 raw with grid (0.05, 0.1225, 0.3) at alpha 0.5, so
every score is under the top threshold, which certifies after exactly 12 passed labels:
the first round bets 0, then each pass multiplies the wealth by 1.5, and 11 log 1.5 > log(2*3/0.1).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from rlvr.algorithms.csa import Calibrator, CSAController, make_grid
from rlvr.answers import extract_answer
from rlvr.models.checkpoints import checkpoint_fingerprint
from rlvr.serving.api import Calibration, boxed
from rlvr.serving.fuzz import CATEGORIES, Credentials, fuzz_cases, tally
from rlvr.tasks.prompts import prompt_messages
from rlvr.verifiers.math import verify_math
from tests.integration.bounds import HANG_S
from workflows.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
SERVE_TINY = ROOT / "configs" / "serve-tiny.yaml"
STREAMS = ("e2e", "shadow", "bad", "load", "restart", "busy", "crowd", "fuzz", "kill")
CERTIFY_AFTER = 12
CLIENT_KEY = "client-key-for-the-tests-0001"
OPERATOR_KEY = "operator-key-for-the-tests-0001"
CLIENT = {"authorization": f"Bearer {CLIENT_KEY}"}
OPERATOR = {"authorization": f"Bearer {OPERATOR_KEY}"}


def save_small_calibration(path: Path) -> None:
    """A two-point calibration of K=2 samples of 8 tokens, for a server started to check its
    process, not its decisions."""
    Calibration(
        calibrator=Calibrator([0.0, 1.0], [0.05, 0.3]),
        raw_scores=[0.0, 1.0],
        passed=[True, False],
        k=2,
        temperature=0.7,
        top_p=1.0,
        max_tokens=8,
    ).save(path)


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
        [
            f"model.path={sft_model}",
            f"csa.calibration={out}",
            "csa.streams.0.alpha=0.5",
            f"csa.state_dir={tmp_path / 'state'}",
        ],
    )
    prepared = prepare_serve(cfg)
    assert prepared.specs["default"].grid == tuple(cal.grid(0.5, m=15).tolist())
    assert prepared.scorer == cal.version and prepared.policy == cal.checkpoint


def test_adapter_is_merged_once_into_the_served_weights(tmp_path, monkeypatch):
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from rlvr.models import resolve_model_path
    from rlvr.models.checkpoints import with_adapter

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
def server(ray_cluster, sft_model, fixed_calibration, tmp_path_factory, pick_free_ports):
    """The app on a free loopback port: 2 replicas sharing 5 streams through one StreamsActor."""
    from ray import serve

    from rlvr.serving.config import load_serve_config
    from workflows.serve import prepare_serve, start_serving

    tmp = tmp_path_factory.mktemp("serve")
    cal = fixed_calibration
    cal.save(tmp / "cal.json")
    (port,) = pick_free_ports(1)
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
    spec["http"]["api_keys"] = [CLIENT_KEY]
    (tmp / "operator.key").write_text(OPERATOR_KEY + "\n")
    spec["http"]["operator_key_file"] = str(tmp / "operator.key")
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

    return ray.get(server["controller"].state.remote(stream))


def feedback(url: str, seq: int, passed: bool, stream: str) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/feedback",
        json={"seq": seq, "passed": passed, "stream": stream},
        headers=OPERATOR,
        timeout=30,
    )


def csa_status(url: str, stream: str) -> dict:
    r = httpx.get(f"{url}/v1/csa/status", params={"stream": stream}, headers=OPERATOR, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["streams"][stream]


def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key=CLIENT_KEY, max_retries=0)


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
    status = csa_status(server["url"], "e2e")
    assert status["released"] == 2
    assert status["certified"] == [0.3]


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
    deadline = time.monotonic() + HANG_S
    while csa_status(url, "shadow")["applied"] < len(seqs):
        assert time.monotonic() < deadline, "shadow labels were not applied"
        time.sleep(0.2)
    for seq, passed in labels.items():
        local.observe(seq, passed)
    assert remote_state(server, "shadow")["controller"] == local.state_dict()
    # A shadow-labelled round is closed: late feedback is refused and changes nothing.
    r = feedback(url, seqs[-1], True, "shadow")
    assert r.status_code == 409 and r.json()["error"]["code"] == "already_labelled"
    assert remote_state(server, "shadow")["controller"] == local.state_dict()
    # Every applied round left one audit line, naming who labelled it.
    lines = (server["state_dir"] / "shadow.audit.jsonl").read_text().splitlines()
    audit = [json.loads(line) for line in lines]
    assert [r["seq"] for r in audit] == seqs
    assert [r["source"] for r in audit] == ["feedback"] * CERTIFY_AFTER + ["shadow"] * 6
    assert [r["label"] for r in audit[CERTIFY_AFTER:]] == [
        "pass" if labels[seq] else "fail" for seq in seqs[CERTIFY_AFTER:]
    ]


@pytest.mark.ray
def test_feedback_cannot_preempt_the_shadow_verifier(server, problems):
    """A round decided for shadow verification takes only the verifier's label: feedback that
    races it is refused, whether it comes before or after the verifier's label is applied."""
    url = server["url"]
    client = openai_client(server)
    tasks, instruction = problems
    resp = client.chat.completions.create(
        model=server["model"],
        messages=prompt_messages(tasks[0], instruction),
        metadata={"csa_stream": "busy", "reference": tasks[0].answer},
    )
    seq = resp.csa["seq"]
    r = feedback(url, seq, True, "busy")
    assert r.status_code == 409
    assert r.json()["error"]["code"] in ("label_source_fixed", "already_labelled")
    deadline = time.monotonic() + HANG_S
    while csa_status(url, "busy")["pending"]:
        assert time.monotonic() < deadline, "the shadow label was not applied"
        time.sleep(0.2)
    line = json.loads((server["state_dir"] / "busy.audit.jsonl").read_text().splitlines()[-1])
    assert (line["seq"], line["source"]) == (seq, "shadow")


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
        # the score has one definition: the calibrated budget, the calibrated prompt form
        ("POST", cc, {"json": chat | {"max_tokens": 8}}, 400),
        ("POST", cc, {"json": chat | {"messages": [{"role": "system", "content": "x"}]}}, 400),
        # credentials: none, made up, a client key where the operator key is needed
        ("POST", cc, {"json": chat, "headers": {"authorization": None}}, 401),
        ("POST", cc, {"json": chat, "headers": {"authorization": "Bearer made-up-key-0001"}}, 401),
        ("GET", "/v1/models", {"headers": {"authorization": None}}, 401),
        (
            "POST",
            fb,
            {"json": {"seq": 0, "passed": False, "stream": "bad"}, "headers": CLIENT},
            403,
        ),
        (
            "POST",
            fb,
            {
                "json": {"seq": 0, "passed": False, "stream": "bad"},
                "headers": {"authorization": None},
            },
            401,
        ),
        ("GET", "/v1/csa/status", {"headers": CLIENT}, 403),
        # a page on another origin that rebinds its own name to 127.0.0.1
        ("POST", cc, {"json": chat, "headers": {"host": "evil.example"}}, 403),
        ("GET", "/v1/csa/status", {"headers": {"host": "evil.example:8000"}}, 403),
        # a Host that is not a host and a port: nothing after the host is dropped unread
        ("POST", cc, {"json": chat, "headers": {"host": "localhost:evil.example"}}, 400),
        ("GET", "/v1/models", {"headers": {"host": "localhost:8000@evil.example"}}, 400),
        ("GET", "/v1/csa/status", {"headers": {"host": "127.0.0.1:x"}}, 400),
        ("GET", "/nope", {"headers": {"host": "[::1]evil.example"}}, 400),
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
            # The operator key unless the row sends other credentials (None: none at all).
            headers = {k: v for k, v in (OPERATOR | kwargs.get("headers", {})).items() if v}
            r = http.request(method, path, **(kwargs | {"headers": headers}))
            assert r.status_code == status, (path, kwargs.get("json"), r.text)
            assert set(r.json()) == {"error"}, (path, r.text)  # one error shape for every path
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(
            model=server["model"], messages=[{"role": "user", "content": "x"}], n=2
        )
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    tool = {"type": "function", "function": {"name": "calculate", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="not served behind the CSA gate") as info:
        client.chat.completions.create(
            model=server["model"], messages=[{"role": "user", "content": "x"}], tools=[tool]
        )
    assert info.value.body["code"] == "tools_not_certified" and info.value.body["param"] == "tools"
    assert {s: remote_state(server, s) for s in STREAMS} == before
    assert {p.name: p.read_bytes() for p in server["state_dir"].iterdir()} == files


@pytest.mark.ray
def test_every_path_asks_for_the_key_and_answers_in_one_error_shape(server):
    """Through Serve's proxy: without a key every path, served or not, Serve's own route listing
    and health check included, is a 401 (so routes cannot be enumerated); with a client key what
    is not served is a 404 or 405 (a trailing slash is not redirected), the route listing needs
    the operator key, and the health check answers."""
    unserved = [
        ("GET", "/nope"),
        ("GET", "/v1/models/"),
        ("GET", "/v1/chat/completions"),
        ("PUT", "/v1/feedback"),
        ("GET", "/-/routes"),
        ("GET", "/-/healthz"),
    ]
    with httpx.Client(base_url=server["url"], timeout=30, follow_redirects=False) as http:
        for method, path in unserved:
            r = http.request(method, path)
            assert r.status_code == 401, (method, path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == 'Bearer realm="rlvr"'
        for path, status, code in [
            ("/nope", 404, "not_found"),
            ("/v1/models/", 404, "not_found"),
            ("/-/routes", 403, "operator_key_required"),
        ]:
            r = http.get(path, headers=CLIENT)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
        wrong = http.get("/v1/chat/completions", headers=CLIENT)
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        assert set(wrong.json()) == {"error"}
        assert http.get("/-/routes", headers=OPERATOR).json() == {"/": "rlvr-csa"}
        health = http.get("/-/healthz", headers=CLIENT)
        assert (health.status_code, health.text) == (200, "success")


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
            with httpx.Client(base_url=url, timeout=60, headers=OPERATOR) as http:
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
    status = csa_status(url, "load")
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
    with httpx.Client(base_url=url, timeout=60, headers=CLIENT) as http:
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
        assert [seq for seq, *_ in before["rounds"]] == [1, 2, 3, 4, 5, 6]
        others = {s: remote_state(server, s) for s in STREAMS if s != "restart"}
        pid = ray.get(controller.__ray_call__.remote(getpid))

        ray.kill(controller, no_restart=False)
        # The kill is asynchronous: wait until a new process answers.
        deadline = time.monotonic() + HANG_S
        new_pid = pid
        while new_pid == pid:
            assert time.monotonic() < deadline, "the StreamsActor did not come back"
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


@pytest.mark.ray
def test_a_full_replica_answers_429_with_retry_after(server, problems):
    """More concurrent completions than the replicas hold: the excess gets a JSON 429 with
    Retry-After at once, the rest are answered, and every decided round is accounted for."""
    url = server["url"]
    tasks, instruction = problems
    n = 48  # 2 replicas hold 8 each; Serve routes up to 16 each
    barrier = threading.Barrier(n)
    answers: list[tuple[int, dict, dict]] = []

    def one(i: int) -> None:
        body = {
            "model": server["model"],
            "messages": prompt_messages(tasks[i % len(tasks)], instruction),
            "seed": i,
            "metadata": {"csa_stream": "crowd"},
        }
        barrier.wait()
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=CLIENT, timeout=120)
        answers.append((r.status_code, dict(r.headers), r.json()))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    codes = sorted(code for code, _, _ in answers)
    assert len(codes) == n and set(codes) <= {200, 429}, codes
    busy = [(h, b) for code, h, b in answers if code == 429]
    assert busy, "no request was refused: the limit did not bind"
    for headers, body in busy:
        assert body["error"]["code"] == "server_busy" and int(headers["retry-after"]) >= 1
    served = sorted(b["csa"]["seq"] for code, _, b in answers if code == 200)
    assert served == list(range(len(served)))  # refused requests took no seq
    assert csa_status(url, "crowd")["decided"] == len(served)


@pytest.mark.ray
def test_seeded_fuzz_is_all_4xx_json_and_changes_nothing(server):
    """A bounded slice of bench/serve_load.py's fuzz run: 20 seeded cases per category."""
    url = server["url"]
    creds = Credentials(
        client_key=CLIENT_KEY,
        operator_key=OPERATOR_KEY,
        model=server["model"],
        stream="fuzz",
        max_body_bytes=server["cfg"].http.max_body_bytes,
        max_tokens=server["calibration"].max_tokens,
    )
    cases = fuzz_cases(20 * len(CATEGORIES), creds, seed=0)
    before = {s: remote_state(server, s) for s in STREAMS}
    files = {p.name: p.read_bytes() for p in server["state_dir"].iterdir()}
    results, not_json = [], []
    with httpx.Client(base_url=url, timeout=30) as http:
        for case in cases:
            r = http.request(case.method, case.path, content=case.body, headers=case.headers)
            results.append((case.category, r.status_code))
            try:
                r.json()
            except ValueError:
                not_json.append((case.category, r.status_code, r.text[:80]))
        table = tally(results)
        assert all(set(row) == {"4xx"} for row in table.values()), table
        assert not not_json, not_json[:5]
        # Still healthy: a valid request is answered.
        ok = http.post(CHAT_PATH, json=valid_chat(server, "fuzz"), headers=CLIENT)
        assert ok.status_code == 200, ok.text
    after = {s: remote_state(server, s) for s in STREAMS}
    assert {s: after[s] for s in STREAMS if s != "fuzz"} == {
        s: before[s] for s in STREAMS if s != "fuzz"
    }
    assert after["fuzz"]["controller"]["next_seq"] == before["fuzz"]["controller"]["next_seq"] + 1
    assert {
        p.name: p.read_bytes() for p in server["state_dir"].iterdir() if "fuzz" not in p.name
    } == {k: v for k, v in files.items() if "fuzz" not in k}


CHAT_PATH = "/v1/chat/completions"


def valid_chat(server, stream: str, seed: int = 0) -> dict:
    return {
        "model": server["model"],
        "messages": [{"role": "user", "content": "3+4?"}],
        "seed": seed,
        "metadata": {"csa_stream": stream},
    }


def replica_handles():
    import ray

    names = [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith("SERVE_REPLICA::") and "CSAServer" in a["name"]
    ]
    return [(a["name"], ray.get_actor(a["name"], namespace=a["namespace"])) for a in names]


@pytest.mark.ray
def test_a_replica_killed_under_load_leaves_the_streams_intact(server):
    """Clients post completions and label each answer while one replica is SIGKILLed: requests
    it held fail (5xx from the proxy), Serve starts a replacement, and the stream's state is
    exactly the labels the clients applied, each once; rounds whose answer was lost stay open
    for their timeout."""
    import ray

    url = server["url"]
    replicas = replica_handles()
    assert len(replicas) == 2
    answers, statuses = [], []
    lock = threading.Lock()
    stop = threading.Event()

    def client(c: int) -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            for j in range(12):
                if stop.is_set():
                    return
                r = http.post(
                    CHAT_PATH, json=valid_chat(server, "kill", 100 * c + j), headers=CLIENT
                )
                with lock:
                    statuses.append(r.status_code)
                if r.status_code != 200:
                    continue
                seq = r.json()["csa"]["seq"]
                body = {"seq": seq, "passed": True, "stream": "kill"}
                for attempt in range(5):  # a label sent to the dying replica is sent again
                    fb = http.post("/v1/feedback", json=body, headers=OPERATOR)
                    if fb.status_code < 500:
                        break
                    time.sleep(0.2 * 2**attempt)
                with lock:
                    answers.append((seq, fb.status_code))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(3)]
    for t in threads:
        t.start()
    while len(answers) < 4:
        time.sleep(0.05)
    name, victim = replicas[0]
    ray.kill(victim, no_restart=True)
    for t in threads:
        t.join(timeout=300)
    assert len(statuses) == 36
    failed = [code for code in statuses if code != 200]
    assert all(code >= 500 for code in failed), statuses
    # Every answer that reached its client took its label, once (409: a retried label whose
    # first post got in before its replica died).
    assert {code for _, code in answers} <= {200, 409}, answers
    labelled = {seq for seq, _ in answers}
    state = remote_state(server, "kill")["controller"]
    decided = state["next_seq"] - state["first_seq"]
    waiting = {seq for seq, *_ in state["labels"]}
    # Applied rounds and labels waiting behind a lost round are exactly the clients' labels ...
    assert state["applied"] + len(waiting) == len(labelled) and waiting <= labelled
    # ... and the rounds still open are those whose answer died with the replica.
    lost = {seq for seq, *_ in state["pending"]} - waiting
    assert not lost & labelled and len(lost) == decided - len(labelled) <= len(failed)
    # Serve replaces the replica; the deployment answers again.
    deadline = time.monotonic() + HANG_S
    while len(names := {n for n, _ in replica_handles()}) < 2 or name in names:
        assert time.monotonic() < deadline, "Serve did not replace the replica"
        time.sleep(0.5)
    with httpx.Client(base_url=url, timeout=60) as http:
        for i in range(4):
            r = http.post(CHAT_PATH, json=valid_chat(server, "kill", 1000 + i), headers=CLIENT)
            assert r.status_code == 200, r.text


def driver_stacks(pid: int) -> str:
    """Every thread's stack in a hung driver (py-spy, which Ray's default extras install), or
    why none could be taken."""
    spy = Path(sys.executable).with_name("py-spy")
    try:
        done = subprocess.run(
            [str(spy), "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"(no stacks: {err})"
    return done.stdout + done.stderr


def test_rlvr_serve_runs_until_interrupted(sft_model, tmp_path, run_cli, pick_free_ports):
    """`rlvr serve` as a user starts it, with live updates on, client keys and an open health
    check: it serves, prints where the operator key and the live adapters are, opens
    /v1/csa/status only to that key and /-/healthz to anyone, and shuts down cleanly on Ctrl-C
    (the updater's policy rank too)."""
    import signal

    save_small_calibration(tmp_path / "cal.json")
    (port,) = pick_free_ports(1)
    sets = [
        f"model.path={sft_model}",
        f"csa.calibration={tmp_path / 'cal.json'}",
        f"csa.state_dir={tmp_path / 'state'}",
        "csa.streams.0.alpha=0.5",
        "generation.backend=hf",
        f"http.port={port}",
        "replicas.cpus=0",
        "live.enabled=true",
        "live.cpus=0",
        f"live.dir={tmp_path / 'live'}",
        f"http.api_keys=[{CLIENT_KEY}]",
        "http.open_health_check=true",
    ]
    proc = run_cli(["serve", "--config", str(SERVE_TINY), *[f"--set={s}" for s in sets]])
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 3 * HANG_S
        while not any(line.startswith("live updates: ") for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-4000:]
            time.sleep(0.2)
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=CLIENT, timeout=30).status_code == 200
        # A load balancer's probe needs no key; the route listing still does.
        assert httpx.get(f"{url}/-/healthz", timeout=30).text == "success"
        assert httpx.get(f"{url}/-/routes", timeout=30).status_code == 401
        key = (tmp_path / "state" / "operator.key").read_text().strip()
        assert httpx.get(f"{url}/v1/csa/status", timeout=30).status_code == 401
        status = httpx.get(
            f"{url}/v1/csa/status", headers={"authorization": f"Bearer {key}"}, timeout=30
        )
        assert status.status_code == 200 and "default" in status.json()["streams"]
    finally:
        proc.send_signal(signal.SIGINT)
        # The exit takes seconds; the bound catches a hang (seen beside a pytest-xdist worker),
        # and then the driver's own output says where it was.
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            stacks = driver_stacks(proc.pid)
            proc.kill()
            reader.join(timeout=30)
            raise AssertionError(
                f"rlvr serve outlived its SIGINT:\n{''.join(lines)[-4000:]}\n{stacks}"
            ) from None
        reader.join(timeout=30)
    log = "".join(lines)
    assert proc.returncode == 0, log[-4000:]
    assert f"operator key for /v1/feedback and /v1/csa/status: {tmp_path / 'state'}" in log
    assert f"every 100 rounds of stream default (adapters in {tmp_path / 'live'})" in log
    assert (tmp_path / "live" / "versions").is_dir()


@pytest.mark.ray
def test_a_background_deployment_serves_until_stopped(
    sft_model, tmp_path, pick_free_ports, driver_env
):
    """`rlvr.serve(..., background=True)` in a driver of its own (a notebook's kernel): it returns
    once the API answers, at its `url`, behind the same keys, and `stop()` ends it."""
    import subprocess
    import sys

    save_small_calibration(tmp_path / "cal.json")
    (port,) = pick_free_ports(1)
    overrides = {
        "model.path": str(sft_model),
        "csa.calibration": str(tmp_path / "cal.json"),
        "csa.state_dir": str(tmp_path / "state"),
        "csa.streams.0.alpha": 0.5,
        "generation.backend": "hf",
        "http.port": port,
        "replicas.cpus": 0,
        "http.api_keys": [CLIENT_KEY],
    }
    script = f"""
import httpx, rlvr
deployment = rlvr.serve({str(SERVE_TINY)!r}, {overrides!r}, background=True)
print("started", repr(deployment))
print("unkeyed", httpx.get(deployment.url + "/models", timeout=30).status_code)
print("keyed", httpx.get(deployment.url + "/models", headers={CLIENT!r}, timeout=30).status_code)
deployment.stop()
print("stopped", repr(deployment))
try:
    httpx.get(deployment.url + "/models", timeout=5)
except httpx.TransportError:
    print("closed")
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    url = f"http://127.0.0.1:{port}/v1"
    assert f"started Deployment('serve-tiny', serving at {url})" in done.stdout
    assert "unkeyed 401" in done.stdout and "keyed 200" in done.stdout
    assert f"stopped Deployment('serve-tiny', stopped at {url})" in done.stdout
    assert "closed" in done.stdout
