"""Who may call the CSA server (API keys, the operator key, the Host header) and what prompt and
budget it generates with, without Ray."""

from __future__ import annotations

import json
import stat

import pytest

from rlvr.algorithms.csa import Calibrator
from rlvr.config import ConfigError
from rlvr.serving.access import (
    OPERATOR_KEY_ENV,
    AccessPolicy,
    default_allowed_hosts,
    is_loopback,
    key_digest,
    operator_key,
    read_keys,
)
from rlvr.serving.api import (
    ApiError,
    Calibration,
    ChatCompletionRequest,
    CompletionRequest,
    instructed,
    served_prompt,
)
from rlvr.serving.config import load_serve_config
from rlvr.tasks.prompts import DEFAULT_INSTRUCTION
from workflows.serve import _respond, resolve_access

CLIENT = "client-key-0123456789"
OPERATOR = "operator-key-0123456789"
POLICY = AccessPolicy.build([CLIENT], [OPERATOR], default_allowed_hosts("127.0.0.1"))


def refusal(policy: AccessPolicy, headers: dict[str, str], operator: bool) -> tuple[int, str]:
    with pytest.raises(ApiError) as info:
        policy.admit({"host": "127.0.0.1:8000"} | headers, operator)
    return info.value.status, info.value.code


def test_client_keys_open_the_openai_endpoints_and_only_the_operator_key_the_rest():
    for key in (CLIENT, OPERATOR):
        POLICY.admit({"host": "localhost:8000", "authorization": f"Bearer {key}"}, False)
    POLICY.admit({"host": "[::1]:8000", "authorization": f"bearer  {OPERATOR} "}, True)
    assert refusal(POLICY, {}, False) == (401, "invalid_api_key")
    assert refusal(POLICY, {"authorization": "Bearer made-up-token-000000"}, False)[0] == 401
    assert refusal(POLICY, {"authorization": f"Basic {CLIENT}"}, False)[0] == 401
    assert refusal(POLICY, {"authorization": "Bearer"}, True)[0] == 401
    assert refusal(POLICY, {"authorization": f"Bearer {CLIENT}"}, True) == (
        403,
        "operator_key_required",
    )
    with pytest.raises(ApiError) as info:
        POLICY.admit({"host": "127.0.0.1"}, False)
    assert info.value.headers == {"WWW-Authenticate": 'Bearer realm="rlvr"'}
    assert info.value.body()["error"]["type"] == "authentication_error"
    # Without client keys the OpenAI endpoints are open; feedback never is.
    open_policy = AccessPolicy.build([], [OPERATOR], ())
    open_policy.admit({"host": "example.com"}, False)
    assert refusal(open_policy, {}, True)[0] == 401
    # Replicas hold digests, never the keys.
    assert POLICY.client_digests == (key_digest(CLIENT),) and CLIENT not in repr(POLICY)


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "", "[::2]:80"]
)
def test_a_foreign_host_header_is_refused_on_loopback(host):
    headers = {"host": host, "authorization": f"Bearer {OPERATOR}"}
    with pytest.raises(ApiError) as info:
        POLICY.admit(headers, True)
    assert (info.value.status, info.value.code) == (403, "host_not_allowed")


def test_loopback_and_default_hosts():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert is_loopback("127.0.0.2") and not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")
    assert "localhost" in default_allowed_hosts("127.0.0.1")
    assert default_allowed_hosts("0.0.0.0") == ()


def test_key_files_and_the_generated_operator_key(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# clients\n{CLIENT}\n\n  {OPERATOR}  \n")
    assert read_keys(keys, "k") == [CLIENT, OPERATOR]
    keys.write_text("short\n")
    with pytest.raises(ValueError, match="at least 16 characters"):
        read_keys(keys, "k")
    with pytest.raises(ValueError, match="cannot read"):
        read_keys(tmp_path / "missing", "k")
    state = tmp_path / "state"
    key, source = operator_key(None, state, {})
    assert source == str(state / "operator.key") and len(key) >= 32
    assert stat.S_IMODE((state / "operator.key").stat().st_mode) == 0o600
    assert operator_key(None, state, {}) == (key, source)  # kept across restarts
    assert operator_key(None, state, {OPERATOR_KEY_ENV: OPERATOR}) == (OPERATOR, OPERATOR_KEY_ENV)


def serve_config(tmp_path, *overrides: str):
    return load_serve_config(
        "configs/serve-tiny.yaml", [f"csa.state_dir={tmp_path / 'state'}", *overrides]
    )


def test_resolve_access_reads_every_source_and_refuses_an_open_public_bind(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(CLIENT + "\n")
    cfg = serve_config(tmp_path, f"http.api_keys_file={keys}")
    policy, source = resolve_access(cfg, {"RLVR_API_KEYS": "env-key-0123456789abc, "})
    assert policy.client_digests == (key_digest("env-key-0123456789abc"), key_digest(CLIENT))
    assert source.endswith("operator.key") and policy.allowed_hosts
    public = serve_config(tmp_path, "http.host=0.0.0.0")
    with pytest.raises(ConfigError, match=r"http\.host: 0\.0\.0\.0 is reachable"):
        resolve_access(public, {})
    policy, _ = resolve_access(
        serve_config(tmp_path, "http.host=0.0.0.0", "http.allow_unauthenticated=true"), {}
    )
    assert policy.client_digests == () and policy.allowed_hosts == ()
    with pytest.raises(ConfigError, match=r"http\.api_keys_file: cannot read"):
        resolve_access(serve_config(tmp_path, f"http.api_keys_file={tmp_path / 'nope'}"), {})
    with pytest.raises(ConfigError, match="RLVR_API_KEYS: keys must be"):
        resolve_access(cfg, {"RLVR_API_KEYS": "short"})
    with pytest.raises(ConfigError, match=r"http\.api_keys\.0"):
        serve_config(tmp_path, "http.api_keys=[tiny]")


def test_an_api_error_keeps_its_headers():
    import asyncio

    async def busy() -> dict:
        raise ApiError(429, "busy", code="server_busy", headers={"Retry-After": "3"})

    response = asyncio.run(_respond(busy))
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert json.loads(response.body)["error"]["code"] == "server_busy"


def calibration(**kw) -> Calibration:
    return Calibration(Calibrator([0.0, 1.0], [0.1, 0.3]), [0.0], [True], 4, 0.7, 1.0, 16, **kw)


def test_prompts_are_served_as_they_were_calibrated():
    chat = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": "2"},
                {"role": "user", "content": "2+2?"},
            ],
        }
    )
    messages = served_prompt(calibration(), chat)
    assert [m["content"] for m in messages] == [
        "Be brief.",
        "1+1?",
        "2",
        f"2+2? {DEFAULT_INSTRUCTION}",
    ]
    text = CompletionRequest.model_validate({"model": "m", "prompt": "3+3?"})
    assert served_prompt(calibration(), text) == [
        {"role": "user", "content": f"3+3? {DEFAULT_INSTRUCTION}"}
    ]
    raw = calibration(instruction="Q: {prompt}\nA:", chat_template=False)
    assert served_prompt(raw, text) == "Q: 3+3?\nA:"
    with pytest.raises(ApiError, match="raw prompts") as info:
        served_prompt(raw, chat)
    assert info.value.status == 400
    system_only = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "system", "content": "x"}]}
    )
    with pytest.raises(ApiError, match="user turn"):
        served_prompt(calibration(), system_only)
    # A client that already wrote the instruction does not get it twice.
    assert instructed(f"1+1? {DEFAULT_INSTRUCTION}\n", DEFAULT_INSTRUCTION).count("boxed") == 1
    assert instructed("1+1?", "") == "1+1?"


def test_the_prompt_form_is_part_of_the_scorer_version(tmp_path):
    base = calibration()
    assert calibration(instruction="Answer: ").version != base.version
    assert calibration(chat_template=False).version != base.version
    again = Calibration.load(base.save(tmp_path / "cal.json"))
    assert (again.chat_template, again.version) == (True, base.version)
    old = json.loads((tmp_path / "cal.json").read_text())
    del old["chat_template"]  # written before the field existed: chat, as calibrate rendered
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Calibration.load(tmp_path / "old.json").chat_template is True
