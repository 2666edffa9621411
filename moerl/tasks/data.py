"""Rows of a local dataset as plain dicts: JSONL, Parquet, or a Hugging Face `datasets` directory.

    records = read_records("data/train.parquet")              # [(where, row), ...], where = "file row 3"
    answer = field(row, "reward_model.ground_truth")           # dotted path into nested fields

Formats (`format="auto"` picks one from the path):
    jsonl    one JSON object per line (blank lines skipped)
    parquet  a .parquet file or a directory of them (pyarrow); verl's layout among them: `prompt` a list of
             {role, content} messages, `reward_model` a struct holding `ground_truth`
    hf       a directory written by `datasets.Dataset.save_to_disk` (or a DatasetDict's: `split` picks one)

Data is untrusted: rows are only ever read as values (json, pyarrow), never evaluated, and every bad row is
reported with its file and line or row number at load, before any training starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moerl.tasks.base import TaskError

FORMATS = ("auto", "jsonl", "parquet", "hf")
_MISSING = object()


def detect_format(path: str) -> str:
    """"hf" for a `save_to_disk` directory, "parquet" for .parquet files (or a directory of them), else "jsonl"."""
    p = Path(path)
    if p.is_dir():
        if any((p / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
            return "hf"
        if any(p.glob("*.parquet")):
            return "parquet"
        raise TaskError(f"task data directory {path!r} holds neither a saved Hugging Face dataset "
                        "(dataset_info.json, state.json or dataset_dict.json) nor .parquet files")
    return "parquet" if p.suffix == ".parquet" else "jsonl"


def read_records(path: str, format: str = "auto", split: str = "train") -> list[tuple[str, dict[str, Any]]]:
    """(where, row) of every row; `where` names the file and line/row for error messages."""
    if not Path(path).exists():
        raise TaskError(f"task data file {path!r} not found")
    fmt = detect_format(path) if format == "auto" else format
    if fmt == "jsonl":
        return _read_jsonl(path)
    if fmt == "parquet":
        return _read_parquet(path)
    if fmt == "hf":
        return _read_hf(path, split)
    raise TaskError(f"unknown data format {format!r}; one of {', '.join(FORMATS)}")


def _read_jsonl(path: str) -> list[tuple[str, dict[str, Any]]]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TaskError(f"cannot read task data file {path!r}: {exc}") from exc
    out = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskError(f"{path}:{lineno}: invalid JSON: {exc}") from None
        if not isinstance(row, dict):
            raise TaskError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        out.append((f"{path}:{lineno}", row))
    return out


def _read_parquet(path: str) -> list[tuple[str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TaskError(f"reading {path!r} (Parquet) needs pyarrow: pip install pyarrow") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors (ArrowInvalid, OSError...) share no base
        raise TaskError(f"cannot read Parquet data {path!r}: {type(exc).__name__}: {exc}") from None
    return [(f"{path} row {i}", row) for i, row in enumerate(rows)]


def _read_hf(path: str, split: str) -> list[tuple[str, dict[str, Any]]]:
    try:
        import datasets
    except ImportError:
        raise TaskError(f"reading {path!r} (a saved Hugging Face dataset) needs datasets: "
                        "pip install datasets") from None
    try:
        loaded = datasets.load_from_disk(path)
    except Exception as exc:  # noqa: BLE001 - FileNotFoundError, json errors, arrow errors
        raise TaskError(f"cannot read the saved Hugging Face dataset {path!r}: {type(exc).__name__}: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise TaskError(f"{path}: no split {split!r} (splits: {', '.join(loaded)}); set the task option 'split'")
        loaded, path = loaded[split], f"{path}[{split}]"
    return [(f"{path} row {i}", row) for i, row in enumerate(loaded.to_list())]


def field(row: dict[str, Any], dotted: str) -> Any:
    """row[dotted] if that key exists, else the nested value at the dotted path ("reward_model.ground_truth";
    a number indexes a list: "prompt.0.content"). Raises KeyError(dotted) when absent."""
    if dotted in row:
        return row[dotted]
    value: Any = row
    for part in dotted.split("."):
        if isinstance(value, dict):
            value = value.get(part, _MISSING)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            value = _MISSING
        if value is _MISSING:
            raise KeyError(dotted)
    return value


def has_field(row: dict[str, Any], dotted: str) -> bool:
    try:
        field(row, dotted)
    except KeyError:
        return False
    return True
