"""The check's rows: each case's outcome, collected across the sections' processes."""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PASS, FAIL, DONE, SKIP, SKIPPED_TIME = "PASS", "FAIL", "done", "SKIP", "SKIPPED (time)"
CaseOutcome = tuple[str, str, dict[str, Any]]
"""(status, result text, raw numbers) of one case."""


@dataclass
class Row:
    """One line of the table; ``data`` holds the raw numbers for the JSON."""

    section: str
    case: str
    status: str
    result: str
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)


class Report:
    """A section's rows, appended to a JSON-lines file as each finishes (a section killed later
    keeps the rows it had), and the time after which no case starts."""

    def __init__(self, rows_file: Path, deadline: float) -> None:
        self.rows_file = rows_file
        self.deadline = deadline

    def add(self, row: Row) -> None:
        with self.rows_file.open("a") as f:
            f.write(json.dumps(asdict(row), default=str) + "\n")
        print(f"[{row.section}] {row.case}: {row.status} {row.result}", flush=True)

    def case(self, section: str, name: str, run: Callable[[], CaseOutcome]) -> None:
        """Run one case into one row: SKIPPED past the deadline, FAIL with the error on any
        exception (the traceback goes to the JSON and the log)."""
        if time.time() > self.deadline:
            self.add(Row(section, name, SKIPPED_TIME, "the time budget was spent"))
            return
        start = time.perf_counter()
        try:
            status, result, data = run()
        except Exception as err:
            trace = traceback.format_exc()
            print(trace, file=sys.stderr, flush=True)
            status, result = FAIL, f"{type(err).__name__}: {err}"[:500]
            data = {"traceback": trace[-4000:]}
        self.add(Row(section, name, status, result, time.perf_counter() - start, data))


def read_rows(path: Path) -> list[Row]:
    if not path.is_file():
        return []
    return [Row(**json.loads(line)) for line in path.read_text().splitlines() if line]


def markdown_table(rows: list[Row]) -> str:
    lines = ["| section | case | status | result | s |", "|---|---|---|---|---|"]
    for r in rows:
        result = r.result.replace("|", "/").replace("\n", " ")
        lines.append(f"| {r.section} | {r.case} | {r.status} | {result} | {r.seconds:.1f} |")
    return "\n".join(lines)
