"""DRO's rubric judge: query-specific binary rubrics written and judged by the frozen reference model.

`build_rubrics` writes at most 10 items per query from (query, reference answer) and keeps only the
items the reference itself satisfies (DRO, arXiv:2506.13351, Sec. 4.1 and App. E); our choice where
the paper is silent: regenerate up to twice and mark a query ungated when no item survives.
`judge_answers` rules on each rollout's final answer item by item (Sec. 4.1), with one retry of an
unparseable reply (our choice). Both run over a `RubricModel`: `ReferenceRubricModel` (a language
model on a generation backend, prompts after the paper's App. E) or `KeywordRubricModel`
(deterministic rules, for tests and for references whose essentials are literal values).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from rlvr.algorithms.dro import MAX_RUBRIC_ITEMS, parse_rubric_items, parse_rubric_judgment
from rlvr.files import atomic_write_text
from rlvr.generation.base import GenerationBackend, GenerationRequest, SamplingParams

MAX_ATTEMPTS = 3
"""Rubric generations per query: the first and up to two regenerations (our choice: the paper
does not say what happens when no item survives validation)."""

WRITER_PROMPT = """You write the essential guardrail rubrics for judging responses to a query.
You are given the query with its task description and a ground-truth response (a high-quality
answer). Infer the criteria any correct response must satisfy. Every rubric item must be:
1. binary: answerable Yes or No by reading a candidate response;
2. specific to the query and satisfied by the ground-truth response (concrete entities, values,
   steps), never mentioning "the ground truth" or adding constraints it does not support;
3. atomic: one requirement per item;
4. objective: no vague terms such as good or clear;
5. evaluator-consistent: two evaluators would agree;
6. non-overlapping with the other items.
Keep only essentials that catch critical errors, and make sure the ground-truth response satisfies
all items at once. Return only a JSON array of at most 10 items (ids 0-9):
[{"id": 0, "rubric_item": "..."}, {"id": 1, "rubric_item": "..."}]"""

JUDGE_PROMPT = """You evaluate a model response against a list of binary rubric items.
Judge every item independently, only on what the response says. Answer Yes only when the item is
clearly satisfied; answer No when it is not met, only partly met, or you are unsure. Do not be
lenient because of overall quality and do not infer intent. Return only a JSON array with one
entry per item:
[{"id": 0, "satisfied": true, "justification": "..."}, {"id": 1, "satisfied": false,
"justification": "..."}]"""


@dataclass(frozen=True)
class RubricQuery:
    """What the rubric writer sees: the query with its task description and the reference answer."""

    query: str
    reference: str


@dataclass(frozen=True)
class JudgeRequest:
    """One judgment: a query, a response (a rollout's final answer, or the reference), its items."""

    query: str
    response: str
    rubrics: tuple[str, ...]


@dataclass(frozen=True)
class RubricSet:
    """A query's validated rubric items; `ungated` when no generated item survived validation."""

    items: tuple[str, ...]
    ungated: bool
    attempts: int
    dropped: int
    """Generated items removed because the reference answer did not satisfy them."""


class RubricModel(Protocol):
    """Writes and judges rubrics, returning raw replies (parsed by `build_rubrics`/`judge_answers`).

    `attempt` counts retries from 0, so a model can decode retries differently from first tries.
    """

    def write(self, queries: Sequence[RubricQuery], attempt: int) -> list[str]: ...

    def judge(self, requests: Sequence[JudgeRequest], attempt: int) -> list[str]: ...


def rubric_json(items: Sequence[str]) -> str:
    """The rubric list as the judge sees it: `[{"id": k, "rubric_item": ...}]`, ids 0..K-1."""
    return json.dumps([{"id": k, "rubric_item": item} for k, item in enumerate(items)])


def judge_answers(
    model: RubricModel, requests: Sequence[JudgeRequest]
) -> tuple[list[np.ndarray], int]:
    """S_i `[K_i]` bool per request, and how many replies stayed unparseable after one retry.

    A request with no rubric items needs no judge (an empty row). Unparseable replies are retried
    once together; what still fails counts as all "No" (our choice: the paper does not cover
    unparseable replies, and its judge prompt says "No" when in doubt).
    """
    rows: list[np.ndarray | None] = [
        np.zeros(0, dtype=bool) if not r.rubrics else None for r in requests
    ]
    for attempt in range(2):
        pending = [i for i, row in enumerate(rows) if row is None]
        if not pending:
            break
        replies = model.judge([requests[i] for i in pending], attempt)
        for i, reply in zip(pending, replies, strict=True):
            rows[i] = parse_rubric_judgment(reply, range(len(requests[i].rubrics)))
    failed = sum(row is None for row in rows)
    return [
        np.zeros(len(r.rubrics), dtype=bool) if row is None else row
        for r, row in zip(requests, rows, strict=True)
    ], failed


def build_rubrics(
    model: RubricModel, queries: Sequence[RubricQuery], max_attempts: int = MAX_ATTEMPTS
) -> list[RubricSet]:
    """Validated rubric sets, one per query (arXiv:2506.13351, Sec. 4.1: items the reference
    answer fails are dropped).

    Each round writes items for the queries still without any, judges the reference answer
    against them and keeps the satisfied ones; after `max_attempts` rounds a query with none left
    is ungated (its gates pass automatically).
    """
    done: list[RubricSet | None] = [None] * len(queries)
    dropped = [0] * len(queries)
    for attempt in range(max_attempts):
        pending = [i for i, d in enumerate(done) if d is None]
        if not pending:
            break
        replies = model.write([queries[i] for i in pending], attempt)
        written = {
            i: items
            for i, reply in zip(pending, replies, strict=True)
            if (items := parse_rubric_items(reply, MAX_RUBRIC_ITEMS))
        }
        checks = [
            JudgeRequest(queries[i].query, queries[i].reference, tuple(items))
            for i, items in written.items()
        ]
        verdicts, _ = judge_answers(model, checks)
        for (i, items), satisfied in zip(written.items(), verdicts, strict=True):
            kept = tuple(item for item, ok in zip(items, satisfied, strict=True) if ok)
            dropped[i] += len(items) - len(kept)
            if kept:
                done[i] = RubricSet(kept, False, attempt + 1, dropped[i])
    return [
        d if d is not None else RubricSet((), True, max_attempts, dropped[i])
        for i, d in enumerate(done)
    ]


# --- the rubric cache ----------------------------------------------------------------------------


def save_rubrics(path: str | Path, rubrics: dict[str, RubricSet]) -> None:
    """Write query id -> rubric set as JSON (the cache kept beside the dataset)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "version": 1,
        "rubrics": {
            qid: {
                "items": list(r.items),
                "ungated": r.ungated,
                "attempts": r.attempts,
                "dropped": r.dropped,
            }
            for qid, r in rubrics.items()
        },
    }
    atomic_write_text(path, json.dumps(data, indent=1))


def load_rubrics(path: str | Path) -> dict[str, RubricSet]:
    """Read a `save_rubrics` file; a missing file is an empty cache."""
    path = Path(path)
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if data.get("version") != 1:
        raise ValueError(f"{path}: unknown rubric cache version {data.get('version')!r}")
    return {
        qid: RubricSet(tuple(r["items"]), bool(r["ungated"]), int(r["attempts"]), int(r["dropped"]))
        for qid, r in data["rubrics"].items()
    }


# --- rubric models -------------------------------------------------------------------------------

_CONTAINS = re.compile(r'^The response contains "(.+)"\.$')
_KEYWORD = re.compile(r"(?<![\w-])-?\d+(?:\.\d+)?|[A-Z][a-z]+")
# Capitalised only because they start a sentence.
_SENTENCE_STARTS = frozenset({"The", "A", "An", "From", "It", "In", "On", "This", "That"})


def _mentions(text: str, phrase: str) -> bool:
    # A whole-word match: "7" is not mentioned by "17", "-7" or "7.5".
    return re.search(rf"(?<![\w.-]){re.escape(phrase)}(?![\w]|\.\d)", text) is not None


class KeywordRubricModel:
    """A deterministic rule-based rubric author and judge over one item form.

    Items read `The response contains "X".`, one per number or name in the reference answer (up
    to 10); an item is satisfied when X occurs in the response as a whole word, and any other item
    form is judged "No". It answers in the same JSON the reference model is asked for, so it runs
    through the same parsing, validation and retry path.
    """

    def write(self, queries: Sequence[RubricQuery], attempt: int) -> list[str]:
        out = []
        for q in queries:
            keys = [k for k in _KEYWORD.findall(q.reference) if k not in _SENTENCE_STARTS]
            items = [f'The response contains "{k}".' for k in dict.fromkeys(keys)]
            out.append(rubric_json(items[:MAX_RUBRIC_ITEMS]))
        return out

    def judge(self, requests: Sequence[JudgeRequest], attempt: int) -> list[str]:
        out = []
        for r in requests:
            verdicts = []
            for k, item in enumerate(r.rubrics):
                match = _CONTAINS.match(item)
                ok = match is not None and _mentions(r.response, match.group(1))
                verdicts.append({"id": k, "satisfied": ok, "justification": "keyword rule"})
            out.append(json.dumps(verdicts))
        return out


class ReferenceRubricModel:
    """The frozen reference model as rubric author and judge, on any `GenerationBackend`.

    Prompts are the paper's App. E instructions (condensed) as a system turn and the inputs as a
    user turn, through the model's chat template. First tries decode greedily; retries sample at
    temperature 1 with a seed per attempt, since a greedy retry would only repeat itself. A prompt
    that leaves fewer than `min_reply_tokens` of the context gets an empty (unparseable) reply.
    """

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: Any,
        max_model_len: int,
        max_tokens: int = 512,
        seed: int = 0,
        min_reply_tokens: int = 16,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        self.seed = seed
        self.min_reply_tokens = min_reply_tokens

    def write(self, queries: Sequence[RubricQuery], attempt: int) -> list[str]:
        return self._complete(
            WRITER_PROMPT,
            [
                f"Query with task description:\n{q.query}\n\nGround-truth response:\n{q.reference}"
                for q in queries
            ],
            attempt,
        )

    def judge(self, requests: Sequence[JudgeRequest], attempt: int) -> list[str]:
        return self._complete(
            JUDGE_PROMPT,
            [
                f"Query with task description:\n{r.query}\n\nModel response:\n{r.response}\n\n"
                f"Rubric JSON:\n{rubric_json(r.rubrics)}"
                for r in requests
            ],
            attempt,
        )

    def _complete(self, system: str, users: list[str], attempt: int) -> list[str]:
        prompts = [
            [
                int(t)
                for t in self.tokenizer.apply_chat_template(
                    [{"role": "system", "content": system}, {"role": "user", "content": user}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            ]
            for user in users
        ]
        fits = [
            i for i, p in enumerate(prompts) if len(p) + self.min_reply_tokens < self.max_model_len
        ]
        replies = [""] * len(prompts)
        if not fits:
            return replies
        budget = min(self.max_tokens, self.max_model_len - 1 - max(len(prompts[i]) for i in fits))
        params = SamplingParams(
            temperature=0.0 if attempt == 0 else 1.0,
            max_tokens=budget,
            seed=self.seed + attempt,
        )
        requests = [GenerationRequest(prompts[i], n=1, request_id=str(i)) for i in fits]
        for i, result in zip(fits, self.backend.generate(requests, params), strict=True):
            replies[i] = result.samples[0].text
        return replies
