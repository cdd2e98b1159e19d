"""Who may call the CSA server: API keys, the operator key, and the Host header.

Keys are compared as SHA-256 digests (`hmac.compare_digest`), so replicas never hold a key in
the clear and a comparison takes the same time whichever byte differs. Client keys open the
OpenAI endpoints; the operator key opens those too, and alone opens the ones that move or reveal
the certificate (`/v1/feedback`, `/v1/csa/status`): a label decides what the error budget is spent
on, so it must come from whoever runs the verifier, not from any client.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rlvr.serving.api import ApiError

API_KEYS_ENV = "RLVR_API_KEYS"
"""Environment variable with client API keys, comma-separated (added to `http.api_keys`)."""
OPERATOR_KEY_ENV = "RLVR_OPERATOR_KEY"
"""Environment variable with the operator key (overrides `http.operator_key_file`)."""
OPERATOR_KEY_FILE = "operator.key"
"""Where `rlvr serve` keeps a generated operator key: in the stream state directory, mode 0600."""
MIN_KEY_CHARS = 16
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
_NAME = re.compile(r"[a-z0-9._-]+")
_PORT = re.compile(r"[0-9]{1,5}")


def key_digest(key: str) -> str:
    """Hex SHA-256 of a key: what replicas compare against."""
    return hashlib.sha256(key.encode()).hexdigest()


def check_key(key: str, where: str = "") -> str:
    """`key` stripped, or ValueError (naming `where`) if it is too short or holds whitespace."""
    key = key.strip()
    if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
        raise ValueError(
            f"{where + ': ' if where else ''}keys must be at least {MIN_KEY_CHARS} characters "
            "without whitespace "
            "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    return key


def read_keys(path: str | Path, where: str) -> list[str]:
    """Keys from a file, one per line (blank lines and `#` comments skipped)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise ValueError(f"{where}: cannot read {path} ({err.strerror or err})") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    return [check_key(k, where) for k in keys]


def env_keys(value: str | None) -> list[str]:
    """Keys of a comma-separated environment variable."""
    return [check_key(k, API_KEYS_ENV) for k in (value or "").split(",") if k.strip()]


def operator_key(
    configured_file: str | None, state_dir: Path, environ: dict[str, str]
) -> tuple[str, str]:
    """(operator key, where it came from): the environment, the configured file, or a key kept
    in `state_dir`, generated on first start (so feedback is never open by default)."""
    if environ.get(OPERATOR_KEY_ENV):
        return check_key(environ[OPERATOR_KEY_ENV], OPERATOR_KEY_ENV), OPERATOR_KEY_ENV
    if configured_file:
        keys = read_keys(configured_file, "http.operator_key_file")
        if len(keys) != 1:
            raise ValueError(f"http.operator_key_file: {configured_file} must hold one key")
        return keys[0], configured_file
    path = state_dir / OPERATOR_KEY_FILE
    if path.exists():
        return read_keys(path, str(path))[0], str(path)
    state_dir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key, str(path)


def parse_host(value: str) -> tuple[str, int | None] | None:
    """(host, port) of a Host header value: `name`, `IPv4` or `[IPv6]`, each with an optional
    `:port` of 1-65535; the host lower-cased, IPv6 in its short form in brackets. None if the
    value is anything else: nothing after the host is dropped unread, so `localhost:evil.example`
    or `[::1]evil.example` is not a loopback name with junk after it but not a Host at all."""
    value = value.lower()
    if value.startswith("["):
        address, bracket, rest = value[1:].partition("]")
        try:
            host = f"[{ipaddress.IPv6Address(address).compressed}]"
        except ValueError:
            return None
        if not bracket or (rest and not rest.startswith(":")):
            return None
        has_port, port = bool(rest), rest[1:]
    else:
        host, colon, port = value.partition(":")
        has_port = bool(colon)
        if not _NAME.fullmatch(host):
            return None
    if not has_port:
        return host, None
    if not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
        return None
    return host, int(port)


def allowed_host(entry: str) -> str:
    """An `http.allowed_hosts` entry as `parse_host` writes hosts (an IPv6 address may come
    without brackets); ValueError for anything else, a port included."""
    parsed = parse_host(f"[{entry}]" if ":" in entry and "[" not in entry else entry)
    if parsed is None or parsed[1] is not None:
        raise ValueError(f"{entry!r} is not a host name or address without a port")
    return parsed[0]


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> tuple[str, ...]:
    """Host header names accepted by default: loopback names when bound to loopback (a DNS
    rebinding page then cannot reach the server through its own domain), any otherwise."""
    return _LOOPBACK_NAMES if is_loopback(bind_host) else ()


@dataclass(frozen=True)
class AccessPolicy:
    """Digests of the keys a replica accepts and the Host names it answers (plain data)."""

    client_digests: tuple[str, ...]
    operator_digests: tuple[str, ...]
    allowed_hosts: tuple[str, ...]

    @classmethod
    def build(
        cls, client_keys: Iterable[str], operator_keys: Iterable[str], allowed_hosts: Iterable[str]
    ) -> AccessPolicy:
        return cls(
            tuple(key_digest(k) for k in client_keys),
            tuple(key_digest(k) for k in operator_keys),
            tuple(allowed_host(h) for h in allowed_hosts),
        )

    def admit(self, headers: dict[str, str], operator: bool) -> None:
        """Check a request's Host and bearer key; ApiError 403 (host, or a client key on an
        operator endpoint) or 401 (no or unknown key), before its body is read."""
        self._check_host(headers.get("host", ""))
        if not operator and not self.client_digests:
            return  # the OpenAI endpoints are open unless client keys are configured
        token = _bearer(headers.get("authorization", ""))
        if token is None:
            raise _unauthorized("this endpoint needs `Authorization: Bearer <key>`")
        digest = key_digest(token)
        if _known(digest, self.operator_digests):
            return
        if _known(digest, self.client_digests):
            if operator:
                raise ApiError(
                    403,
                    "this endpoint needs the operator key, not a client API key",
                    code="operator_key_required",
                    kind="permission_error",
                )
            return
        raise _unauthorized("invalid API key")

    def _check_host(self, host: str) -> None:
        parsed = parse_host(host)
        if parsed is None and host:
            raise ApiError(
                400,
                f"Host {host!r} is not a host name or address with an optional port (1-65535)",
                code="invalid_host_header",
            )
        if self.allowed_hosts and (parsed is None or parsed[0] not in self.allowed_hosts):
            raise ApiError(
                403,
                f"Host {host!r} is not served here (allowed: {', '.join(self.allowed_hosts)}; "
                "set http.allowed_hosts)",
                code="host_not_allowed",
                kind="permission_error",
            )


def _bearer(value: str) -> str | None:
    scheme, _, token = value.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _known(digest: str, digests: tuple[str, ...]) -> bool:
    # Compare with every digest (no early exit), each in constant time.
    found = False
    for d in digests:
        found |= hmac.compare_digest(digest, d)
    return found


def _unauthorized(message: str) -> ApiError:
    return ApiError(
        401,
        message,
        code="invalid_api_key",
        kind="authentication_error",
        headers={"WWW-Authenticate": 'Bearer realm="rlvr"'},
    )
