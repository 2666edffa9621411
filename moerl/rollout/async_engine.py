"""An asyncio front end for the engine: many coroutines submit, stream, abort and update weights at once.

One driver task runs `engine.step()` on the event loop itself, so everything else (abort, update_weights,
new submissions) happens between two steps by construction: no locks, no thread races. A step is short
(milliseconds), so the loop stays responsive for a Ray actor's other calls.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Iterable, Mapping, Sequence

import torch

from moerl.rollout.engine import Engine
from moerl.rollout.sampling import SamplingParams
from moerl.rollout.types import Completion, StepOutput


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._queues: dict[str, asyncio.Queue[StepOutput]] = {}
        self._wakeup = asyncio.Event()
        self._driver: asyncio.Task | None = None

    async def stream(self, prompt: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
                     prefix: Completion | None = None) -> AsyncIterator[StepOutput]:
        """Yield each step's new tokens; the last item carries the finished Completion.

        Raises ValueError at once for a request the engine refuses (others are unaffected)."""
        rid = self.engine.submit(prompt, params, request_id=request_id, prefix=prefix)
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._queues[rid] = queue
        self._ensure_driver()
        while True:
            out = await queue.get()
            yield out
            if out.completion is not None:
                return

    async def generate(self, prompt: Sequence[int], params: SamplingParams, **kwargs) -> Completion:
        async for out in self.stream(prompt, params, **kwargs):
            if out.completion is not None:
                return out.completion
        raise RuntimeError("stream ended without a completion")  # unreachable: the driver always finishes

    def abort(self, request_id: str) -> Completion:
        """Stop a request between steps; its stream ends with the partial completion."""
        completion = self.engine.abort(request_id)
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(StepOutput(request_id, [], [], completion))
        return completion

    def abort_all(self) -> list[Completion]:
        return [self.abort(rid) for rid in list(self._queues)]

    def update_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       version: int) -> None:
        self.engine.update_weights(named_tensors, version)

    def _ensure_driver(self) -> None:
        self._wakeup.set()
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())

    async def _drive(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            for out in self.engine.step():
                queue = self._queues.get(out.request_id)
                if queue is None:
                    continue
                queue.put_nowait(out)
                if out.completion is not None:
                    self._queues.pop(out.request_id, None)
            await asyncio.sleep(0)  # let submitters, aborts and weight updates run between steps
