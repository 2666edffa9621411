"""Optional Weights & Biases logging next to TensorBoard (`run.wandb = true`).

wandb is imported only when enabled; without it the run stops before anything starts, with one line naming
`pip install wandb`. `mode = "offline"` writes the run under `<run_dir>/wandb/` without a network (`wandb sync`
uploads it later). Every row is logged with its trainer step as `trainer_step`, the x-axis of every chart
(the warm start's steps are negative, and a resumed run logs some steps again: wandb's own step could not).
A resumed run continues the same wandb run (its id is kept in `<run_dir>/wandb_run_id`).
"""

from __future__ import annotations

import uuid
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

ID_FILE = "wandb_run_id"
STEP_KEY = "trainer_step"


class WandbMissing(RuntimeError):
    """`run.wandb = true` but the wandb package is not installed."""


def import_wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise WandbMissing("run.wandb = true needs the wandb package: pip install wandb") from None
    return wandb


class WandbLog:
    """One wandb run; logging errors warn once and switch it off (logging must never fail the run)."""

    def __init__(self, run_dir: str | Path, *, project: str, name: str, mode: str = "auto",
                 config: Mapping[str, Any] | None = None, resume: bool = False) -> None:
        wandb = import_wandb()
        self._wandb = wandb
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        id_path = run_dir / ID_FILE
        run_id = id_path.read_text().strip() if resume and id_path.exists() else ""
        if not run_id:
            run_id = uuid.uuid4().hex[:8]
            id_path.write_text(run_id + "\n")
        self.run = wandb.init(project=project, name=name or None, id=run_id, resume="allow", dir=str(run_dir),
                              mode=None if mode == "auto" else mode, config=dict(config or {}))
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        self._failed = False

    def log(self, step: int, row: Mapping[str, Any]) -> None:
        """The scalars of one metrics row (None values left out)."""
        data = {k: v for k, v in row.items() if k not in ("step", "time") and v is not None}
        data[STEP_KEY] = int(step)
        self._call(self.run.log, data)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """A few trajectory rows as a table: step, reward, prompt, completion, answer."""
        columns = ["step", "reward", "prompt", "completion", "answer"]
        def table() -> Any:
            return self._wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
        self._call(lambda: self.run.log({"samples": table(), STEP_KEY: int(step)}))

    def finish(self) -> None:
        self._call(self.run.finish)

    def _call(self, fn: Any, *args: Any) -> None:
        if self._failed:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - logging must not fail the run
            self._failed = True
            warnings.warn(f"Weights & Biases logging disabled after an error: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=3)
