"""The HTTP edge of the CSA server: an ASGI middleware that Ray Serve's proxy runs in front of
everything it answers, its own `/-/routes` and `/-/healthz` included.

Every request passes the Host check and, when client keys are set, the client key check before
the proxy routes it, so an unknown path without a key is a 401 like a known one and the routes
cannot be enumerated. `/-/routes` (the applications' route prefixes) takes the operator key;
`/-/healthz` answers as the API does unless `open_healthz` opens it to load balancers that cannot
send a key. Errors the proxy writes itself in plain text (no route, no replica, a timeout) leave
in the OpenAI error shape that the app's own errors have.

The proxy loads it by import path (`PROXY_CALLBACK_ENV`, Serve's hook for proxy middlewares) and
reads the policy, digests only, from `EDGE_POLICY_ENV`; both reach the proxy through the
environment of the Serve controller that starts it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from http import HTTPStatus
from typing import Any

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlvr.serving.access import AccessPolicy
from rlvr.serving.api import ApiError

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
EDGE_POLICY_ENV = "RLVR_EDGE_POLICY"
ROUTES_PATH = "/-/routes"
HEALTHZ_PATH = "/-/healthz"
_ERROR_KINDS = {
    401: "authentication_error",
    403: "permission_error",
    408: "timeout",
    429: "rate_limit_error",
    500: "server_error",
    502: "unavailable",
    503: "unavailable",
    504: "timeout",
}


@dataclass(frozen=True)
class EdgePolicy:
    """What the edge checks: the replicas' access policy, and whether `/-/healthz` is open."""

    access: AccessPolicy
    open_healthz: bool = False

    def environment(self) -> dict[str, str]:
        """The environment that installs this policy in a Serve proxy started with it."""
        return {
            PROXY_CALLBACK_ENV: f"{__name__}.proxy_middlewares",
            EDGE_POLICY_ENV: json.dumps(asdict(self)),
        }

    @classmethod
    def from_environment(cls, environ: dict[str, str]) -> EdgePolicy:
        """Inverse of `environment`; KeyError when the policy is missing (no proxy runs open)."""
        d = json.loads(environ[EDGE_POLICY_ENV])
        access = {k: tuple(v) for k, v in d["access"].items()}
        return cls(AccessPolicy(**access), bool(d["open_healthz"]))

    def admit(self, method: str, path: str, headers: dict[str, str]) -> None:
        """ApiError unless this request may reach the proxy's routing (`AccessPolicy.admit`)."""
        if path == HEALTHZ_PATH and self.open_healthz and method in ("GET", "HEAD"):
            return  # a load balancer's probe names the backend by its address, without a key
        self.access.admit(headers, operator=path == ROUTES_PATH)


def http_error(status: int, method: str, path: str, detail: str = "") -> ApiError:
    """An error the framework or the proxy raised (no route, a method not allowed, no replica)
    as the server's own ApiError, so every error body has one shape."""
    if status == 404:
        message, code = f"{path} is not served here", "not_found"
    elif status == 405:
        message, code = f"{method} is not allowed on {path}", "method_not_allowed"
    else:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = f"HTTP {status}"
        message, code = detail.strip()[:500] or phrase, phrase.lower().replace(" ", "_")
    kind = _ERROR_KINDS.get(status, "invalid_request_error" if status < 500 else "server_error")
    return ApiError(status, message, code=code, kind=kind)


class EdgeGuard:
    """ASGI middleware: `EdgePolicy.admit` before anything else, and the OpenAI error shape for
    every error response that is not JSON already."""

    def __init__(self, app: ASGIApp, policy: EdgePolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        method, path = scope.get("method", "GET"), scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            self.policy.admit(method, path, headers)
        except ApiError as err:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})  # refused: HTTP 403
            else:
                await _send_error(send, err)
            return
        if scope["type"] == "websocket":
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, _ErrorShaper(send, method, path))


class _ErrorShaper:
    """A `send` that holds back a non-JSON error response and sends it as an ApiError body."""

    def __init__(self, send: Send, method: str, path: str) -> None:
        self.send, self.method, self.path = send, method, path
        self.held: Message | None = None
        self.body = b""

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start" and _plain_error(message):
            self.held = message
            return
        if self.held is None or message["type"] != "http.response.body":
            await self.send(message)
            return
        self.body += message.get("body", b"")
        if not message.get("more_body", False):
            detail = self.body.decode("utf-8", "replace")
            err = http_error(self.held["status"], self.method, self.path, detail)
            kept = [
                (k, v)
                for k, v in self.held.get("headers", [])
                if k.lower() not in (b"content-type", b"content-length")
            ]
            await _send_error(self.send, err, kept)


def _plain_error(start: Message) -> bool:
    if start["status"] < 400:
        return False
    for key, value in start.get("headers", []):
        if key.lower() == b"content-type":
            return not value.lower().startswith(b"application/json")
    return True


async def _send_error(send: Send, err: ApiError, headers: list[Any] | None = None) -> None:
    body = json.dumps(err.body()).encode()
    out = list(headers or [])
    out += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in err.headers.items()]
    out += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": err.status, "headers": out})
    await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list[Middleware]:
    """Serve's proxy callback: the guard with the policy of this process's environment."""
    return [Middleware(EdgeGuard, policy=EdgePolicy.from_environment(dict(os.environ)))]
