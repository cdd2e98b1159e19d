"""Per-request logic of the CSA-gated OpenAI-compatible server (arXiv:2605.20270), without Ray.

Request validation (every bad input becomes an `ApiError` with a 4xx status before any state
changes), the self-consistency vote and its raw score, the response bodies, and `Calibration`: the
frozen isotonic score map plus grid that `rlvr calibrate` writes next to a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from rlvr.algorithms.csa import Calibrator, majority_answer, make_grid
from rlvr.answers import extract_answer
from rlvr.files import atomic_write_text
from rlvr.tasks.prompts import DEFAULT_INSTRUCTION, PROMPT_SLOT, with_instruction

CALIBRATION_FILE = "csa_calibration.json"
"""Name of the calibration artefact inside a checkpoint directory."""
DEFAULT_ALPHAS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3)
"""Budgets whose grids `rlvr calibrate` writes for inspection (the paper's sweep)."""
_CALIBRATION_FORMAT = 1

T = TypeVar("T", bound=BaseModel)


# --------------------------------------------------------------------------- errors


class ApiError(Exception):
    """A request the server refuses, with its HTTP status and an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """`{"error": {message, type, param, code}}` as the OpenAI API returns it."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


# --------------------------------------------------------------------------- requests


class _OpenAIRequest(BaseModel):
    # OpenAI clients send fields this server does not use (user, logprobs, ...): ignore them, but
    # type-check every field that is read.
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    n: StrictInt | None = Field(None, ge=1)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    stream: StrictBool | None = None
    # Accepted for compatibility and ignored: sampling is fixed by the calibration (the score map
    # is only valid for the K, temperature and top_p it was fit with).
    temperature: StrictFloat | StrictInt | None = Field(None, ge=0)
    top_p: StrictFloat | StrictInt | None = Field(None, gt=0, le=1)
    metadata: dict[StrictStr, StrictStr] | None = None
    """`csa_stream` picks the stream; `reference` (a gold answer) turns on shadow verification."""


class TextPart(BaseModel):
    """One text part of a multi-part message content."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One chat turn; content is a string or a list of text parts (absent only beside an
    assistant's `tool_calls`, which `check_generation_request` refuses with the reason)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    tool_calls: list[Any] | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs content (or an assistant's tool_calls)")
        return self

    def text(self) -> str:
        """The content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_OpenAIRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    """Read only to refuse: see `TOOLS_NOT_CERTIFIED`."""


class CompletionRequest(_OpenAIRequest):
    """POST /v1/completions (one prompt string)."""

    prompt: StrictStr | list[StrictStr]


class FeedbackRequest(BaseModel):
    """POST /v1/feedback: the verifier's label for a decided round."""

    model_config = ConfigDict(extra="forbid")
    seq: StrictInt = Field(ge=0)
    passed: StrictBool
    stream: StrictStr | None = None


def parse_body(raw: bytes, schema: type[T]) -> T:
    """Validate a JSON request body against `schema`; ApiError 400 naming the bad field if not."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ApiError(400, f"request body is not valid JSON: {err}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "request body nests too deeply", code="invalid_json") from None
    except ValueError as err:  # an integer past Python's digit limit for int(str)
        raise ApiError(
            400, f"request body holds an unreadable value: {err}", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    if not _valid_unicode(data):
        raise ApiError(
            400,
            "request body holds text that is not valid Unicode (a lone surrogate)",
            code="invalid_json",
        )
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<body>'}: {e['msg']}" for e in err.errors()
        )
        raise ApiError(400, f"invalid request: {problems}", param=param) from None


def _valid_unicode(data: Any) -> bool:
    """Whether every string (and key) in parsed JSON encodes as UTF-8: JSON's \\uD800-style
    escapes can produce lone surrogates, which no tokenizer takes. Iterative: the parser already
    bounded the depth, and this walk adds no recursion."""
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return False
    return True


def served_prompt(
    calibration: Calibration, req: ChatCompletionRequest | CompletionRequest
) -> list[dict[str, str]] | str:
    """The prompt rendered as the calibration rendered its own: chat turns (for the chat
    template) with the calibration instruction in the last user turn, or raw text with it.

    The release score is only calibrated for prompts of that form (`Calibration`); a text
    completion under a chat calibration becomes one user turn, and chat under a raw calibration
    is refused (a conversation has no faithful raw form)."""
    if isinstance(req, CompletionRequest):
        prompt = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
        text = instructed(prompt, calibration.instruction)
        return [{"role": "user", "content": text}] if calibration.chat_template else text
    if not calibration.chat_template:
        raise ApiError(
            400,
            "this server's release score was calibrated on raw prompts without a chat template; "
            "send the prompt to /v1/completions",
            param="messages",
            code="chat_not_calibrated",
        )
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise ApiError(
            400,
            "messages need a user turn (the calibration instruction goes into the last one)",
            param="messages",
        )
    last = messages[users[-1]]
    last["content"] = instructed(last["content"], calibration.instruction)
    return messages


def instructed(text: str, instruction: str) -> str:
    """`with_instruction`, except that a text already ending with a plain instruction is kept
    (a client that renders calibration-style prompts itself does not get it twice)."""
    plain = instruction.strip()
    if plain and PROMPT_SLOT not in instruction and text.rstrip().endswith(plain):
        return text
    return with_instruction(text, instruction)


@dataclass(frozen=True)
class GenerationAsk:
    """What a validated completion request asks of the server."""

    max_tokens: int
    seed: int | None
    stream: str
    reference: str | None


TOOLS_NOT_CERTIFIED = (
    "tools are not served behind the CSA gate: its certificate bounds the error rate of the final "
    "answers it releases (the majority of K samples, scored, decided and later verified), and a "
    "tool call is not such an answer: the vote cannot pick it, a verifier cannot label it, and its "
    "arguments could carry an answer past the gate. Send the conversation without tools, tool "
    "messages or tool_calls; evaluate an agent with its tools by `rlvr evaluate`"
)


def _asks_for_tools(req: ChatCompletionRequest | CompletionRequest) -> str | None:
    """The field of a chat request that asks for tool calling, or None."""
    if not isinstance(req, ChatCompletionRequest):
        return None
    if req.tools:
        return "tools"
    if req.tool_choice not in (None, "none"):
        return "tool_choice"
    for i, message in enumerate(req.messages):
        if message.role == "tool":
            return f"messages.{i}.role"
        if message.tool_calls:
            return f"messages.{i}.tool_calls"
    return None


def check_generation_request(
    req: ChatCompletionRequest | CompletionRequest,
    served_model: str,
    max_tokens_cap: int,
    default_stream: str,
) -> GenerationAsk:
    """The request's generation ask, or ApiError for what this server cannot do (no state read)."""
    if req.model != served_model:
        raise ApiError(
            404,
            f"model {req.model!r} is not served here (GET /v1/models lists {served_model!r})",
            param="model",
            code="model_not_found",
        )
    if req.stream:
        raise ApiError(
            400,
            "stream=true is not supported: the release decision needs the whole answer",
            param="stream",
        )
    tool_field = _asks_for_tools(req)
    if tool_field is not None:
        raise ApiError(400, TOOLS_NOT_CERTIFIED, param=tool_field, code="tools_not_certified")
    if req.n not in (None, 1):
        raise ApiError(
            400, f"n must be 1 (the gate releases one majority answer), got {req.n}", param="n"
        )
    if isinstance(req, CompletionRequest) and isinstance(req.prompt, list) and len(req.prompt) != 1:
        raise ApiError(400, "prompt must be one string (batches are not supported)", "prompt")
    asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if asked is not None and asked != max_tokens_cap:
        # Another budget would be another score definition per request (a new scorer, which
        # only a new epoch may bring): refused rather than silently changed.
        raise ApiError(
            400,
            f"max_tokens={asked}: this server samples exactly {max_tokens_cap} tokens, the "
            "budget its release score was calibrated with; omit max_tokens or send that value",
            param="max_tokens",
            code="max_tokens_fixed",
        )
    meta = req.metadata or {}
    reference = meta.get("reference")
    return GenerationAsk(
        max_tokens=max_tokens_cap,
        seed=req.seed,
        stream=meta.get("csa_stream", default_stream),
        reference=reference if reference else None,
    )


# --------------------------------------------------------------------------- self-consistency


@dataclass(frozen=True)
class Vote:
    """Majority answer of K samples, raw score 1 - agreement, and the sample that is released."""

    answer: str | None
    raw: float
    index: int


def vote(texts: Sequence[str]) -> Vote:
    """Extract each sample's final answer and take the majority (Sec. 4.2, K self-consistency
    samples).

    The released text is the first sample whose answer is the majority one (the first sample
    when no answer could be extracted, raw = 1), so the verifier labels what was released.
    """
    answers = [extract_answer(t) for t in texts]
    answer, raw = majority_answer(answers)
    return Vote(answer, raw, 0 if answer is None else answers.index(answer))


def boxed(answer: str) -> str:
    """A response whose extracted answer is exactly `answer`: what the verifier is shown."""
    return f"\\boxed{{{answer}}}"


# --------------------------------------------------------------------------- responses


def csa_object(
    decision: dict[str, Any] | None,
    stream: str,
    score: float,
    vote_: Vote,
    k: int,
    verification: str,
    policy: str | None = None,
) -> dict[str, Any]:
    """The `csa` field of every completion: the decision, its inputs and the versions used.

    `decision` is the stream's reply (None when the gate is off: everything is released);
    `policy` the version that generated the answer (live updates may differ from `versions`,
    the one published for the seq, while a replica has not switched yet).
    """
    released = True if decision is None else bool(decision["release"])
    return {
        "stream": stream if decision is not None else None,
        "seq": None if decision is None else decision["seq"],
        "score": score,
        "raw_score": vote_.raw,
        "k": k,
        "threshold": None if decision is None else decision["threshold"],
        "released": released,
        "answer": vote_.answer if released else None,
        "epoch": None if decision is None else decision["epoch"],
        "versions": None if decision is None else decision["versions"],
        "policy_version": policy,
        "verification": verification,
    }


def completion_body(
    kind: Literal["chat", "text"],
    model: str,
    content: str,
    prompt_tokens: int,
    completion_tokens: int,
    csa: dict[str, Any],
) -> dict[str, Any]:
    """An OpenAI chat.completion / text_completion body carrying `content` and the `csa` field."""
    if kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "finish_reason": "stop",
            "logprobs": None,
        }
        prefix, obj = "chatcmpl", "chat.completion"
    else:
        choice = {"index": 0, "text": content, "finish_reason": "stop", "logprobs": None}
        prefix, obj = "cmpl", "text_completion"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "csa": csa,
    }


# --------------------------------------------------------------------------- calibration


@dataclass
class Calibration:
    """The frozen score definition of a served checkpoint: sampling, isotonic map, CAL scores.

    The score of a request is g(1 - agreement) for K samples drawn with (temperature, top_p,
    max_tokens) on a prompt rendered with `instruction` (through the chat template unless
    `chat_template` is false); any change to these or to g is a new scorer (`version`), which
    starts a new epoch on every stream (certificates earned under the old score say nothing about
    the new one). Serving renders every prompt the same way (`served_prompt`). Grids come from the
    calibrated CAL scores (`grid`).
    """

    calibrator: Calibrator
    raw_scores: list[float]
    passed: list[bool]
    k: int
    temperature: float
    top_p: float
    max_tokens: int
    m: int = 15
    spacing: str = "geometric"
    instruction: str = DEFAULT_INSTRUCTION
    chat_template: bool = True
    checkpoint: str = ""
    problem_ids: list[str] = field(default_factory=list)
    source: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def fit(cls, raw_scores: Sequence[float], passed: Sequence[bool], **kw: Any) -> Calibration:
        """Isotonic fit of failure on the raw scores of a CAL split."""
        raw = [float(r) for r in raw_scores]
        ok = [bool(p) for p in passed]
        return cls(calibrator=Calibrator.fit(raw, ok), raw_scores=raw, passed=ok, **kw)

    @property
    def cal_scores(self) -> np.ndarray:
        """Calibrated CAL scores `[n_cal]` (the grid's quantiles come from these)."""
        return np.asarray(self.calibrator(np.asarray(self.raw_scores)), dtype=np.float64)

    def score(self, raw: float) -> float:
        """Calibrated score s = g(raw), the estimated failure probability."""
        return float(self.calibrator(float(raw)))

    def grid(self, alpha: float, m: int | None = None, spacing: str | None = None) -> np.ndarray:
        """Threshold grid for budget alpha (`make_grid`); ValueError if none fits under the cap."""
        return make_grid(self.cal_scores, alpha, m or self.m, spacing or self.spacing)

    @property
    def version(self) -> str:
        """Scorer version: a digest of everything that defines the score."""
        key = json.dumps(
            [
                self.calibrator.to_dict(),
                self.k,
                self.temperature,
                self.top_p,
                self.max_tokens,
                self.instruction,
                self.chat_template,
            ],
            sort_keys=True,
        )
        return "g-" + hashlib.sha256(key.encode()).hexdigest()[:12]

    def to_dict(self, alphas: Sequence[float] = DEFAULT_ALPHAS) -> dict[str, Any]:
        """JSON-plain artefact; `grids` holds the grid (or why there is none) for each of `alphas`."""
        grids: dict[str, Any] = {}
        for a in alphas:
            try:
                grids[f"{a:g}"] = self.grid(a).tolist()
            except ValueError as err:
                grids[f"{a:g}"] = {"error": str(err)}
        return {
            "format": _CALIBRATION_FORMAT,
            "version": self.version,
            "calibrator": self.calibrator.to_dict(),
            "k": self.k,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            "m": self.m,
            "spacing": self.spacing,
            "instruction": self.instruction,
            "chat_template": self.chat_template,
            "checkpoint": self.checkpoint,
            "n_cal": len(self.raw_scores),
            "accuracy": float(np.mean(self.passed)) if self.passed else None,
            "grids": grids,
            "raw_scores": self.raw_scores,
            "passed": self.passed,
            "problem_ids": self.problem_ids,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        """Inverse of `to_dict` (the grids are derived, so they are recomputed, not read)."""
        if d.get("format") != _CALIBRATION_FORMAT:
            raise ValueError(f"unknown calibration format {d.get('format')!r}")
        return cls(
            calibrator=Calibrator.from_dict(d["calibrator"]),
            raw_scores=[float(r) for r in d["raw_scores"]],
            passed=[bool(p) for p in d["passed"]],
            k=int(d["k"]),
            temperature=float(d["temperature"]),
            top_p=float(d["top_p"]),
            max_tokens=int(d["max_tokens"]),
            m=int(d["m"]),
            spacing=str(d["spacing"]),
            instruction=str(d["instruction"]),
            chat_template=bool(d.get("chat_template", True)),
            checkpoint=str(d["checkpoint"]),
            problem_ids=[str(i) for i in d["problem_ids"]],
            source=dict(d["source"]),
        )

    def save(self, path: str | Path, alphas: Sequence[float] = DEFAULT_ALPHAS) -> Path:
        """Write the artefact atomically; returns its path."""
        path = Path(path)
        atomic_write_text(path, json.dumps(self.to_dict(alphas), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Read an artefact; ValueError (naming the file) if it is unreadable or malformed."""
        path = Path(path)
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise ValueError(
                f"{path}: no calibration here; run `rlvr calibrate --checkpoint ...` first"
            ) from None
        except (OSError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: not a usable CSA calibration ({err})") from None
