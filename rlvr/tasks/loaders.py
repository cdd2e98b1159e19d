"""Load user datasets (JSONL or parquet) of verifiable problems: fields id, prompt, answer.

GSM8K-style answers ("reasoning ... #### 42") and MATH-style answers (a solution ending in
\\boxed{42}) are recognised: the gold answer is extracted and the full text kept as the solution.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlvr.tasks.base import Problem
from rlvr.verifiers.extract import last_boxed

REQUIRED = ("id", "prompt", "answer")


def split_answer(raw: str) -> tuple[str, str]:
    """(gold answer, solution text) from a raw answer field."""
    if "####" in raw:
        solution, gold = raw.rsplit("####", 1)
        return gold.strip().replace(",", ""), raw.strip()
    boxed = last_boxed(raw)
    if boxed is not None:
        return boxed.strip(), raw.strip()
    return raw.strip(), ""


def _problem(record: Any, where: str) -> Problem:
    if not isinstance(record, dict):
        raise ValueError(
            f"{where}: expected an object with fields {REQUIRED}, got {type(record).__name__}"
        )
    missing = [k for k in REQUIRED if k not in record or record[k] is None]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    for key in ("prompt", "answer"):
        if not isinstance(record[key], str | int | float) or isinstance(record[key], bool):
            raise ValueError(
                f"{where}: field {key!r} must be a string, got {type(record[key]).__name__}"
            )
    if not str(record["prompt"]).strip():
        raise ValueError(f"{where}: field 'prompt' is empty")
    gold, solution = split_answer(str(record["answer"]))
    if not gold:
        raise ValueError(f"{where}: field 'answer' holds no final answer")
    solution = str(record.get("solution") or record.get("reference") or solution)
    return Problem(
        id=str(record["id"]), prompt=str(record["prompt"]), answer=gold, solution=solution
    )


def load_problems(path: str | Path) -> list[Problem]:
    """All problems of a .jsonl / .json-lines or .parquet file; errors name the file and row."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: dataset file not found")
    if path.suffix == ".parquet":
        import pandas as pd

        records = pd.read_parquet(path).to_dict(orient="records")
        problems = [_problem(r, f"{path}: row {i + 1}") for i, r in enumerate(records)]
    else:
        problems = []
        for i, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: row {i + 1}: invalid JSON ({err.msg})") from None
            problems.append(_problem(record, f"{path}: row {i + 1}"))
    if not problems:
        raise ValueError(f"{path}: the dataset is empty")
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{path}: duplicate id {dup!r}")
    return problems
