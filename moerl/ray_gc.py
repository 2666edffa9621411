"""Shutting Ray down in a process whose other threads run Python: no garbage collection may free a Ray object
meanwhile.

    with gc_frozen():        # before the threads that allocate (the final plots) get busy
        ...                  # start them
        ray.shutdown()

A collection runs on whichever thread allocated last. When it frees an ObjectRef or an actor handle of the run
(cyclic garbage: exceptions with tracebacks, closures) while `ray.shutdown()` tears the core worker down, Ray's C++
side finds its core worker gone and ends the whole process with `_exit(1)`: no traceback, no message outside Ray's
driver log ("The core worker has already been shutdown ... The process will exit"). The CI lost a run to it: the
final plots' thread collected while the driver shut Ray down. tests/repro_ray_gc_race.py reproduces it on its own.

`gc.freeze()` moves every object alive at that moment out of the collector's reach, so a collection on any thread
meanwhile sees only objects made since (none of them the run's Ray objects). `gc.unfreeze()` after: they are
collected later, with Ray down, which is safe (a collection after the shutdown has finished was tried with
ObjectRefs, borrowed refs, actor handles and plasma-backed arrays: no exit). tests/unit/test_ray_gc.py checks the
mechanism; tests/integration/test_rl_faults.py (`ray_env`) that every in-process run shuts Ray down inside it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_frozen() -> Iterator[None]:
    if gc.get_freeze_count():  # the process froze objects of its own (a pre-fork server): its choice stands
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
