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
    parse_host,
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
from rlvr.serving.edge import EdgeGuard, EdgePolicy, proxy_middlewares
from rlvr.tasks.prompts import DEFAULT_INSTRUCTION
from workflows.serve import resolve_access
from workflows.serve_replica import _respond, api

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


@pytest.mark.parametrize(
    "host",
    [
        "localhost:evil.example",
        "localhost:8000@evil.example",
        "127.0.0.1:x",
        "[::1]evil.example",
        "[::1",
        "::1",
        "localhost:",
        "localhost:0",
        "localhost:65536",
        "local host",
    ],
)
def test_a_host_header_that_is_not_a_host_and_port_is_a_400(host):
    """Nothing after the host is dropped unread: junk after a colon or a bracket is no port."""
    assert parse_host(host) is None
    for policy in (POLICY, AccessPolicy.build([], [OPERATOR], ())):  # also where any host goes
        with pytest.raises(ApiError) as info:
            policy.admit({"host": host, "authorization": f"Bearer {OPERATOR}"}, True)
        assert (info.value.status, info.value.code) == (400, "invalid_host_header")
        assert info.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("host", "parsed"),
    [
        ("localhost", ("localhost", None)),
        ("localhost:8000", ("localhost", 8000)),
        ("[::1]:8000", ("[::1]", 8000)),
        ("127.0.0.1", ("127.0.0.1", None)),
        ("LOCALHOST:65535", ("localhost", 65535)),
        ("[0:0:0:0:0:0:0:1]:1", ("[::1]", 1)),
    ],
)
def test_loopback_names_with_or_without_a_port_are_answered(host, parsed):
    assert parse_host(host) == parsed
    POLICY.admit({"host": host, "authorization": f"Bearer {OPERATOR}"}, True)


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
    # Allowed hosts are names or addresses without a port, IPv6 with or without brackets.
    policy, _ = resolve_access(serve_config(tmp_path, "http.allowed_hosts=[API.example, '::1']"))
    assert policy.allowed_hosts == ("api.example", "[::1]")
    with pytest.raises(ConfigError, match=r"http\.allowed_hosts\.0.*without a port"):
        serve_config(tmp_path, "http.allowed_hosts=[api.example:8000]")


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


# --------------------------------------------------------------------------- the edge


@pytest.fixture
def edge(monkeypatch):
    """`edge(open_healthz, app)`: a client of `app` (the server's) behind the edge, built as Serve's
    proxy builds it: its callback, the policy read from the environment the proxy starts with."""
    from starlette.testclient import TestClient

    def client(open_healthz: bool = False, app=api) -> TestClient:
        for name, value in EdgePolicy(POLICY, open_healthz).environment().items():
            monkeypatch.setenv(name, value)
        [middleware] = proxy_middlewares()
        guard = middleware.cls(app, *middleware.args, **middleware.kwargs)
        assert isinstance(guard, EdgeGuard)
        return TestClient(guard, base_url="http://127.0.0.1:8000")

    return client


def error_of(response) -> tuple[int, str]:
    """(status, code) of a response that must carry the OpenAI error shape."""
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    assert response.headers["content-type"] == "application/json"
    return response.status_code, body["error"]["code"]


UNSERVED = [
    ("GET", "/nope"),
    ("GET", "/v1/models/"),  # a trailing slash is not redirected: 404, not 307
    ("GET", "/v1/chat/completions"),
    ("DELETE", "/v1/feedback"),
    ("GET", "/-/routes"),
    ("GET", "/-/healthz"),
    ("GET", "/v1/models"),
]


def test_the_edge_asks_for_a_key_before_any_path_is_routed(edge):
    """Without a key every path is a 401 like a served one, so routes cannot be enumerated; with
    a client key, what is not served is a 404 or 405 in the error shape of every other error."""
    client = edge()
    for method, path in UNSERVED:
        refused = client.request(method, path)
        assert error_of(refused) == (401, "invalid_api_key"), path
        assert refused.headers["www-authenticate"] == 'Bearer realm="rlvr"'
        assert error_of(client.request(method, path, headers={"host": "evil.example"}))[0] == 403
        malformed = client.request(method, path, headers={"host": "localhost:8000@evil.example"})
        assert error_of(malformed) == (400, "invalid_host_header")
    keyed = {"authorization": f"Bearer {CLIENT}"}
    assert error_of(client.get("/nope", headers=keyed)) == (404, "not_found")
    assert error_of(client.get("/v1/models/", headers=keyed)) == (404, "not_found")
    wrong = client.get("/v1/chat/completions", headers=keyed)
    assert error_of(wrong) == (405, "method_not_allowed") and wrong.headers["allow"] == "POST"
    # Serve's route listing takes the operator key (behind the edge it is the proxy's to answer;
    # here the app behind says it does not serve it, so the edge let it through).
    assert error_of(client.get("/-/routes", headers=keyed)) == (403, "operator_key_required")
    operator = {"authorization": f"Bearer {OPERATOR}"}
    assert error_of(client.get("/-/routes", headers=operator)) == (404, "not_found")
    assert error_of(client.get("/-/healthz", headers=keyed)) == (404, "not_found")


def test_an_open_health_check_opens_that_path_alone(edge):
    """For a load balancer that cannot send a key (nor knows the served name)."""
    client = edge(open_healthz=True)
    probe = {"host": "10.0.0.5:8000"}
    assert error_of(client.get("/-/healthz", headers=probe)) == (404, "not_found")  # let through
    assert client.head("/-/healthz").status_code == 404
    assert error_of(client.post("/-/healthz"))[0] == 401
    assert error_of(client.get("/-/routes"))[0] == 401
    assert error_of(client.get("/nope"))[0] == 401


def test_errors_the_proxy_writes_in_plain_text_leave_in_the_openai_shape(edge):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    async def no_replica(request):
        return PlainTextResponse("no healthy replica", 503, headers={"Retry-After": "2"})

    async def not_found(request):
        return PlainTextResponse("Path '/x' not found. Ping http://.../-/routes", 404)

    async def json_error(request):
        return JSONResponse({"error": {"message": "own"}}, 500)

    async def text(request):
        return PlainTextResponse("fine")

    proxy = Starlette(
        routes=[
            Route("/busy", no_replica),
            Route("/x", not_found),
            Route("/own", json_error),
            Route("/text", text),
        ]
    )
    client = edge(app=proxy)
    keyed = {"authorization": f"Bearer {CLIENT}"}
    busy = client.get("/busy", headers=keyed)
    assert error_of(busy) == (503, "service_unavailable")
    assert busy.json()["error"]["message"] == "no healthy replica"
    assert busy.json()["error"]["type"] == "unavailable" and busy.headers["retry-after"] == "2"
    lost = client.get("/x", headers=keyed)
    assert error_of(lost) == (404, "not_found") and "/-/routes" not in lost.text
    assert client.get("/own", headers=keyed).json() == {"error": {"message": "own"}}
    assert client.get("/text", headers=keyed).text == "fine"


def test_a_refused_websocket_is_closed_before_it_opens(edge):
    from starlette.websockets import WebSocketDisconnect

    with pytest.raises(WebSocketDisconnect) as info, edge().websocket_connect("/v1/models"):
        pass
    assert info.value.code == 1008
