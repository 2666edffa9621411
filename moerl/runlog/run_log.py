"""What a run leaves in its directory: metrics, trajectories, expert loads, TensorBoard scalars.

Written by the controller (one process). Layout of `<run_dir>`:

    metrics.jsonl       one JSON object per trainer step: {"step", "time", **metrics}
    trajectories.jsonl  one JSON object per trained sample, appended in time order
    expert_load.json    per-layer expert counts of the last few step windows, rollout and trainer
    tensorboard/        TensorBoard event files (scalars of metrics.jsonl, sample completions as text), when
                        tensorboard is installed

Crash safety: the JSONL files are opened in append mode, line-buffered, and every call writes complete
lines and flushes, so a crash can leave at most a truncated last line; `read_jsonl` skips it, and a
resumed `RunLog` repairs it before appending. `expert_load.json` is replaced atomically.

A write that fails (a full disk) raises DiskWriteError naming the file, the cause and what was not logged; no
temporary file is left behind.

`time` is seconds since the run started; a resumed run continues from the last logged `time`.
Non-finite numbers are written as null (JSON has no NaN/Infinity).

TensorBoard gets one event per step holding all its scalars (as `add_scalar` would write them, at a
twentieth of its cost: 60 `add_scalar` calls took 3-16 ms of the controller's time per step), and closing it
waits at most `tensorboard_close_s` for the writer thread.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, Sequence

from moerl.runlog.disk import DiskWriteError, replace_atomically

METRICS_FILE = "metrics.jsonl"
TRAJECTORIES_FILE = "trajectories.jsonl"
EXPERT_LOAD_FILE = "expert_load.json"
TENSORBOARD_DIR = "tensorboard"
EXPERT_LOAD_VERSION = 1
EXPERT_LOAD_SOURCES = ("rollout", "trainer")

_tensorboard_warned = False


# ----------------------------------------------------------------------------------------------- reading


# The controller's step phases (moerl/loop/phases.py) as the progress line and the plots show them:
# (phase, short name, long name), stacked bottom to top in step_time.png.
STEP_PHASES = (("train_wait", "train", "waiting on the trainer"), ("idle", "rollout", "waiting on rollouts"),
               ("publish", "publish", "weight publish"), ("transfer", "transfer", "weight transfer"),
               ("controller", "ctl", "controller"), ("checkpoint", "ckpt", "checkpoint"))


def iter_jsonl(path: str | Path, *, strict: bool = True) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSONL file, in order. Blank lines are skipped; so is a last line that does
    not parse (a write cut short by a crash). A bad line elsewhere raises ValueError, or with
    `strict=False` is skipped with a warning."""
    with open(path, "rb") as f:  # line by line, one line held back: the last non-blank one may be cut short
        held: tuple[int, bytes] | None = None
        for i, raw in enumerate(f):
            if not raw.strip():
                continue
            if held is not None:
                obj = _jsonl_object(path, *held, last=False, strict=strict)
                if obj is not None:
                    yield obj
            held = (i, raw)
        if held is not None:
            obj = _jsonl_object(path, *held, last=True, strict=strict)
            if obj is not None:
                yield obj


def _jsonl_object(path: str | Path, i: int, raw: bytes, *, last: bool, strict: bool) -> dict[str, Any] | None:
    """Line `i` (from 0) of a JSONL file as an object; None for a truncated last line or (not strict) a bad one."""
    try:
        obj = json.loads(raw)
    except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError
        if last:
            return None  # truncated last line
        if strict:
            raise ValueError(f"{path}:{i + 1}: not a JSON line ({e})") from None
        warnings.warn(f"{path}:{i + 1}: skipping a line that is not JSON ({e})", stacklevel=3)
        return None
    if not isinstance(obj, dict):
        if strict:
            raise ValueError(f"{path}:{i + 1}: a JSON line must be an object, got {type(obj).__name__}")
        return None
    return obj


def read_jsonl(path: str | Path, *, strict: bool = True, missing_ok: bool = False) -> list[dict[str, Any]]:
    """All JSON objects of a JSONL file (see `iter_jsonl`); [] for a missing file when `missing_ok`."""
    if missing_ok and not Path(path).exists():
        return []
    return list(iter_jsonl(path, strict=strict))


def read_expert_load(run_dir: str | Path) -> dict[str, Any] | None:
    """The parsed `<run_dir>/expert_load.json`, or None when it is missing or unreadable."""
    path = Path(run_dir) / EXPERT_LOAD_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        warnings.warn(f"{path}: unreadable ({e}); ignored", stacklevel=2)
        return None
    if not isinstance(data, dict) or data.get("version") != EXPERT_LOAD_VERSION:
        warnings.warn(f"{path}: unknown format; ignored", stacklevel=2)
        return None
    return data


# ---------------------------------------------------------------------------------------------- helpers


def _to_python(value: Any) -> Any:
    """Tensors and numpy values to plain Python: 0-d via item(), arrays via tolist()."""
    if isinstance(value, (str, bytes, bool, int, float)) or value is None:
        return value
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def _json_safe(value: Any) -> Any:
    """A JSON-serializable copy: non-finite floats -> None, tuples -> lists, tensors -> lists."""
    value = _to_python(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (str, int)) or value is None:  # bool is an int
        return value
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return str(value)


def _metric_value(key: str, value: Any) -> int | float | None:
    """A metric as a finite int/float, or None when non-finite or None; TypeError when not a number."""
    value = _to_python(value)
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, numbers.Real):  # float, Fraction, Decimal-like
        value = float(value)
        return value if math.isfinite(value) else None
    raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}: {value!r}")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False, ensure_ascii=False)


def _trim_after(path: Path, step: int) -> tuple[int, float | None]:
    """Drop the rows of steps after `step` from a JSONL file, line by line (a run's trajectories can be many GB:
    reading them whole took ~11x their size), into a temporary that replaces it atomically (a crash leaves the
    old file or the new one). Lines that are not JSON objects go too. Returns the rows dropped and the last
    kept row's `time`."""
    dropped, bad, last_time = 0, 0, None

    def write(tmp: Path) -> None:
        nonlocal dropped, bad, last_time
        with open(tmp, "wb") as out:
            if not path.exists():
                return
            with open(path, "rb") as rows:
                for raw in rows:
                    if not raw.strip():
                        continue
                    try:
                        row = json.loads(raw)
                    except ValueError:  # json.JSONDecodeError and UnicodeDecodeError
                        row = None
                    if not isinstance(row, dict):
                        bad += 1
                        continue
                    if isinstance(row.get("step"), int) and row["step"] > step:
                        dropped += 1
                        continue
                    out.write(raw if raw.endswith(b"\n") else raw + b"\n")
                    if isinstance(row.get("time"), (int, float)):
                        last_time = float(row["time"])
    try:
        replace_atomically(path, write)
    except OSError as e:
        raise DiskWriteError(path, e, f"the rows after step {step} were not dropped (the file is as it was)") from e
    if bad:
        warnings.warn(f"{path}: dropped {bad} line(s) that are not JSON objects", stacklevel=3)
    return dropped, last_time


def _repair_tail(path: Path) -> None:
    """Make a JSONL file end in a newline before appending: a last line that parses gets its newline, a
    truncated one (a crash mid-write) is cut off, so the next line does not glue onto it."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        pos, chunk = size, 1 << 16
        start = 0
        while pos > 0:  # find the last newline, reading backwards
            lo = max(0, pos - chunk)
            f.seek(lo)
            buf = f.read(pos - lo)
            idx = buf.rfind(b"\n")
            if idx >= 0:
                start = lo + idx + 1
                break
            pos = lo
        f.seek(start)
        tail = f.read()
        try:
            ok = isinstance(json.loads(tail), dict)
        except ValueError:
            ok = False
        if ok:
            f.seek(0, os.SEEK_END)
            f.write(b"\n")
        else:
            f.truncate(start)


def _as_counts_LE(counts_LE: Any) -> list[list[int]]:
    if hasattr(counts_LE, "detach"):
        counts_LE = counts_LE.detach().cpu()
    rows = _to_python(counts_LE)
    if isinstance(rows, tuple):
        rows = list(rows)
    if not isinstance(rows, list) or not all(isinstance(r, (list, tuple)) for r in rows):
        raise ValueError("counts_LE must be a 2-D [layers, experts] array of counts")
    if not rows:
        return []
    num_experts = len(rows[0])
    if num_experts == 0 or any(len(r) != num_experts for r in rows):
        raise ValueError("counts_LE must be a rectangular [layers, experts] array with at least one expert")
    out = []
    for r in rows:
        row = []
        for c in r:
            c = _to_python(c)
            if isinstance(c, float):
                if not math.isfinite(c):
                    raise ValueError(f"counts_LE holds a non-finite count: {c}")
                c = int(round(c))
            if not isinstance(c, int) or c < 0:
                raise ValueError(f"counts_LE must hold non-negative counts, got {c!r}")
            row.append(int(c))
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------------- RunLog


class RunLog:
    """The run's metrics, trajectories and expert loads on disk (see the module docstring).

    resume=False starts a new run: metrics.jsonl and trajectories.jsonl are truncated and the old
    expert_load.json dropped. resume=True keeps the history and appends; TensorBoard discards events of
    the earlier attempt at steps >= the first step logged now (the steps being redone).

    Expert loads: counts of one step go to the window `step // expert_load_window_steps`; the last
    `expert_load_windows` windows per source are kept.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        resume: bool = False,
        expert_load_window_steps: int = 10,
        expert_load_windows: int = 5,
        tensorboard_flush_secs: int = 10,
        tensorboard_close_s: float = 10.0,
    ) -> None:
        if expert_load_window_steps < 1 or expert_load_windows < 1:
            raise ValueError("expert_load_window_steps and expert_load_windows must be >= 1")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.trajectories_path = self.run_dir / TRAJECTORIES_FILE
        self.expert_load_path = self.run_dir / EXPERT_LOAD_FILE
        self.tensorboard_dir = self.run_dir / TENSORBOARD_DIR
        self.resume = resume
        self.window_steps = expert_load_window_steps
        self.max_windows = expert_load_windows
        self._tensorboard = tensorboard
        self._tb_flush_secs = tensorboard_flush_secs
        self._tb_close_s = tensorboard_close_s
        self._tb_writer: Any = None
        self._tb_failed = False
        self._lock = threading.Lock()
        self._closed = False
        self._expert_dirty = False
        self._expert: dict[str, list[dict[str, Any]]] = {s: [] for s in EXPERT_LOAD_SOURCES}

        time_offset = 0.0
        if resume:
            for p in (self.metrics_path, self.trajectories_path):
                _repair_tail(p)
            for row in iter_jsonl(self.metrics_path, strict=False) if self.metrics_path.exists() else ():
                if isinstance(row.get("time"), (int, float)):
                    time_offset = float(row["time"])  # the last one: read line by line, never the file whole
            self._load_expert_load()
        else:
            self.expert_load_path.unlink(missing_ok=True)
        mode = "a" if resume else "w"
        self._metrics = open(self.metrics_path, mode, buffering=1, encoding="utf-8")
        self._trajectories = open(self.trajectories_path, mode, buffering=1, encoding="utf-8")
        self._t0 = time.monotonic() - time_offset

    # ------------------------------------------------------------------------------------------ public

    def elapsed(self) -> float:
        """Seconds since the run started (continuing across a resume)."""
        return time.monotonic() - self._t0

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Append one line {"step", "time", **metrics} to metrics.jsonl, write the scalars to TensorBoard,
        and refresh expert_load.json. Returns the row written. TypeError for a non-numeric value."""
        row: dict[str, Any] = {"step": int(step), "time": round(self.elapsed(), 3)}
        for key, value in metrics.items():
            if key in ("step", "time"):
                continue
            row[str(key)] = _metric_value(str(key), value)
        line = _dumps(row) + "\n"
        with self._lock:
            self._check_open()
            try:
                self._metrics.write(line)
                self._metrics.flush()
            except OSError as e:
                raise DiskWriteError(self.metrics_path, e, f"step {step}'s metrics row was not logged") from e
            self._write_tensorboard(row)
            if self._expert_dirty:
                self._save_expert_load()
        return row

    def truncate_after(self, step: int) -> int:
        """Drop the rows an earlier attempt logged after `step`, the checkpoint this run resumes from: those
        steps are trained again and would otherwise be logged twice. Returns the number of rows dropped."""
        dropped = 0
        with self._lock:
            self._check_open()
            self._metrics.close()
            self._trajectories.close()
            for path in (self.metrics_path, self.trajectories_path):
                n, last_time = _trim_after(path, step)
                dropped += n
                if path == self.metrics_path:
                    self._t0 = time.monotonic() - (last_time or 0.0)
            self._metrics = open(self.metrics_path, "a", buffering=1, encoding="utf-8")
            self._trajectories = open(self.trajectories_path, "a", buffering=1, encoding="utf-8")
        return dropped

    def log_trajectories(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append one JSON line per row to trajectories.jsonl, in the order given, and flush."""
        if not rows:
            return
        text = "".join(_dumps(_json_safe(dict(r))) + "\n" for r in rows)
        with self._lock:
            self._check_open()
            try:
                self._trajectories.write(text)
                self._trajectories.flush()
            except OSError as e:
                steps = sorted({r.get("step") for r in rows if isinstance(r.get("step"), int)})
                raise DiskWriteError(self.trajectories_path, e, f"{len(rows)} trajectories"
                                     + (f" of step {steps[-1]}" if steps else "") + " were not logged") from e

    def log_text(self, step: int, tag: str, text: str) -> None:
        """A markdown text summary in TensorBoard (its Text tab) at `step`; nothing without TensorBoard."""
        with self._lock:
            self._check_open()
            if self._tb_writer is None and not self._open_tensorboard(step):
                return
            try:
                self._tb_writer.add_text(tag, text, global_step=int(step))
            except Exception as e:  # noqa: BLE001 - logging must not fail the run
                self._tb_failed = True
                warnings.warn(f"TensorBoard logging disabled after an error: {e}", RuntimeWarning, stacklevel=2)

    def log_expert_load(self, step: int, source: Literal["rollout", "trainer"], counts_LE: Any) -> None:
        """Add [layers, experts] token counts (list of lists, tensor or array) of `source` at `step`
        to its window (a [0, experts] array, a model without MoE layers, is ignored). Written to expert_load.json at the next `log_step` or `flush`/`close`."""
        if source not in EXPERT_LOAD_SOURCES:
            raise ValueError(f"source must be one of {EXPERT_LOAD_SOURCES}, got {source!r}")
        counts = _as_counts_LE(counts_LE)
        if not counts:
            return  # no MoE layers
        step = int(step)
        window = step // self.window_steps
        with self._lock:
            self._check_open()
            windows = self._expert[source]
            shape = [len(counts), len(counts[0])]
            if windows and windows[-1]["shape"] != shape:
                warnings.warn(
                    f"expert load of {source} changed shape {windows[-1]['shape']} -> {shape}; "
                    "older windows dropped",
                    stacklevel=2,
                )
                windows.clear()
            cur = next((w for w in windows if w["window"] == window), None)
            if cur is None:
                if len(windows) >= self.max_windows and window < windows[0]["window"]:
                    return  # older than every window kept
                cur = {"window": window, "first_step": step, "last_step": step, "calls": 0, "shape": shape,
                       "counts": [[0] * shape[1] for _ in range(shape[0])]}
                windows.append(cur)
                windows.sort(key=lambda w: w["window"])
                del windows[: max(0, len(windows) - self.max_windows)]
            cur["first_step"] = min(cur["first_step"], step)
            cur["last_step"] = max(cur["last_step"], step)
            cur["calls"] += 1
            acc = cur["counts"]
            for acc_row, row in zip(acc, counts):
                for e, c in enumerate(row):
                    acc_row[e] += c
            self._expert_dirty = True

    def flush(self) -> None:
        """Flush everything to disk (JSONL files, expert_load.json, TensorBoard)."""
        with self._lock:
            if self._closed:
                return
            self._metrics.flush()
            self._trajectories.flush()
            if self._expert_dirty:
                self._save_expert_load()
            if self._tb_writer is not None:
                self._tb_writer.flush()

    def close(self) -> None:
        """Flush, fsync the JSONL files and close everything. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._expert_dirty:
                self._save_expert_load()
            for f in (self._metrics, self._trajectories):
                try:
                    f.flush()
                    os.fsync(f.fileno())
                except OSError:
                    pass
                f.close()
            if self._tb_writer is not None:
                self._close_tensorboard()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------------- private

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("RunLog is closed")

    def _open_tensorboard(self, step: int) -> bool:
        """Create the TensorBoard writer at the first step logged; False when TensorBoard is off or missing."""
        if not self._tensorboard or self._tb_failed:
            return False
        global _tensorboard_warned
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception as e:  # noqa: BLE001 - ImportError, or a broken protobuf/tensorboard install
            self._tb_failed = True
            if not _tensorboard_warned:
                _tensorboard_warned = True
                warnings.warn(
                    f"TensorBoard logging disabled: {e} (pip install tensorboard)", RuntimeWarning, stacklevel=4
                )
            return False
        # On resume, events of the earlier attempt at steps >= this one are superseded. The queue holds a
        # few hundred events so that logging never waits for the writer thread.
        self._tb_writer = SummaryWriter(
            log_dir=str(self.tensorboard_dir),
            purge_step=step if self.resume else None,
            max_queue=256,
            flush_secs=self._tb_flush_secs,
        )
        return True

    def _write_tensorboard(self, row: dict[str, Any]) -> None:
        if self._tb_writer is None and not self._open_tensorboard(row["step"]):
            return
        scalars = [(k, v) for k, v in row.items() if k != "step" and v is not None]
        try:
            from tensorboard.compat.proto.summary_pb2 import Summary

            summary = Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in scalars])
            self._tb_writer._get_file_writer().add_summary(summary, row["step"], None)
        except (ImportError, AttributeError):  # another torch/tensorboard layout: the public, slower path
            try:
                for key, value in scalars:
                    self._tb_writer.add_scalar(key, value, global_step=row["step"])
            except Exception as e:  # noqa: BLE001 - logging must not fail the run
                self._tb_failed = True
                warnings.warn(f"TensorBoard logging disabled after an error: {e}", RuntimeWarning, stacklevel=3)
        except Exception as e:  # noqa: BLE001 - logging must not fail the run
            self._tb_failed = True
            warnings.warn(f"TensorBoard logging disabled after an error: {e}", RuntimeWarning, stacklevel=3)

    def _close_tensorboard(self) -> None:
        """Flush and close the writer on a thread of its own, waiting at most `tensorboard_close_s`: a writer
        stuck on a slow filesystem costs its last events, never the end of the run."""
        writer, self._tb_writer = self._tb_writer, None
        error: list[BaseException] = []

        def close() -> None:
            try:
                writer.close()
            except BaseException as e:  # noqa: BLE001
                error.append(e)

        thread = threading.Thread(target=close, name="tensorboard-close", daemon=True)
        thread.start()
        thread.join(self._tb_close_s)
        if thread.is_alive():
            warnings.warn(f"TensorBoard writer still flushing after {self._tb_close_s:.0f} s; its last events "
                          "may be missing", RuntimeWarning, stacklevel=3)
        elif error:
            warnings.warn(f"closing TensorBoard writer failed: {error[0]}", RuntimeWarning, stacklevel=3)

    def _save_expert_load(self) -> None:
        data = {
            "version": EXPERT_LOAD_VERSION,
            "window_steps": self.window_steps,
            "max_windows": self.max_windows,
            **{s: self._expert[s] for s in EXPERT_LOAD_SOURCES},
        }
        try:
            replace_atomically(self.expert_load_path, lambda tmp: tmp.write_text(_dumps(data)))
        except OSError as e:
            raise DiskWriteError(self.expert_load_path, e, "the expert loads since its last write were not "
                                 "saved") from e
        self._expert_dirty = False

    def _load_expert_load(self) -> None:
        data = read_expert_load(self.run_dir)
        if data is None:
            return
        for s in EXPERT_LOAD_SOURCES:
            windows = [
                w for w in data.get(s) or []
                if isinstance(w, dict) and all(k in w for k in ("window", "first_step", "last_step", "calls",
                                                                 "shape", "counts"))
            ]
            # Window boundaries from another window size would not line up; keep them, they are history.
            self._expert[s] = windows[-self.max_windows:]
