"""moerl/ray_gc.py: while Ray shuts down, the collector (on any thread) cannot free an object made before.

The race itself lives inside Ray's teardown and cannot be forced deterministically; what is checked here is the
mechanism (nothing made before `gc_frozen()` is collected inside it, all of it after), and in
tests/integration/test_rl_faults.py (`ray_env`) that every in-process `train()` shuts Ray down inside it."""
import gc
import threading
import weakref

from moerl.ray_gc import gc_frozen


class _Cycle:
    def __init__(self) -> None:
        self.self = self


def test_garbage_made_before_is_out_of_the_collectors_reach_inside_and_collected_after():
    old = _Cycle()
    alive = weakref.ref(old)
    del old
    with gc_frozen():
        new = _Cycle()
        made_inside = weakref.ref(new)
        del new
        collector = threading.Thread(target=gc.collect)  # another thread, as the final plots' would
        collector.start()
        collector.join(timeout=30)
        assert alive() is not None, "a collection inside gc_frozen() freed an object made before it"
        assert made_inside() is None  # objects made since are collected as usual
    gc.collect()
    assert alive() is None and gc.get_freeze_count() == 0


def test_a_process_that_froze_objects_itself_keeps_them_frozen():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_frozen():
            pass
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
