"""Run a rollout Engine on its own thread; other threads submit, abort and update weights through commands.

A rollout worker is a threaded Ray actor: its methods run on Ray's threads, and a SIGTERM handler must run
on the process's main thread. The engine itself is single-threaded, so everything that touches it goes
through a command queue that the engine thread drains between two steps: aborts and weight updates land
between decode steps by construction.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Sequence

from moerl.rollout.engine import Engine
from moerl.rollout.sampling import SamplingParams
from moerl.rollout.types import Completion


class EngineThread:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._futures: dict[str, Future[Completion]] = {}
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._progress_at = time.monotonic()  # the loop's last pass: a step done, or an idle wait over
        self._thread = threading.Thread(target=self._loop, name="moerl-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: Sequence[int], params: SamplingParams, request_id: str,
               prefix: Completion | None = None) -> Future[Completion]:
        """Queue a request; the future resolves with its Completion (partial if aborted) or the submit error."""
        fut: Future[Completion] = Future()
        if (dead := self.dead()) is not None:  # nothing would ever run it
            fut.set_exception(dead)
            return fut

        def command() -> None:
            try:
                self.engine.submit(prompt, params, request_id=request_id, prefix=prefix)
                self._futures[request_id] = fut
            except ValueError as e:
                fut.set_exception(e)

        self._commands.put(command)
        return fut

    def abort_all(self) -> None:
        """Abort every request between two steps; their futures resolve with partial completions."""
        def command() -> None:
            for rid in list(self._futures):
                self._resolve(rid, self.engine.abort(rid))
        self._commands.put(command)

    def call(self, fn: Callable[[Engine], object]) -> object:
        """Run fn(engine) on the engine thread between steps and return its result (e.g. a weight update)."""
        if (dead := self.dead()) is not None:
            raise dead
        fut: Future = Future()

        def command() -> None:
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
        self._commands.put(command)
        while True:  # bounded by the engine thread's life: a command queued behind its crash never runs
            try:
                return fut.result(timeout=1.0)
            except TimeoutError:
                if (dead := self.dead()) is not None:
                    raise dead from None

    @property
    def in_flight(self) -> int:
        return len(self._futures)

    def dead(self) -> RuntimeError | None:
        """Why the engine thread is gone (it crashed, or was stopped), or None while it runs."""
        if self.error is not None:
            return RuntimeError(f"engine thread died: {type(self.error).__name__}: {self.error}")
        if not self._thread.is_alive():
            return RuntimeError("engine thread is not running")
        return None

    def stalled_s(self) -> float:
        """Seconds since the engine thread last made progress while it had work (0 when idle or progressing)."""
        if not self.engine.has_unfinished():
            return 0.0
        return max(0.0, time.monotonic() - self._progress_at)

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout=10)

    def _resolve(self, rid: str, completion: Completion) -> None:
        fut = self._futures.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_result(completion)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.engine.has_unfinished()
                try:
                    while True:  # drain commands; wait for one only when idle
                        self._commands.get(block=block, timeout=0.5 if block else None)()
                        block = False
                except queue.Empty:
                    pass
                if self.engine.has_unfinished():
                    for out in self.engine.step():
                        if out.completion is not None:
                            self._resolve(out.request_id, out.completion)
                self._progress_at = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - surface engine crashes to every waiter
            self.error = e
            for fut in self._futures.values():
                if not fut.done():
                    fut.set_exception(e)
            self._futures.clear()
