"""The race moerl/ray_gc.py guards against, on its own (not collected by pytest: it depends on timing).

    .venv/bin/python tests/repro_ray_gc_race.py          # exit 1, Ray's "core worker has already been shutdown"
    .venv/bin/python tests/repro_ray_gc_race.py frozen   # "survived": ray.shutdown() inside gc_frozen()

Cyclic garbage holding 60,000 ObjectRefs is collected on a second thread while the main thread shuts Ray down;
Ray's C++ core worker then ends the process with _exit(1). On this 2-core machine (Ray 2.60, 2026-12-04): 4 of 4
runs without the freeze exited 1; 4 of 4 with it survived. Run it again after a Ray upgrade.
"""
import contextlib
import gc
import sys
import threading

import ray

from moerl.ray_gc import gc_frozen


class _Holder:
    pass


def main(frozen: bool) -> None:
    ray.init(num_cpus=1, include_dashboard=False)
    gc.disable()  # the garbage waits for the collector thread below
    for _ in range(3000):
        h = _Holder()
        h.self, h.refs = h, [ray.put(i) for i in range(20)]
    del h
    with gc_frozen() if frozen else contextlib.nullcontext():
        collector = threading.Thread(target=gc.collect, daemon=True)
        collector.start()
        ray.shutdown()
    collector.join()
    print("survived", flush=True)


if __name__ == "__main__":
    main(frozen=sys.argv[1:] == ["frozen"])
