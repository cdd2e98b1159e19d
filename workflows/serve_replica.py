"""One replica of `rlvr serve` (a Ray Serve deployment): the OpenAI-compatible routes, admission
and the CSA round of every request (K self-consistency samples, the majority answer, the calibrated
score, the stream owner's decision), shadow verification of released rounds, and the switch to a
newly published live version between two generations."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.exceptions import RayActorError
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.controller import NAMESPACE
from rlvr.algorithms.csa import AlreadyLabelledError, UnknownSeqError
from rlvr.generation.base import GenerationRequest, SamplingParams
from rlvr.models.checkpoints import merged_lora_weights
from rlvr.serving.access import (
    AccessPolicy,
)
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
    served_prompt,
    vote,
)
from rlvr.serving.edge import http_error
from rlvr.serving.live_updates import adapter_dir
from rlvr.serving.stream_host import LabelSourceError, UnknownStreamError
from rlvr.tasks.prompts import render_messages, render_text
from rlvr.training.rendezvous import LOOPBACK, bind_collectives

log = logging.getLogger(__name__)

APP_NAME = "rlvr-csa"
_LABEL_RETRIES = 6
ADMISSION_SLACK = 8
"""Requests Serve may route to a replica beyond those it holds: the replica answers them at once
(429 for completions over its limit; feedback, status and models never wait for generation)."""


@dataclass(frozen=True)
class ServeSettings:
    """Everything a replica needs, plain data (it travels to every replica)."""

    model_dir: str
    served_name: str
    backend: str
    backend_kwargs: dict[str, Any]
    torch_threads: int
    max_model_len: int
    calibration: dict[str, Any]
    streams: tuple[str, ...]
    streams_actor: str
    fallback: str
    max_body_bytes: int
    verifier: dict[str, Any] | None
    access: AccessPolicy
    max_held_requests: int
    gate: bool = True
    policy: str = ""
    """The version of `model_dir`'s weights (its fingerprint)."""
    live_stream: str | None = None
    """Where published live versions are read (None: the served weights never change)."""
    live_dir: str | None = None
    live_poll_s: float = 5.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServeSettings:
        """Inverse of `dataclasses.asdict` (which flattens the access policy)."""
        return cls(**(d | {"access": AccessPolicy(**d["access"])}))


# No /docs, /redoc or /openapi.json: the server answers only what it serves. No redirects of a
# path with a trailing slash either: such a path is not served, and says so.
api = FastAPI(
    title="rlvr CSA server",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
    redirect_slashes=False,
)


@api.exception_handler(StarletteHTTPException)
async def unserved(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """A path or method the app does not serve (the framework's 404 and 405) answered in the
    OpenAI error shape of every other error; the edge has admitted the caller already."""
    err = http_error(exc.status_code, request.method, request.url.path, str(exc.detail))
    return JSONResponse(err.body(), status_code=err.status, headers=exc.headers)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing more than `limit` bytes (413) before reading it all, and any
    body not declared JSON (415): a form or text/plain post is what a browser may send
    cross-site without asking, a JSON one it may not."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(
            415,
            "request body must be JSON, sent with Content-Type: application/json",
            code="unsupported_media_type",
        )
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "invalid Content-Length header")
        if int(declared) > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
    return bytes(body)


async def _respond(
    work: Callable[[], Awaitable[dict[str, Any]]], timing: dict[str, float] | None = None
) -> JSONResponse:
    """Run a handler; an ApiError becomes its status with an OpenAI-style JSON error body.

    The phases the handler timed into `timing` (seconds) go out as a `Server-Timing` header, so
    an operator (and the bench) sees what the gate costs inside the replica."""
    try:
        response = JSONResponse(await work())
    except ApiError as err:
        response = JSONResponse(err.body(), status_code=err.status, headers=err.headers)
    except Exception:  # a defect, not the client's: logged, and still an OpenAI-style body
        log.exception("request failed")
        err = ApiError(500, "internal server error", kind="server_error")
        response = JSONResponse(err.body(), status_code=500)
    if timing:
        response.headers["Server-Timing"] = ", ".join(
            f"{name};dur={seconds * 1e3:.3f}" for name, seconds in timing.items()
        )
    return response


def _cause(err: Exception) -> str:
    """The message of an exception raised inside an actor, without Ray's remote traceback."""
    return str(getattr(err, "cause", None) or err)


@serve.deployment
@serve.ingress(api)
class CSAServer:
    """One replica: a generation backend, the calibration, handles to the stream owner."""

    def __init__(self, settings: dict[str, Any]):
        import torch

        from rlvr.generation import make_backend

        self.s = ServeSettings.from_dict(settings)
        torch.set_num_threads(self.s.torch_threads)
        # The engine's own process groups span this replica alone: they listen on the loopback.
        bind_collectives(LOOPBACK)
        self.backend = make_backend(self.s.backend, self.s.model_dir, **self.s.backend_kwargs)
        self.tokenizer = self.backend.tokenizer
        self.calibration = Calibration.from_dict(self.s.calibration)
        self.streams = (
            ray.get_actor(self.s.streams_actor, namespace=NAMESPACE) if self.s.gate else None
        )
        self.verifier = None
        if self.s.verifier is not None and self.s.gate:
            from actors.verifier import VerifierPool

            self.verifier = VerifierPool(
                self.s.verifier["num_actors"], self.s.verifier["timeout_s"]
            )
        # One generation at a time per replica: engines are not re-entrant; K samples batch inside.
        self._generate_lock = asyncio.Lock()
        self._verify_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._held = 0  # completion requests in this replica (generating or waiting)
        self._generate_s = 1.0  # moving average of one generation, for Retry-After
        # The version the engine holds; the engine lock covers a generation or a weight swap.
        self.policy = self.s.policy
        self._engine_lock = threading.Lock()
        self._stop = threading.Event()
        if self.s.live_stream is not None and self.streams is not None:
            self._switch_to(self._published())  # a (re)started replica serves the newest
            threading.Thread(target=self._follow_published, daemon=True).start()

    # ----------------------------------------------------------------- routes

    @api.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        """The one served model."""

        async def work() -> dict[str, Any]:
            self._admit(request, operator=False)
            return {
                "object": "list",
                "data": [
                    {"id": self.s.served_name, "object": "model", "created": 0, "owned_by": "rlvr"}
                ],
            }

        return await _respond(work)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> JSONResponse:
        """OpenAI chat completion through the CSA gate."""
        timing: dict[str, float] = {}
        return await _respond(lambda: self._complete(request, "chat", timing), timing)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> JSONResponse:
        """OpenAI text completion (one prompt, rendered as calibrated) through the CSA gate."""
        timing: dict[str, float] = {}
        return await _respond(lambda: self._complete(request, "text", timing), timing)

    @api.post("/v1/feedback")
    async def feedback(self, request: Request) -> JSONResponse:
        """Apply a verifier label {seq, passed, stream?} to a decided round (operator key)."""
        return await _respond(lambda: self._feedback(request))

    @api.get("/v1/csa/status")
    async def status(self, request: Request, stream: str | None = None) -> JSONResponse:
        """Every stream's monitoring view, or one stream's with ?stream=NAME (operator key)."""

        async def work() -> dict[str, Any]:
            self._admit(request, operator=True)
            if not self.s.gate:
                raise ApiError(404, "this deployment runs without the CSA gate", code="no_gate")
            return {"streams": await self._streams("status", stream)}

        return await _respond(work)

    # ----------------------------------------------------------------- request handling

    def _admit(self, request: Request, operator: bool) -> None:
        """The access check (Host, then key) every route runs before reading a body."""
        self.s.access.admit({k.lower(): v for k, v in request.headers.items()}, operator=operator)

    async def _complete(
        self, request: Request, kind: str, timing: dict[str, float]
    ) -> dict[str, Any]:
        """Admit the request if the replica has room (429 otherwise), then `_gated_completion`."""
        self._admit(request, operator=False)
        if self._held >= self.s.max_held_requests:
            wait = math.ceil(self._generate_s * self._held)
            raise ApiError(
                429,
                f"this replica holds {self._held} requests (its limit); retry in about {wait} s",
                code="server_busy",
                kind="rate_limit_error",
                headers={"Retry-After": str(max(1, wait))},
            )
        self._held += 1
        try:
            return await self._gated_completion(request, kind, timing)
        finally:
            self._held -= 1

    async def _gated_completion(
        self, request: Request, kind: str, timing: dict[str, float]
    ) -> dict[str, Any]:
        """Sample K answers, score their vote and ask the stream owner whether to release; the
        seconds spent generating, voting and deciding are written into `timing`."""
        schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
        req = parse_body(await read_body(request, self.s.max_body_bytes), schema)
        ask = check_generation_request(
            req, self.s.served_name, self.calibration.max_tokens, self.s.streams[0]
        )
        if self.s.gate and ask.stream not in self.s.streams:
            raise ApiError(
                404,
                f"unknown CSA stream {ask.stream!r}; this server has {list(self.s.streams)}",
                param="metadata.csa_stream",
                code="stream_not_found",
            )
        if ask.reference is not None and self.verifier is None:
            raise ApiError(
                400,
                "metadata.reference needs a verifier and none is configured; "
                "send labels to POST /v1/feedback instead",
                param="metadata.reference",
            )
        prompt_ids = self._prompt_ids(req)
        if len(prompt_ids) + ask.max_tokens > self.s.max_model_len:
            raise ApiError(
                400,
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({ask.max_tokens}) exceeds the "
                f"context of {self.s.max_model_len} tokens",
                param="messages" if kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        start = time.perf_counter()
        samples, policy = await self._sample(prompt_ids, ask.max_tokens, ask.seed)
        timing["generate"] = time.perf_counter() - start
        self._generate_s = 0.8 * self._generate_s + 0.2 * timing["generate"]
        start = time.perf_counter()
        v = vote([s.text for s in samples])
        score = self.calibration.score(v.raw)
        timing["vote"] = time.perf_counter() - start
        decision = None
        if self.s.gate:
            start = time.perf_counter()
            source = "feedback" if ask.reference is None else "shadow"
            experience = None
            if self.s.live_stream == ask.stream:
                experience = {
                    "prompt_ids": prompt_ids,
                    "response_ids": samples[v.index].token_ids,
                    "reference": ask.reference,
                }
            decision = await self._streams("decide", ask.stream, score, source, policy, experience)
            if ask.reference is not None:
                self._spawn(
                    self._shadow_verify(ask.stream, decision["seq"], v.answer, ask.reference)
                )
            timing["gate"] = time.perf_counter() - start
        verification = "none" if decision is None else "shadow" if ask.reference else "feedback"
        csa = csa_object(decision, ask.stream, score, v, len(samples), verification, policy)
        content = samples[v.index].text if csa["released"] else self.s.fallback
        return completion_body(
            kind,
            self.s.served_name,
            content,
            len(prompt_ids),
            sum(len(s.token_ids) for s in samples),
            csa,
        )

    async def _feedback(self, request: Request) -> dict[str, Any]:
        self._admit(request, operator=True)
        req = parse_body(await read_body(request, self.s.max_body_bytes), FeedbackRequest)
        if not self.s.gate:
            raise ApiError(404, "this deployment runs without the CSA gate", code="no_gate")
        stream = req.stream or self.s.streams[0]
        return await self._streams("observe", stream, req.seq, req.passed)

    def _prompt_ids(self, req: ChatCompletionRequest | CompletionRequest) -> list[int]:
        """Token ids of the prompt in the calibrated form (`served_prompt`)."""
        prompt = served_prompt(self.calibration, req)
        if isinstance(prompt, str):
            ids = render_text(self.tokenizer, prompt)
        else:
            try:
                ids = render_messages(self.tokenizer, prompt)
            except Exception as err:  # jinja raises many types for a conversation it rejects
                raise ApiError(
                    400, f"the chat template rejects these messages: {err}", "messages"
                ) from None
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return ids

    async def _sample(
        self, prompt_ids: list[int], max_tokens: int, seed: int | None
    ) -> tuple[list, str]:
        """The calibrated K samples, and the policy version that drew them."""
        cal = self.calibration
        request = GenerationRequest(
            prompt_ids=prompt_ids, n=cal.k, seed=secrets.randbits(62) if seed is None else seed
        )
        params = SamplingParams(temperature=cal.temperature, top_p=cal.top_p, max_tokens=max_tokens)
        async with self._generate_lock:
            return await asyncio.to_thread(self._generate, request, params)

    def _generate(self, request: GenerationRequest, params: SamplingParams) -> tuple[list, str]:
        with self._engine_lock:
            [result] = self.backend.generate([request], params)
            return result.samples, self.policy

    # ----------------------------------------------------------------- live versions

    def _published(self) -> str | None:
        """The policy version published for the live stream's next seq."""
        return ray.get(self.streams.versions.remote(self.s.live_stream))["policy"]

    def _follow_published(self) -> None:
        """Thread: every `live_poll_s`, switch to the newest published version."""
        while not self._stop.wait(self.s.live_poll_s):
            try:
                self._switch_to(self._published())
            except Exception:  # the controller restarting, a version still being written: retry
                log.exception("could not switch to the published version; retrying")

    def _switch_to(self, version: str | None) -> None:
        """Merge `version`'s adapter into the base weights (no lock held), then swap them in
        between two generations."""
        if version is None or version == self.policy:
            return
        start = time.perf_counter()
        adapter = adapter_dir(self.s.live_dir, version)
        weights = list(merged_lora_weights(self.s.model_dir, adapter))
        merged = time.perf_counter()
        with self._engine_lock:
            self.backend.load_weights(weights)
            previous, self.policy = self.policy, version
        log.info(
            "switched %s -> %s (merge %.2f s, swap %.2f s)",
            previous,
            version,
            merged - start,
            time.perf_counter() - merged,
        )

    def __del__(self) -> None:
        self._stop.set()

    async def _streams(self, method: str, *args: Any) -> Any:
        """Call the stream owner, mapping refusals to 4xx and an unreachable owner to 503."""
        try:
            return await getattr(self.streams, method).remote(*args)
        except UnknownStreamError as err:
            raise ApiError(404, _cause(err), param="stream", code="stream_not_found") from None
        except UnknownSeqError as err:
            raise ApiError(404, _cause(err), param="seq", code="unknown_seq") from None
        except AlreadyLabelledError as err:
            raise ApiError(409, _cause(err), param="seq", code="already_labelled") from None
        except LabelSourceError as err:
            raise ApiError(409, _cause(err), param="seq", code="label_source_fixed") from None
        except RayActorError as err:
            raise ApiError(
                503,
                f"the CSA controller is unavailable ({type(err).__name__}); retry",
                kind="unavailable",
            ) from None

    # ----------------------------------------------------------------- shadow verification

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _shadow_verify(
        self, stream: str, seq: int, answer: str | None, reference: str
    ) -> None:
        """Verify the majority answer (released or not) and apply the label; never raises."""
        try:
            passed = False
            if answer is not None:
                async with self._verify_lock:  # the pool replaces dead actors; one caller at a time
                    [(_, verdict)] = await asyncio.to_thread(
                        self.verifier.score, [boxed(answer)], [reference]
                    )
                passed = verdict == "correct"
            for attempt in range(_LABEL_RETRIES):
                try:
                    await self._streams("observe", stream, seq, passed, "shadow")
                    return
                except ApiError as err:
                    if err.status != 503:
                        # 409: the round is closed (its timeout came first); observe is idempotent.
                        return
                    await asyncio.sleep(0.25 * 2**attempt)
            log.warning("label of %s/%d not applied; its timeout will close it", stream, seq)
        except Exception:
            log.exception("shadow verification of %s/%d failed", stream, seq)
