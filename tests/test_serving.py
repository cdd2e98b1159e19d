"""Request validation, the self-consistency vote, the calibration artefact and the serve config."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlvr.algorithms.csa import Calibrator, make_grid
from rlvr.config import ConfigError
from rlvr.models.checkpoints import checkpoint_fingerprint
from rlvr.serving.api import (
    ApiError,
    Calibration,
    ChatCompletionRequest,
    CompletionRequest,
    FeedbackRequest,
    boxed,
    check_generation_request,
    completion_body,
    csa_object,
    parse_body,
    vote,
)
from rlvr.serving.config import load_serve_config
from rlvr.tasks.base import Problem
from workflows.calibrate import cal_split

CHAT = {"model": "m", "messages": [{"role": "user", "content": "1+1?"}]}


def api_error(raw: bytes | str, schema=ChatCompletionRequest) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_body(raw.encode() if isinstance(raw, str) else raw, schema)
    return info.value


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ("{not json", None),
        ("[1, 2]", None),
        (b"\xff\xfe", None),
        ('{"model": "m"}', "messages"),
        ('{"model": "m", "messages": "hi"}', "messages"),
        ('{"model": "m", "messages": []}', "messages"),
        ('{"model": "m", "messages": [{"role": "robot", "content": "x"}]}', "messages.0.role"),
        ('{"model": "m", "messages": [{"role": "user", "content": 5}]}', "messages.0.content.str"),
        ('{"model": 3, "messages": [{"role": "user", "content": "x"}]}', "model"),
        (
            '{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "16"}',
            "max_tokens",
        ),
        (
            '{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
            "max_tokens",
        ),
        ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": true}', "n"),
        (
            '{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
            "temperature.float",
        ),
        (
            '{"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": {"reference": 7}}',
            "metadata.reference",
        ),
    ],
)
def test_bad_bodies_are_400_naming_the_field(body, param):
    err = api_error(body)
    assert err.status == 400
    assert err.param == param
    assert err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            '{"model": "m", "messages": [{"role": "user", "content": "\\ud800 hi"}]}',
            "not valid Unicode",
        ),
        ('{"model": "m", "\\udc80": 1}', "not valid Unicode"),
        ('{"model": "m", "max_tokens": ' + "9" * 5001 + "}", "unreadable value"),
        ('{"model": "m", "metadata": ' + "[" * 30000 + "]" * 30000 + "}", "nests too deeply"),
    ],
    ids=["lone surrogate", "surrogate key", "5001-digit integer", "30000-deep nesting"],
)
def test_hostile_bodies_are_400_before_any_field_is_read(body, message):
    """Each of these was a 500 once (a hostile client's fuzz run): JSON that parses into what no
    tokenizer or int() takes, or that the parser cannot descend."""
    err = api_error(body)
    assert err.status == 400 and message in err.body()["error"]["message"]


def test_unused_openai_fields_are_ignored_and_parts_are_joined():
    req = parse_body(
        json.dumps(
            CHAT
            | {
                "user": "u",
                "logprobs": False,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                ],
            }
        ).encode(),
        ChatCompletionRequest,
    )
    assert req.messages[0].text() == "ab"


def test_feedback_is_strict():
    assert parse_body(b'{"seq": 3, "passed": false}', FeedbackRequest) == FeedbackRequest(
        seq=3, passed=False
    )
    for body, param in [
        ("{}", "seq"),
        ('{"seq": "3", "passed": true}', "seq"),
        ('{"seq": 3, "passed": 1}', "passed"),
        ('{"seq": -1, "passed": true}', "seq"),
        ('{"seq": 3, "passed": true, "extra": 1}', "extra"),
    ]:
        assert api_error(body, FeedbackRequest).param == param


def ask(body: dict, cap: int = 32):
    req = ChatCompletionRequest.model_validate(CHAT | body)
    return check_generation_request(req, "m", cap, "default")


def test_generation_request_checks():
    a = ask({"seed": 4, "metadata": {"csa_stream": "s2", "reference": "2"}})
    assert (a.max_tokens, a.seed, a.stream, a.reference) == (32, 4, "s2", "2")
    assert ask({"max_completion_tokens": 32, "max_tokens": 30}).max_tokens == 32
    assert ask({"max_tokens": 32}).max_tokens == 32
    assert ask({"metadata": {"reference": ""}}).reference is None
    for body, status, param in [
        ({"model": "other"}, 404, "model"),
        ({"stream": True}, 400, "stream"),
        ({"n": 2}, 400, "n"),
        ({"max_tokens": 33}, 400, "max_tokens"),
        ({"max_tokens": 8}, 400, "max_tokens"),
        ({"max_completion_tokens": 8, "max_tokens": 32}, 400, "max_tokens"),
        ({"max_tokens": 10**9}, 400, "max_tokens"),
    ]:
        with pytest.raises(ApiError) as info:
            ask(body)
        assert (info.value.status, info.value.param) == (status, param)
    two = CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]})
    with pytest.raises(ApiError, match="one string"):
        check_generation_request(two, "m", 32, "default")


CALC = {"type": "function", "function": {"name": "calculate", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "calculate", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [CALC]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "calculate"}}}, "tool_choice"),
        (
            {
                "messages": [
                    {"role": "user", "content": "2 + 2?"},
                    {"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "c1", "content": "4"},
                ]
            },
            "messages.1.tool_calls",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "4"}]},
            "messages.1.role",
        ),
    ],
)
def test_tool_calling_is_refused_with_the_reason(body, param):
    """The gate certifies final answers; a request for tool calls is a 400 that says why, not a
    request whose tools are silently dropped."""
    with pytest.raises(ApiError) as info:
        ask(body)
    err = info.value
    assert (err.status, err.param, err.code) == (400, param, "tools_not_certified")
    assert "certificate" in err.message


def test_no_tools_and_tool_choice_none_are_plain_requests():
    assert ask({"tools": [], "tool_choice": "none"}).max_tokens == 32
    assert api_error('{"model": "m", "messages": [{"role": "user"}]}').param == "messages.0"


def test_vote_takes_the_first_majority_sample():
    texts = ["so \\boxed{3}", "\\boxed{4}", "The answer is 4", "\\boxed{3}", "no idea"]
    # 3 and 4 both have 2 of 5 votes: the first seen wins; raw = 1 - 2/5.
    assert vote(texts) == (vote(texts).__class__)("3", 1 - 2 / 5, 0)
    assert vote(["x", "\\boxed{7}", "\\boxed{7}", "\\boxed{7}"]) == vote(texts).__class__(
        "7", 0.25, 1
    )
    assert vote(["x", "y"]) == vote(texts).__class__(None, 1.0, 0)
    assert boxed("1{2}") == "\\boxed{1{2}}"


def test_response_bodies():
    decision = {"seq": 5, "release": False, "threshold": 0.2, "epoch": 1, "versions": {"p": 1}}
    v = vote(["\\boxed{3}", "\\boxed{3}"])
    csa = csa_object(decision, "s", 0.25, v, 2, "feedback", "live-0@abc")
    assert csa == {
        "stream": "s",
        "seq": 5,
        "score": 0.25,
        "raw_score": 0.0,
        "k": 2,
        "threshold": 0.2,
        "released": False,
        "answer": None,
        "epoch": 1,
        "versions": {"p": 1},
        "policy_version": "live-0@abc",
        "verification": "feedback",
    }
    ungated = csa_object(None, "s", 0.25, v, 2, "none")
    assert ungated["released"] and ungated["answer"] == "3" and ungated["seq"] is None
    body = completion_body("chat", "m", "hi", 3, 4, csa)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "hi"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert completion_body("text", "m", "hi", 3, 4, csa)["choices"][0]["text"] == "hi"


def test_calibration_round_trip_grid_and_version(tmp_path):
    raw = [0.0, 0.0, 0.25, 0.25, 0.5, 0.75, 1.0, 1.0]
    passed = [True, True, True, False, False, True, False, False]
    cal = Calibration.fit(raw, passed, k=4, temperature=0.7, top_p=1.0, max_tokens=16, m=5)
    # Isotonic fit by hand: fail rates 0, 1/2, 1, 0, 1 at raw 0 .. 1; pool-adjacent-violators merges
    # raw 0.5 and 0.75 into 1/2, level with raw 0.25; the flat run keeps only its end knots.
    assert cal.calibrator.knots_raw.tolist() == [0.0, 0.25, 0.75, 1.0]
    assert cal.calibrator.knots_fail.tolist() == [0.0, 0.5, 0.5, 1.0]
    assert cal.score(0.6) == 0.5
    path = cal.save(tmp_path / "cal.json", alphas=(0.3, 0.05))
    saved = json.loads(path.read_text())
    assert saved["grids"]["0.3"] == make_grid(cal.cal_scores, 0.3, 5).tolist()
    assert saved["grids"]["0.05"] == make_grid(cal.cal_scores, 0.05, 5).tolist()
    hopeless = Calibration.fit(
        [1.0, 1.0], [False, False], k=4, temperature=0.7, top_p=1.0, max_tokens=16
    )
    assert "no room" in hopeless.to_dict(alphas=(0.05,))["grids"]["0.05"]["error"]
    assert saved["accuracy"] == 0.5 and saved["n_cal"] == 8
    again = Calibration.load(path)
    assert again.version == cal.version
    np.testing.assert_array_equal(again.grid(0.3), cal.grid(0.3))
    # The score definition includes K: a different K is a different scorer.
    other = Calibration.fit(raw, passed, k=5, temperature=0.7, top_p=1.0, max_tokens=16)
    assert other.version != cal.version
    with pytest.raises(ValueError, match="rlvr calibrate"):
        Calibration.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"format": 1}')
    with pytest.raises(ValueError, match="not a usable CSA calibration"):
        Calibration.load(tmp_path / "bad.json")
    assert Calibration(Calibrator([0.0, 1.0], [0.1, 0.3]), [0.0], [True], 1, 0.7, 1.0, 8).score(
        0.5
    ) == pytest.approx(0.2)


def test_checkpoint_fingerprint_follows_the_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"a" * 100)
    (tmp_path / "README.md").write_text("ignored")
    first = checkpoint_fingerprint(tmp_path)
    assert first.startswith(f"{tmp_path.name}@")
    (tmp_path / "README.md").write_text("still ignored")
    assert checkpoint_fingerprint(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"a" * 99 + b"b")
    assert checkpoint_fingerprint(tmp_path) != first


def test_cal_split_is_seeded_and_ordered():
    problems = [Problem(id=str(i), prompt="p", answer="1") for i in range(10)]
    split = cal_split(problems, 0.2)
    assert len(split) == 2 and split == cal_split(problems, 0.2)
    assert [int(p.id) for p in split] == sorted(int(p.id) for p in split)
    assert cal_split(problems, 1.0) == problems
    with pytest.raises(ValueError, match="CAL fraction"):
        cal_split(problems, 0.0)


def test_serve_config_names_bad_keys(tmp_path):
    cfg = load_serve_config(
        "configs/serve-tiny.yaml", ["csa.streams.0.alpha=0.3", "http.port=9000"]
    )
    assert cfg.csa.streams[0].alpha == 0.3 and cfg.http.port == 9000
    assert cfg.http.host == "127.0.0.1"
    assert str(cfg.state_dir()) == "runs/serve-tiny/csa"
    for overrides, message in [
        (["http.bogus=1"], "http.bogus: unknown key"),
        (["csa.streams.0.alpha=1.5"], "csa.streams.0.alpha"),
        (["csa.streams.0.name=../x"], "csa.streams.0"),
        (["csa.streams.3.alpha=0.1"], "csa.streams.3: no such list item"),
        (["replicas.num_replicas=0"], "replicas.num_replicas"),
        (["generation.backend=tgi"], "generation.backend"),
    ]:
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
            load_serve_config("configs/serve-tiny.yaml", overrides)
    dup = tmp_path / "dup.yaml"
    dup.write_text("csa:\n  streams:\n    - {name: a, alpha: 0.1}\n    - {name: a, alpha: 0.2}\n")
    with pytest.raises(ConfigError, match="unique"):
        load_serve_config(dup)
    with pytest.raises(ConfigError, match="4 CPUs requested but 2"):
        load_serve_config(None, ["replicas.num_replicas=4"]).check_cluster(
            [{"CPU": 1.0}, {"CPU": 1.0}]
        )


def test_a_server_defect_is_still_a_json_error():
    import asyncio

    from workflows.serve_replica import _respond

    async def defect() -> dict:
        raise KeyError("a bug")

    response = asyncio.run(_respond(defect))
    assert response.status_code == 500
    assert json.loads(response.body)["error"]["type"] == "server_error"


def test_stream_diagnostics_config_reaches_the_stream_spec():
    grid = [0.1, 0.2, 0.4]
    cfg = load_serve_config(
        "configs/serve-tiny.yaml",
        ["csa.streams.0.drift_budget=0.05", "csa.streams.0.brier_reset=true"],
    )
    stream = cfg.csa.streams[0]
    assert (stream.brier_window, stream.brier_threshold) == (500, 0.2)
    spec = stream.stream_spec(grid)
    assert (spec.drift_budget, spec.brier_window, spec.brier_threshold) == (0.05, 500, 0.2)
    assert (spec.alpha, spec.delta, spec.grid) == (stream.alpha, stream.delta, tuple(grid))
    assert spec.label_timeout_s == stream.label_timeout_s
    # Off (the default), the diagnostic's settings stay out of the spec.
    off = load_serve_config("configs/serve-tiny.yaml", ["csa.streams.0.brier_threshold=0.5"])
    assert off.csa.streams[0].stream_spec(grid).brier_window is None
    assert off.csa.streams[0].stream_spec(grid) == load_serve_config(
        "configs/serve-tiny.yaml"
    ).csa.streams[0].stream_spec(grid)
    for overrides, message in [
        (["csa.streams.0.drift_budget=0.6"], "alpha \\+ drift_budget must stay below 1"),
        (["csa.streams.0.drift_budget=-0.1"], "csa.streams.0.drift_budget"),
        (["csa.streams.0.brier_window=0"], "csa.streams.0.brier_window"),
        (["csa.streams.0.brier_threshold=0"], "csa.streams.0.brier_threshold"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_serve_config("configs/serve-tiny.yaml", overrides)
