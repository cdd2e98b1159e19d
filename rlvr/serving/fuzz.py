"""Seeded malformed and hostile requests for a CSA server, each with the answer it must get.

The same cases drive the bounded fuzz test and `bench/serve_load.py`'s full run: invalid JSON,
wrong types, huge bodies and numbers, broken Unicode, deep nesting, unknown ids, wrong keys and
hosts, and requests for what the server refuses to change (the calibrated budget, streaming, n).
Every case expects a 4xx, so any 5xx or 2xx is a finding, and none may change a stream's state.
Pure: no HTTP client and no Ray.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
FEEDBACK = "/v1/feedback"
STATUS = "/v1/csa/status"
MODELS = "/v1/models"


@dataclass(frozen=True)
class Credentials:
    """The keys and names the cases use: a valid client and operator key, the served model,
    the target stream, the server's body limit and its calibrated max_tokens."""

    client_key: str
    operator_key: str
    model: str
    stream: str
    max_body_bytes: int
    max_tokens: int


@dataclass(frozen=True)
class Case:
    """One request and the status class it must get."""

    category: str
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    expect: str = "4xx"


def fuzz_cases(n: int, creds: Credentials, seed: int = 0) -> list[Case]:
    """`n` cases, drawn round-robin over the categories with a seeded generator."""
    rng = random.Random(seed)
    makers = list(CATEGORIES.values())
    return [makers[i % len(makers)](rng, creds) for i in range(n)]


def _json_case(category: str, creds: Credentials, body: object, path: str = CHAT) -> Case:
    return Case(category, "POST", path, json.dumps(body).encode(), _auth(creds, path))


def _auth(creds: Credentials, path: str) -> dict[str, str]:
    key = creds.operator_key if path in (FEEDBACK, STATUS) else creds.client_key
    return {"content-type": "application/json", "authorization": f"Bearer {key}"}


def _chat(creds: Credentials, **extra: object) -> dict[str, object]:
    return {
        "model": creds.model,
        "messages": [{"role": "user", "content": "1+1?"}],
        "metadata": {"csa_stream": creds.stream},
        **extra,
    }


def _invalid_json(rng: random.Random, creds: Credentials) -> Case:
    good = json.dumps(_chat(creds)).encode()
    choice = rng.randrange(4)
    if choice == 0:
        body = good[: rng.randrange(1, len(good))]  # truncated
    elif choice == 1:
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    elif choice == 2:
        body = good.replace(b":", b"=", 1)
    else:
        body = b"[" + good + b"]"  # JSON, but not an object
    return Case(
        "invalid_json", "POST", rng.choice([CHAT, TEXT, FEEDBACK]), body, _auth(creds, CHAT)
    )


_INVALID_CHAT: dict[str, list[object]] = {
    "model": [1, 1.5, True, [], {}, None],
    "messages": [
        1,
        "x",
        {},
        [],
        [1, "a"],
        None,
        [{"role": "robot", "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
    ],
    "max_tokens": ["x", 1.5, True, [], {}, -1, 0],
    "seed": [-1, "7", 1.5, True, [], {}, 2**63],
    "metadata": [1, "x", [], [1, "a"], {"a": 1}, True],
    "n": [-1, 0, "x", 1.5, True, [], {}],
    "temperature": [-1, "hot", True, [], {}],
    "top_p": [0, 1.5, "x", True],
}
"""Per field of a chat request, values its schema refuses (a valid one would generate)."""
_INVALID_FEEDBACK: dict[str, list[object]] = {
    "seq": ["0", 1.5, True, -1, None, []],
    "passed": [1, "true", None, [], 0.5],
    "stream": [1, [], {}, True],
}


def _wrong_types(rng: random.Random, creds: Credentials) -> Case:
    if rng.random() < 0.3:
        body: dict[str, object] = {"seq": 0, "passed": True, "stream": creds.stream}
        key = rng.choice(list(_INVALID_FEEDBACK))
        body[key] = rng.choice(_INVALID_FEEDBACK[key])
        return _json_case("wrong_types", creds, body, FEEDBACK)
    body = _chat(creds)
    key = rng.choice(list(_INVALID_CHAT))
    body[key] = rng.choice(_INVALID_CHAT[key])
    return _json_case("wrong_types", creds, body)


def _huge_body(rng: random.Random, creds: Credentials) -> Case:
    size = creds.max_body_bytes + rng.randrange(1, 4 * creds.max_body_bytes)
    body = _chat(creds, messages=[{"role": "user", "content": "x" * size}])
    return _json_case("huge_body", creds, body)


def _huge_number(rng: random.Random, creds: Credentials) -> Case:
    digits = rng.choice([4301, 5001, 20000])
    number = ("-" if rng.random() < 0.5 else "") + "9" * digits
    key = rng.choice(["max_tokens", "seed", "n"])
    text = json.dumps(_chat(creds))[:-1] + f', "{key}": {number}}}'
    if rng.random() < 0.3:
        text = json.dumps(_chat(creds, max_tokens=rng.choice([1e308, -(2**63), 2**64])))
    return Case("huge_number", "POST", CHAT, text.encode(), _auth(creds, CHAT))


def _broken_unicode(rng: random.Random, creds: Credentials) -> Case:
    text = json.dumps(_chat(creds)).replace(
        "1+1?", rng.choice(["\\ud800", "a\\udfff", "\\udbff\\udbff", "x\\ud83d"])
    )
    body = text.encode()
    if rng.random() < 0.3:
        body = body.replace(b"1+1?", b"\xff\xfe\xc3")  # not UTF-8 at all
    return Case("broken_unicode", "POST", rng.choice([CHAT, TEXT]), body, _auth(creds, CHAT))


def _deep_nesting(rng: random.Random, creds: Credentials) -> Case:
    depth = rng.choice([2000, 10000, 30000])
    open_, close = rng.choice([("[", "]"), ('{"a":', "}")])
    body = f'{{"metadata": {open_ * depth}1{close * depth}}}'.encode()
    return Case("deep_nesting", "POST", rng.choice([CHAT, FEEDBACK]), body, _auth(creds, CHAT))


def _unknown_ids(rng: random.Random, creds: Credentials) -> Case:
    choice = rng.randrange(4)
    if choice == 0:
        body = {"seq": rng.randrange(10**6, 10**9), "passed": True, "stream": creds.stream}
        return _json_case("unknown_ids", creds, body, FEEDBACK)
    if choice == 1:
        body = {"seq": 0, "passed": False, "stream": f"nope-{rng.randrange(10**6)}"}
        return _json_case("unknown_ids", creds, body, FEEDBACK)
    if choice == 2:
        return _json_case("unknown_ids", creds, _chat(creds, model=f"gpt-{rng.randrange(9)}"))
    meta = {"csa_stream": f"nope-{rng.randrange(10**6)}"}
    return _json_case("unknown_ids", creds, _chat(creds, metadata=meta))


def _wrong_credentials(rng: random.Random, creds: Credentials) -> Case:
    # Paths the server does not serve, Serve's route listing among them, ask for a key too.
    path = rng.choice([CHAT, TEXT, FEEDBACK, STATUS, MODELS, "/v1/nothing", "/-/routes"])
    headers = {"content-type": "application/json"}
    choice = rng.randrange(4)
    if choice == 1:
        headers["authorization"] = f"Bearer made-up-{rng.randrange(10**9):09d}-key"
    elif choice == 2:
        headers["authorization"] = f"Basic {creds.client_key}"
    elif choice == 3:
        # a client key where only the operator key opens the door
        path = rng.choice([FEEDBACK, STATUS])
        headers["authorization"] = f"Bearer {creds.client_key}"
    method = "POST" if path in (CHAT, TEXT, FEEDBACK) else "GET"
    body = None if method == "GET" else json.dumps(_chat(creds)).encode()
    return Case("wrong_credentials", method, path, body, headers)


def _wrong_request(rng: random.Random, creds: Credentials) -> Case:
    choice = rng.randrange(6)
    if choice == 0:  # a browser's cross-site form or text post
        headers = _auth(creds, CHAT) | {
            "content-type": rng.choice(["text/plain", "application/x-www-form-urlencoded", ""])
        }
        return Case("wrong_request", "POST", CHAT, json.dumps(_chat(creds)).encode(), headers)
    if choice == 1:
        hosts = ["evil.example", "10.0.0.1:8000", "localhost:evil.example", "[::1]evil.example"]
        headers = _auth(creds, CHAT) | {"host": rng.choice(hosts)}
        return Case("wrong_request", "POST", CHAT, json.dumps(_chat(creds)).encode(), headers)
    if choice == 2:
        path = rng.choice(["/docs", "/openapi.json", "/v1/nothing", "/v2/chat/completions"])
        return Case("wrong_request", "GET", path, None, _auth(creds, CHAT))
    if choice == 3:
        return Case("wrong_request", "GET", CHAT, None, _auth(creds, CHAT))
    if choice == 4:
        return Case("wrong_request", "PUT", FEEDBACK, b"{}", _auth(creds, FEEDBACK))
    return _json_case("wrong_request", creds, {"model": creds.model}, CHAT)


def _changes_the_score(rng: random.Random, creds: Credentials) -> Case:
    """What the calibration fixes: another budget, several answers, streaming."""
    choice = rng.randrange(4)
    if choice == 0:
        other = rng.choice([1, creds.max_tokens - 1, creds.max_tokens + 1, 10**6])
        return _json_case("changes_the_score", creds, _chat(creds, max_tokens=other))
    if choice == 1:
        return _json_case("changes_the_score", creds, _chat(creds, n=rng.randrange(2, 9)))
    if choice == 2:
        return _json_case("changes_the_score", creds, _chat(creds, stream=True))
    system_only = _chat(creds, messages=[{"role": "system", "content": "x"}])
    return _json_case("changes_the_score", creds, system_only)


CATEGORIES = {
    "invalid_json": _invalid_json,
    "wrong_types": _wrong_types,
    "huge_body": _huge_body,
    "huge_number": _huge_number,
    "broken_unicode": _broken_unicode,
    "deep_nesting": _deep_nesting,
    "unknown_ids": _unknown_ids,
    "wrong_credentials": _wrong_credentials,
    "wrong_request": _wrong_request,
    "changes_the_score": _changes_the_score,
}
"""Category name -> maker(rng, credentials) -> Case."""


def status_class(status: int) -> str:
    """'2xx', '4xx', '5xx', ... of an HTTP status."""
    return f"{status // 100}xx"


def tally(results: list[tuple[str, int]]) -> dict[str, dict[str, int]]:
    """Counts by category and status class of (category, status) pairs."""
    table: dict[str, dict[str, int]] = {}
    for category, status in results:
        row = table.setdefault(category, {})
        row[status_class(status)] = row.get(status_class(status), 0) + 1
    return table
