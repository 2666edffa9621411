"""`moerl train` as a command: arguments, exit codes, and the lines a user sees before, at the end of, and after a
run (moerl/run.py runs it). Exit 0 when the run finished; 1 when it failed; 2 when the config or an input is wrong
(found before anything started); 128 + the signal (143 SIGTERM, 130 Ctrl-C) when stopped: saved, resumable.

run.prepare and run.train are reached through the module, so a test can stand in for either.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path

from moerl import preflight, run
from moerl.config import MoerlConfig
from moerl.preflight import one_line
from moerl.redact import redact
from moerl.train_args import parse_train_args


def main(argv: list[str]) -> int:
    """`moerl train`: exit 0 when the run finished; 1 when it failed; 2 when the config or an input is wrong
    (found before anything started); 128 + the signal (143 SIGTERM, 130 Ctrl-C) when stopped: saved, resumable."""
    from moerl.config import ConfigError, load_config

    args = parse_train_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {redact(str(e))}", file=sys.stderr)
        return 2
    debug = cfg.run.log_level == "debug"
    resume = args.resume or args.resume_step is not None
    if args.resume_if_saved and not resume:  # a restarted job continues; its first start starts the run
        from moerl.checkpoint import CheckpointStore

        with contextlib.suppress(Exception):  # an unreadable store: preflight reports it in one line
            resume = CheckpointStore(cfg.checkpoint_dir(), cfg.checkpoint.storage_timeout_s).latest_step() is not None
    again = shlex.join(["moerl", "train", args.config, *args.overrides])  # the same command, without --resume
    run._local_ray_auth(cfg)  # before anything imports Ray (TrainerLost below does): Ray reads the mode at import
    previous = _on_sigterm(_stop_before_start)  # until the loop's own handlers: the checks may wait for Ray
    try:
        return _prepare_and_train(cfg, resume, args.resume_step, debug, again, args.resume_override)
    except StoppedBeforeStart:
        print("stopped by SIGTERM before the run started: nothing was trained", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        _on_sigterm(previous)


class StoppedBeforeStart(BaseException):
    """SIGTERM before the run's own stop handlers are in place (the checks, the imports): nothing to save.
    A BaseException, as KeyboardInterrupt: no `except Exception` on the way swallows it."""


def _stop_before_start(signum: int, frame) -> None:
    raise StoppedBeforeStart


def _on_sigterm(handler):
    """Set SIGTERM's handler (main thread only); returns the one before."""
    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)


def _prepare_and_train(cfg: MoerlConfig, resume: bool, resume_step: int | None, debug: bool, again: str,
                       overrides: Sequence[str] = ()) -> int:
    try:
        prepared = run.prepare(cfg, resume=resume, resume_step=resume_step, resume_overrides=overrides)
    except KeyboardInterrupt:
        print("interrupted before the run started: nothing was trained", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - every input problem is one line; the traceback with log_level=debug
        _error(e, debug)
        return 2
    if prepared.complete:  # nothing to train: no Ray, nothing rolled back
        prepared.release()
        for note in prepared.notes:
            print(note, file=sys.stderr)
        print(f"the run is complete: checkpoint step {prepared.resume_step} is train.steps={cfg.train.steps}; "
              "nothing to train (raise --train.steps to train on)")
        return 0
    from moerl.actors.pools import TrainerLost

    try:
        try:
            result = run.train(cfg, resume=resume, prepared=prepared)
        finally:
            prepared.release()  # the run directory is free again, however the run ended
    except KeyboardInterrupt:  # a second Ctrl-C
        print(f"aborted at step {preflight.last_logged_step(Path(cfg.run.dir))} of {cfg.train.steps} by a second "
              f"Ctrl-C{_resume_hint(cfg, again)}", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001
        from moerl.runlog.disk import DiskWriteError

        _error(e, debug, Path(cfg.run.dir), f" ({again} --resume)" if isinstance(e, TrainerLost) and
               "--resume" in str(e) else _resume_hint(cfg, again) if isinstance(e, DiskWriteError) else "")
        return 1
    if result["stopped"] is not None:
        print(_stopped_line(result, again))
        return 128 + result["stopped"]
    from moerl.runlog.summary import summary

    for line in summary(Path(cfg.run.dir), result["step"], result["metrics"].get("elapsed_s", 0.0),
                        result.get("counters", {}), result.get("checkpoint_step")):
        print(line)
    return 0


def _stopped_line(result: dict, again: str) -> str:
    step, steps, saved = result["step"], result["steps"], result["checkpoint_step"]
    if result.get("nothing_trained"):
        return f"stopped before step 1 of {steps}: nothing to resume; start again with: {again}"
    if saved == step:
        return f"stopped at step {step} of {steps}; resume with: {again} --resume"
    if saved is not None:
        return (f"stopped at step {step} of {steps}; its checkpoint was not saved (see the warning above): "
                f"the newest is step {saved}; resume from it with: {again} --resume")
    return f"stopped at step {step} of {steps}; no checkpoint was saved (see the warnings above)"


def _resume_hint(cfg: MoerlConfig, again: str) -> str:
    from moerl.checkpoint import CheckpointStore

    try:
        store = CheckpointStore(cfg.checkpoint_dir(), cfg.checkpoint.storage_timeout_s)
        saved = store.latest_step()
        held = saved is None and (preflight.last_logged_step(Path(cfg.run.dir)) or store.step_dirs())
    except Exception:  # noqa: BLE001 - only a hint
        return ""
    if saved is None:  # what a re-run and --resume will both say (preflight.check_no_run, check_resume)
        return "; no checkpoint was saved" + (": nothing to resume; start a new run with --run.dir=<another "
                                              "directory> (or delete that one)" if held else "")
    return f"; the newest checkpoint is step {saved}: resume with: {again} --resume"


def _error(e: BaseException, debug: bool, run_dir: Path | None = None, suffix: str = "") -> None:
    """`error: <one line>` on stderr; the traceback too with run.log_level = debug, else (for a run that had
    started) in <run.dir>/error.log."""
    text = redact(traceback.format_exc())  # an exception's text may hold what a storage client was given
    if debug:
        print(text, file=sys.stderr, end="")
    elif run_dir is not None and run_dir.is_dir():
        try:
            with open(run_dir / "error.log", "a") as f:  # after the run's warnings, if any
                f.write(text)
            suffix += f" (traceback in {run_dir / 'error.log'})"
        except OSError:
            pass
    print(f"error: {redact(one_line(e))}{suffix}", file=sys.stderr)
