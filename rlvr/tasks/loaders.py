"""Load user datasets of verifiable problems (JSON lines or parquet; fields id, prompt, answer).

GSM8K-style answers ("reasoning ... #### 42") and MATH-style answers (a solution ending in
\\boxed{...}) are recognised: the gold answer is extracted and the reasoning kept as the solution.
Reference-answer data with no verifier (fields id, prompt, reference) loads with
`load_reference_problems`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlvr.tasks.base import Problem
from rlvr.verifiers.extract import last_boxed

REQUIRED = ("id", "prompt", "answer")
OPTIONAL = ("solution", "reference")
JSON_LINES_SUFFIXES = (".jsonl", ".json")
# GSM8K's calculator annotations ("48/2 = <<48/2=24>>24") are tool calls, not reasoning to imitate.
_CALCULATOR = re.compile(r"<<[^<>\n]*>>")


def split_answer(raw: str) -> tuple[str, str]:
    """(gold answer, solution) from an answer field.

    "work #### 1,007" (GSM8K) gives ("1007", "work\\nThe answer is \\boxed{1007}."), so every
    solution ends in a boxed answer like the arithmetic task's; a text with a `\\boxed{...}` (MATH)
    gives the last boxed content (nested braces kept) and the text itself; anything else is the
    bare gold answer with no solution.
    """
    if "####" in raw:
        work, gold = raw.rsplit("####", 1)
        gold = gold.strip().replace(",", "")
        work = _CALCULATOR.sub("", work).strip()
        return gold, f"{work}\nThe answer is \\boxed{{{gold}}}." if work and gold else ""
    boxed = last_boxed(raw)
    if boxed is not None:
        return boxed, raw.strip()
    return raw.strip(), ""


def _missing(value: Any) -> bool:
    # Parquet nulls arrive as None; JSON's NaN and pandas-written gaps as float NaN.
    return value is None or (isinstance(value, float) and math.isnan(value))


def _check_type(record: dict, key: str, types: tuple[type, ...], where: str) -> None:
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        raise ValueError(f"{where}: field {key!r} must be {names}, got {type(value).__name__}")


def _problem(record: Any, where: str) -> Problem:
    if not isinstance(record, dict):
        raise ValueError(
            f"{where}: expected an object with fields {list(REQUIRED)}, got {type(record).__name__}"
        )
    missing = [k for k in REQUIRED if _missing(record.get(k))]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    _check_type(record, "id", (str, int), where)
    _check_type(record, "prompt", (str,), where)
    _check_type(record, "answer", (str, int, float), where)
    for key in OPTIONAL:
        if not _missing(record.get(key)):
            _check_type(record, key, (str,), where)
    if not record["prompt"].strip():
        raise ValueError(f"{where}: field 'prompt' is empty")
    gold, solution = split_answer(str(record["answer"]))
    if not gold:
        raise ValueError(f"{where}: field 'answer' holds no final answer")
    for key in OPTIONAL:
        if not _missing(record.get(key)) and record[key].strip():
            solution = record[key].strip()
            break
    return Problem(id=str(record["id"]), prompt=record["prompt"], answer=gold, solution=solution)


def _json_lines(path: Path) -> list[tuple[int, Any]]:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start})") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: row {number}: invalid JSON ({err.msg})") from None
    return records


def _parquet(path: Path) -> list[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises several types; all mean "not a readable table"
        raise ValueError(f"{path}: not a readable parquet file ({err})") from None
    return list(enumerate(rows, start=1))


def _load(path: str | Path, parse: Callable[[Any, str], Problem]) -> list[Problem]:
    """Every record of a JSON-lines or parquet file through `parse`, ids checked unique."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: dataset file not found")
    if path.suffix == ".parquet":
        records = _parquet(path)
    elif path.suffix in JSON_LINES_SUFFIXES:
        records = _json_lines(path)
    else:
        raise ValueError(f"{path}: unknown dataset format (use .jsonl, .json lines or .parquet)")
    if not records:
        raise ValueError(f"{path}: the dataset is empty (no records)")
    problems = []
    first_row: dict[str, int] = {}
    for row, record in records:
        problem = parse(record, f"{path}: row {row}")
        if problem.id in first_row:
            raise ValueError(
                f"{path}: row {row}: duplicate id {problem.id!r} (first at row {first_row[problem.id]})"
            )
        first_row[problem.id] = row
        problems.append(problem)
    return problems


def load_problems(path: str | Path) -> list[Problem]:
    """All problems of a JSON-lines (.jsonl/.json) or .parquet file, in file order.

    Every error is a ValueError naming the file and, for a bad record, its row (the line number
    in a JSON-lines file, the 1-based row in a parquet file).
    """
    return _load(path, _problem)


REFERENCE_REQUIRED = ("id", "prompt", "reference")


def _reference_problem(record: Any, where: str) -> Problem:
    if not isinstance(record, dict):
        raise ValueError(
            f"{where}: expected an object with fields {list(REFERENCE_REQUIRED)}, "
            f"got {type(record).__name__}"
        )
    missing = [k for k in REFERENCE_REQUIRED if _missing(record.get(k))]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    _check_type(record, "id", (str, int), where)
    for key in ("prompt", "reference", "solution"):
        if not _missing(record.get(key)):
            _check_type(record, key, (str,), where)
    if not _missing(record.get("answer")):
        _check_type(record, "answer", (str, int, float), where)
    for key in ("prompt", "reference"):
        if not record[key].strip():
            raise ValueError(f"{where}: field {key!r} is empty")
    answer = "" if _missing(record.get("answer")) else str(record["answer"]).strip()
    solution = "" if _missing(record.get("solution")) else record["solution"].strip()
    return Problem(
        id=str(record["id"]),
        prompt=record["prompt"],
        answer=answer,
        solution=solution,
        reference=record["reference"],
    )


def load_reference_problems(path: str | Path) -> list[Problem]:
    """Problems with a free-text reference answer and no verifier (DRO data), in file order.

    JSON lines or parquet with fields id, prompt and `reference` (the reference final answer,
    kept verbatim, whitespace included, because it is tokenized as it stands), plus optional
    `answer` (a gold answer for exact evaluation, when one exists) and `solution` (a worked
    solution for SFT warm-up). Note the difference from `load_problems`, where `reference` is an
    alias of `solution`. Errors name the file and row as `load_problems` does.
    """
    return _load(path, _reference_problem)
