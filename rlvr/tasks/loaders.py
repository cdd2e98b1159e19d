"""Load user datasets of verifiable problems: in our layout, or as public datasets publish them.

Sources: a JSON-lines (.jsonl/.json; .json also one array of records; either gzipped), parquet or
arrow file; a directory of such shards (read in sorted name order); a directory written by `datasets.Dataset.save_to_disk`; or a glob pattern.

Columns: ours are id, prompt, answer (plus optional solution/reference). Without a field map the
layout is recognised from the columns of its rows and logged (see `LAYOUTS`): GSM8K
(question/answer with "####"), MATH (problem/solution with \\boxed, optional answer/unique_id),
MBPP (text or prompt, test_list, task_id) and HumanEval (prompt, test, entry_point, task_id);
columns that fit several layouts fail, asking for `task.fields`, which maps our names onto the
file's columns instead (`{"prompt": "question"}`).

GSM8K-style answers ("reasoning ... #### 42") and MATH-style answers (a solution ending in
\\boxed{...}) are recognised: the gold answer is extracted and the reasoning kept as the solution.
Code tasks put their tests into the answer as the JSON text of `CODE_ANSWER_FORMAT`.
A prompt may be a list of chat messages; `Problem.messages` keeps it for rendering. A row's other
columns, and the items of a `metadata` object column, become `Problem.metadata` (for reward
plug-ins, `verifier.kind: python`).
Missing ids are derived from the prompt (`derived_id`). Reference-answer data with no verifier
(fields id, prompt, reference) loads with `load_reference_problems`.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rlvr.answers import last_boxed
from rlvr.tasks.base import Problem

log = logging.getLogger(__name__)

REQUIRED = ("id", "prompt", "answer")
FIELD_TARGETS = ("id", "prompt", "answer", "solution", "reference", "tests")
"""Our names a field map (`task.fields`) may map onto a file's columns."""
JSON_LINES_SUFFIXES = (".jsonl", ".json")
TABLE_SUFFIXES = (".parquet", ".arrow")
SHARD_SUFFIXES = JSON_LINES_SUFFIXES + TABLE_SUFFIXES
ROLES = ("system", "user", "assistant")
CODE_ANSWER_FORMAT = {"asserts": ["assert f(1) == 2"], "setup": "import math"}
"""The answer of a code task, as JSON text: `asserts`, Python sources run one by one after the
candidate's code, each passing when it raises nothing (MBPP's one-line asserts; HumanEval's `check`
function followed by `check(<entry_point>)`); `setup`, present only when the data has some
(MBPP's test_setup_code or test_imports), runs before them."""
# GSM8K's calculator annotations ("48/2 = <<48/2=24>>24") are tool calls, not reasoning to imitate.
_CALCULATOR = re.compile(r"<<[^<>\n]*>>")
# Hugging Face hub shard names: "train-00000-of-00002.parquet".
_HUB_SHARD = re.compile(r"^(?P<split>.+?)-\d{5}-of-\d{5}(?P<ext>\..+)$")


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


@dataclass(frozen=True)
class Columns:
    """Which column holds each of our fields in one file (None: the file has none)."""

    layout: str
    prompt: str
    answer: str | None = None
    id: str | None = None
    solution: str | None = None
    reference: str | None = None
    tests: str | None = None
    """A code task's tests (a list of assert sources, or one source): the answer is their JSON."""
    setup: str | None = None
    """Code run before a code task's tests (MBPP's test_setup_code, or test_imports: a list)."""
    entry_point: str | None = None
    """HumanEval's function name: its `check(candidate)` test is called on it."""
    tests_in_prompt: bool = False
    """MBPP: the prompt ends with the tests, which name the function to write."""
    required: tuple[str, ...] = ()
    """Columns every row must fill (those a field map names, the layout's defining ones)."""

    def describe(self) -> str:
        pairs = [
            f"{ours} <- {theirs}"
            for ours, theirs in (
                ("id", self.id),
                ("prompt", self.prompt),
                ("answer", self.answer),
                ("solution", self.solution),
                ("reference", self.reference),
                ("tests", self.tests),
                ("setup", self.setup),
                ("entry_point", self.entry_point),
            )
            if theirs is not None
        ]
        if self.id is None:
            pairs.append("id derived from the prompt")
        return ", ".join(pairs)


def _own(cols: set[str]) -> Columns:
    return Columns(
        "id/prompt/answer",
        prompt="prompt",
        answer="answer",
        id="id" if "id" in cols else None,
        solution="solution" if "solution" in cols else None,
        reference="reference" if "reference" in cols else None,
        required=("prompt", "answer"),
    )


def _ours(cols: set[str]) -> Columns | None:
    return _own(cols) if {"prompt", "answer"} <= cols else None


def _gsm8k(cols: set[str]) -> Columns | None:
    if not {"question", "answer"} <= cols:
        return None
    return Columns(
        "GSM8K",
        prompt="question",
        answer="answer",
        id="id" if "id" in cols else None,
        required=("question", "answer"),
    )


def _math(cols: set[str]) -> Columns | None:
    if not {"problem", "solution"} <= cols:
        return None
    return Columns(
        "MATH",
        prompt="problem",
        answer="answer" if "answer" in cols else "solution",
        solution="solution",
        id=next((c for c in ("id", "unique_id") if c in cols), None),
        required=("problem", "solution"),
    )


def _mbpp(cols: set[str]) -> Columns | None:
    prompt = next((c for c in ("text", "prompt") if c in cols), None)
    if prompt is None or "test_list" not in cols:
        return None
    return Columns(
        "MBPP",
        prompt=prompt,
        tests="test_list",
        setup=next((c for c in ("test_setup_code", "test_imports") if c in cols), None),
        id=next((c for c in ("task_id", "id") if c in cols), None),
        tests_in_prompt=True,
        required=(prompt, "test_list"),
    )


def _humaneval(cols: set[str]) -> Columns | None:
    if not {"prompt", "test", "entry_point"} <= cols:
        return None
    return Columns(
        "HumanEval",
        prompt="prompt",
        tests="test",
        entry_point="entry_point",
        id=next((c for c in ("task_id", "id") if c in cols), None),
        required=("prompt", "test", "entry_point"),
    )


LAYOUTS: tuple[tuple[str, Callable[[set[str]], Columns | None]], ...] = (
    ("id/prompt/answer (ours)", _ours),
    ("GSM8K: question, answer with '#### <gold>'", _gsm8k),
    ("MATH: problem, solution with \\boxed{<gold>}, optional answer and unique_id", _math),
    ("MBPP: text or prompt, test_list, task_id, optional test_setup_code/test_imports", _mbpp),
    ("HumanEval: prompt, test, entry_point, task_id", _humaneval),
)
"""The layouts recognised without a field map, each by the columns it needs."""


def field_map_columns(fields: Mapping[str, str], cols: set[str]) -> Columns:
    """Columns of a file under a field map (our name -> its column); unmapped fields of ours are
    read from columns of our own name when the file has them."""
    unknown = sorted(set(fields) - set(FIELD_TARGETS))
    if unknown:
        raise ValueError(f"task.fields: unknown field(s) {unknown} (known: {list(FIELD_TARGETS)})")
    if "tests" in fields and "answer" in fields:
        raise ValueError("task.fields: map either 'answer' or 'tests' (a code task's answer)")

    def column(name: str) -> str | None:
        if name in fields:
            return fields[name]
        return name if name in cols else None

    tests = fields.get("tests")
    prompt = fields.get("prompt", "prompt")
    answer = None if tests else fields.get("answer", "answer")
    required = tuple(c for c in (prompt, answer, tests, fields.get("id")) if c is not None)
    return Columns(
        "field map",
        prompt=prompt,
        answer=answer,
        tests=tests,
        id=column("id"),
        solution=column("solution"),
        reference=column("reference"),
        required=required,
    )


def detect_columns(
    path: Path, row: int, cols: set[str] | None, fields: Mapping[str, str] | None = None
) -> Columns:
    """The columns of a dataset whose records hold the columns `cols` (None: its first record, at
    `row` of `path`, is no object): through the field map when one is given, else the one layout
    of `LAYOUTS` they fit (logged). Several fits fail, asking for a field map; none: our own
    layout, whose row checks name the missing fields (or the columns, when none is ours)."""
    if cols is None:
        return _own(set())  # the row's own check names it
    if fields:
        found = field_map_columns(fields, cols)
        log.info("%s: columns by task.fields: %s", path, found.describe())
        return found
    fits = [(name, c) for name, match in LAYOUTS if (c := match(cols)) is not None]
    if len(fits) > 1:
        raise ValueError(
            f"{path}: row {row}: the columns {sorted(cols)} fit several layouts "
            f"({'; '.join(name for name, _ in fits)}): name the fields with task.fields, e.g. "
            "task.fields.prompt=<column> and task.fields.answer=<column>"
        )
    if not fits:
        if cols & set(REQUIRED):
            return _own(cols)
        raise ValueError(
            f"{path}: row {row}: the columns {sorted(cols)} fit no known layout ("
            + "; ".join(name for name, _ in LAYOUTS)
            + "): name the fields with task.fields, e.g. task.fields.prompt=<column> and "
            "task.fields.answer=<column>"
        )
    _, found = fits[0]
    log.info("%s: recognised the %s layout: %s", path, found.layout, found.describe())
    return found


def _missing(value: Any) -> bool:
    # Parquet nulls arrive as None; JSON's NaN and pandas-written gaps as float NaN.
    return value is None or (isinstance(value, float) and math.isnan(value))


def _check_type(record: dict, key: str, types: tuple[type, ...], where: str) -> None:
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        raise ValueError(f"{where}: field {key!r} must be {names}, got {type(value).__name__}")


def _messages(value: list, key: str, where: str) -> tuple[tuple[str, str], ...]:
    """A prompt given as chat messages, checked: role/content objects ending in a user turn."""
    if not value:
        raise ValueError(f"{where}: field {key!r} is an empty list of messages")
    turns = []
    for i, message in enumerate(value, start=1):
        at = f"{where}: field {key!r} message {i}"
        if not isinstance(message, dict):
            raise ValueError(f"{at}: expected an object with role and content")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"{at}: role must be one of {list(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"{at}: content must be str, got {type(content).__name__}")
        turns.append((role, content))
    if turns[-1][0] != "user":
        raise ValueError(f"{where}: field {key!r}: the last message must be the user's turn")
    if not turns[-1][1].strip():
        raise ValueError(f"{where}: field {key!r}: the last user turn is empty")
    return tuple(turns)


def _asserts(record: dict, cols: Columns, where: str) -> str:
    """A code task's answer: its tests as the JSON text of `CODE_ANSWER_FORMAT`."""
    key = cols.tests
    value = record[key]
    if isinstance(value, str):
        asserts = [value]
    elif isinstance(value, list) and all(isinstance(a, str) for a in value):
        asserts = list(value)
    else:
        raise ValueError(f"{where}: field {key!r} must be a list of str or str")
    if not any(a.strip() for a in asserts):
        raise ValueError(f"{where}: field {key!r} holds no tests")
    if cols.entry_point is not None:
        _check_type(record, cols.entry_point, (str,), where)
        asserts = [f"{a.rstrip()}\n\ncheck({record[cols.entry_point]})\n" for a in asserts]
    answer: dict[str, Any] = {"asserts": asserts}
    if cols.setup is not None and not _missing(record.get(cols.setup)):
        setup = record[cols.setup]
        if isinstance(setup, list) and all(isinstance(s, str) for s in setup):
            setup = "\n".join(setup)
        if not isinstance(setup, str):
            raise ValueError(f"{where}: field {cols.setup!r} must be str or a list of str")
        if setup.strip():
            answer["setup"] = setup
    return json.dumps(answer)


def _metadata(record: dict, cols: Columns, where: str) -> tuple[tuple[str, Any], ...]:
    """A row's extra data for reward plug-ins: the columns no field of ours reads (missing values
    left out), then the items of a `metadata` object column, which win over a column's."""
    used = {
        cols.prompt,
        cols.answer,
        cols.id,
        cols.solution,
        cols.reference,
        cols.tests,
        cols.setup,
        cols.entry_point,
        "metadata",
    }
    extra = {k: v for k, v in record.items() if k not in used and not _missing(v)}
    given = record.get("metadata")
    if not _missing(given):
        if not isinstance(given, dict):
            raise ValueError(
                f"{where}: field 'metadata' must be an object, got {type(given).__name__}"
            )
        extra.update(given)
    return tuple(extra.items())


def _problem_from(record: Any, where: str, cols: Columns, chat_template: bool = True) -> Problem:
    """One record through `cols`; a missing id is left empty for `_load` to derive."""
    if not isinstance(record, dict):
        raise ValueError(
            f"{where}: expected an object with fields {list(cols.required)}, "
            f"got {type(record).__name__}"
        )
    missing = [k for k in cols.required if _missing(record.get(k))]
    if cols.id is not None and cols.id not in missing and _missing(record.get(cols.id)):
        missing.append(cols.id)
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    if cols.id is not None:
        _check_type(record, cols.id, (str, int), where)
    _check_type(record, cols.prompt, (str, list), where)
    for key in (cols.solution, cols.reference):
        if key is not None and not _missing(record.get(key)):
            _check_type(record, key, (str,), where)
    raw = record[cols.prompt]
    messages: tuple[tuple[str, str], ...] = ()
    if isinstance(raw, list):
        if not chat_template:
            raise ValueError(
                f"{where}: field {cols.prompt!r} is a list of chat messages, which "
                "task.chat_template=false cannot render as raw text: give a text prompt or "
                "set task.chat_template=true"
            )
        messages = _messages(raw, cols.prompt, where)
        prompt = messages[-1][1]
    else:
        prompt = raw
    if not prompt.strip():
        raise ValueError(f"{where}: field {cols.prompt!r} is empty")
    solution = ""
    if cols.tests is not None:
        answer = _asserts(record, cols, where)
        if cols.tests_in_prompt:
            tests = json.loads(answer)["asserts"]
            prompt = f"{prompt.rstrip()}\nYour code should pass these tests:\n" + "\n".join(tests)
            if messages:
                messages = (*messages[:-1], ("user", prompt))
    else:
        _check_type(record, cols.answer, (str, int, float), where)
        answer, solution = split_answer(str(record[cols.answer]))
        if not answer:
            raise ValueError(f"{where}: field {cols.answer!r} holds no final answer")
    for key in (cols.solution, cols.reference):  # a worked solution, else its `reference` alias
        if key is not None and not _missing(record.get(key)) and record[key].strip():
            solution = record[key].strip()
            break
    return Problem(
        id="" if cols.id is None else str(record[cols.id]),
        prompt=prompt,
        answer=answer,
        solution=solution,
        messages=messages,
        metadata=_metadata(record, cols, where),
    )


def derived_id(problem: Problem) -> str:
    """An id from the prompt alone (its messages when it has them): the first 12 hex digits of the
    SHA-256 of its UTF-8 text, the same on every run and machine, and unchanged when other rows
    are added, dropped or reordered. `_load` suffixes repeats of a prompt (-2, -3, ...)."""
    text = json.dumps(problem.messages) if problem.messages else problem.prompt
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def _kind(path: Path) -> str:
    """A dataset file's format by its name: its suffix, past a `.gz` (gzipped JSON)."""
    if path.suffix == ".gz" and Path(path.stem).suffix in JSON_LINES_SUFFIXES:
        return Path(path.stem).suffix
    return path.suffix


def _json_lines(path: Path) -> list[tuple[int, Any]]:
    """JSON lines (rows numbered by line); a `.json` file may instead hold one JSON document,
    an array of records (rows numbered by item) or a single record."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as err:
            raise ValueError(f"{path}: not a readable gzip file ({err})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start})") from None
    if _kind(path) == ".json":
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # JSON lines, or broken: the lines say which
        if isinstance(whole, list):
            return list(enumerate(whole, start=1))
        if isinstance(whole, dict):
            return [(1, whole)]
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


def _arrow(path: Path) -> list[tuple[int, Any]]:
    """An arrow IPC file: the stream format `datasets` writes, or the random-access file format."""
    import pyarrow as pa

    errors = []
    for opener in (pa.ipc.open_stream, pa.ipc.open_file):
        try:
            with pa.memory_map(str(path)) as source:
                rows = opener(source).read_all().to_pylist()
            return list(enumerate(rows, start=1))
        except Exception as err:  # pyarrow raises several types; all mean "not this format"
            errors.append(str(err))
    raise ValueError(f"{path}: not a readable arrow file ({errors[-1]})")


def _read(path: Path) -> list[tuple[int, Any]]:
    kind = _kind(path)
    if kind == ".parquet":
        return _parquet(path)
    if kind == ".arrow":
        return _arrow(path)
    if kind in JSON_LINES_SUFFIXES:
        return _json_lines(path)
    raise ValueError(
        f"{path}: unknown dataset format (use .jsonl, .json, either gzipped, .parquet, .arrow "
        "or a directory)"
    )


def _saved_dataset(path: Path) -> list[tuple[Path, int, Any]]:
    """Rows of a `datasets.Dataset.save_to_disk` directory: through `datasets.load_from_disk`
    when `datasets` is installed, else the arrow shards its state.json lists, read with pyarrow."""
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        loaded = datasets.load_from_disk(str(path))
        if not isinstance(loaded, datasets.Dataset):
            raise ValueError(
                f"{path}: a dataset with several splits {sorted(loaded)}: point the path at "
                "one split's directory"
            )
        log.info("%s: read with datasets.load_from_disk", path)
        return [(path, row, record) for row, record in enumerate(loaded.to_list(), start=1)]
    try:
        state = json.loads((path / "state.json").read_text())
        shards = [path / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"{path}: state.json of a saved dataset is unreadable ({err}); "
            "installing the `datasets` package lets datasets.load_from_disk read it"
        ) from None
    log.info("%s: saved dataset read from its arrow shards (datasets is not installed)", path)
    return [(shard, row, record) for shard in shards for row, record in _arrow(shard)]


def _shards(path: Path) -> list[Path]:
    """A directory's dataset files, sorted by name: one format, one split."""
    files = sorted(p for p in path.iterdir() if p.is_file() and _kind(p) in SHARD_SUFFIXES)
    if not files:
        raise ValueError(
            f"{path}: the directory holds no dataset files "
            f"({', '.join(SHARD_SUFFIXES)} or a save_to_disk dataset)"
        )
    suffixes = sorted({_kind(p) for p in files})
    if len(suffixes) > 1 and not set(suffixes) <= set(JSON_LINES_SUFFIXES):
        raise ValueError(f"{path}: the directory mixes dataset formats {suffixes}")
    shards = {m["split"]: m["ext"] for p in files if (m := _HUB_SHARD.match(p.name))}
    if len(shards) > 1:
        split = max(shards)
        raise ValueError(
            f"{path}: the directory holds the shards of several splits {sorted(shards)}: give "
            f"one split's shards as a pattern, e.g. {path / (split + '-*' + shards[split])}"
        )
    return files


def read_records(path: str | Path) -> list[tuple[Path, int, Any]]:
    """(file, 1-based row, record) of every record of a dataset file, shard directory, saved
    dataset directory or glob pattern, in order: shards by sorted name, rows in file order."""
    path = Path(path).expanduser()
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
            raise ValueError(
                f"{path}: a dataset with several splits {splits}: point the path at one split's "
                "directory"
            )
        if (path / "state.json").is_file():
            return _saved_dataset(path)
        files = _shards(path)
        log.info("%s: %d shard(s): %s", path, len(files), ", ".join(p.name for p in files))
    elif path.is_file():
        files = [path]
    elif glob.has_magic(str(path)):
        files = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file())
        if not files:
            raise ValueError(f"{path}: no dataset file matches")
    else:
        raise ValueError(f"{path}: dataset file not found")
    return [(f, row, record) for f in files for row, record in _read(f)]


def _load(
    path: str | Path,
    parse: Callable[[Any, str, Columns], Problem],
    fields: Mapping[str, str] | None,
    detect: Callable[[Path, int, set[str] | None, Mapping[str, str] | None], Columns],
) -> list[Problem]:
    """Every record through `parse` with the columns `detect` finds; ids derived where the file
    has none, and checked unique."""
    records = read_records(path)
    if not records:
        raise ValueError(f"{path}: the dataset is empty (no records)")
    first_file, first_row, first = records[0]
    # JSON lines may fill different columns in different rows: detection sees them all
    columns = set().union(*(r for _, _, r in records if isinstance(r, dict)))
    cols = detect(first_file, first_row, columns if isinstance(first, dict) else None, fields)
    one_file = all(f == first_file for f, _, _ in records)
    problems = []
    first_at: dict[str, str] = {}
    repeats: dict[str, int] = {}
    for file, row, record in records:
        where = f"{file}: row {row}"
        problem = parse(record, where, cols)
        if not problem.id:
            base = derived_id(problem)
            repeats[base] = repeats.get(base, 0) + 1
            if repeats[base] > 1:
                log.warning("%s: the same prompt as %s", where, first_at[base])
            problem = replace(problem, id=base if repeats[base] == 1 else f"{base}-{repeats[base]}")
        if problem.id in first_at:
            raise ValueError(
                f"{where}: duplicate id {problem.id!r} (first at {first_at[problem.id]})"
            )
        first_at[problem.id] = f"row {row}" if one_file else where
        problems.append(problem)
    return problems


def load_problems(
    path: str | Path, fields: Mapping[str, str] | None = None, chat_template: bool = True
) -> list[Problem]:
    """All problems of a dataset (see `read_records` for the sources), in order.

    `fields` (task.fields) maps our names (`FIELD_TARGETS`) onto the file's columns; without it the
    layout is recognised from the columns (`LAYOUTS`). `chat_template` false refuses prompts
    given as chat messages (raw-text rendering has no turns). Every error is a ValueError naming
    the file and, for a bad record, its row (the line number in a JSON-lines file, the 1-based
    row in a parquet or arrow file or item of a JSON array) and field.
    """

    def parse(record: Any, where: str, cols: Columns) -> Problem:
        return _problem_from(record, where, cols, chat_template)

    return _load(path, parse, fields, detect_columns)


def _reference_columns(
    path: Path, row: int, cols: set[str] | None, fields: Mapping[str, str] | None
) -> Columns:
    if cols is None:  # the first record is no object: its row's check names it
        return Columns("reference", prompt="prompt", reference="reference", id="id")
    mapped = dict(fields or {})
    unknown = sorted(set(mapped) - {"id", "prompt", "reference", "answer", "solution"})
    if unknown:
        raise ValueError(f"task.fields: field(s) {unknown} do not apply to reference_file data")

    def column(name: str) -> str | None:
        return mapped.get(name, name if name in cols else None)

    return Columns(
        "reference",
        prompt=mapped.get("prompt", "prompt"),
        reference=mapped.get("reference", "reference"),
        answer=column("answer"),
        solution=column("solution"),
        id=column("id"),
    )


def _reference_problem(record: Any, where: str, cols: Columns) -> Problem:
    required = tuple(c for c in (cols.id, cols.prompt, cols.reference) if c is not None)
    if not isinstance(record, dict):
        raise ValueError(
            f"{where}: expected an object with fields {list(required)}, got {type(record).__name__}"
        )
    missing = [k for k in required if _missing(record.get(k))]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}")
    if cols.id is not None:
        _check_type(record, cols.id, (str, int), where)
    for key in (cols.prompt, cols.reference, cols.solution):
        if key is not None and not _missing(record.get(key)):
            _check_type(record, key, (str,), where)
    if cols.answer is not None and not _missing(record.get(cols.answer)):
        _check_type(record, cols.answer, (str, int, float), where)
    for key in (cols.prompt, cols.reference):
        if not record[key].strip():
            raise ValueError(f"{where}: field {key!r} is empty")
    has = cols.answer is not None and not _missing(record.get(cols.answer))
    solution = cols.solution is not None and not _missing(record.get(cols.solution))
    return Problem(
        id="" if cols.id is None else str(record[cols.id]),
        prompt=record[cols.prompt],
        answer=str(record[cols.answer]).strip() if has else "",
        solution=record[cols.solution].strip() if solution else "",
        reference=record[cols.reference],
    )


def load_reference_problems(
    path: str | Path, fields: Mapping[str, str] | None = None
) -> list[Problem]:
    """Problems with a free-text reference answer and no verifier (DRO data), in file order.

    JSON lines, parquet or arrow (a file, a shard directory or a saved dataset) with fields id,
    prompt and `reference` (the reference final answer, kept verbatim, whitespace included,
    because it is tokenized as it stands), plus optional `answer` (a gold answer for exact
    evaluation, when one exists) and `solution` (a worked solution for SFT warm-up). Note the
    difference from `load_problems`, where `reference` is an alias of `solution`. `fields` maps
    these names onto the file's columns; a file with no id column gets derived ids. Prompts are
    text. Errors name the file and row as `load_problems` does.
    """
    return _load(path, _reference_problem, fields, _reference_columns)
