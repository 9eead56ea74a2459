"""freeze_startup_heap: start-up's garbage is collected, what lives is frozen out of later full collections."""

import gc
import weakref

from pagedserve.runtime.engine.gc_heap import freeze_startup_heap


class _Node:
    pass


def test_garbage_is_collected_and_the_rest_frozen():
    dead = _Node()
    dead.self = dead  # a cycle: only the cyclic collector frees it
    gone = weakref.ref(dead)
    del dead
    alive = _Node()
    try:
        frozen = freeze_startup_heap()
        assert gone() is None
        assert frozen == gc.get_freeze_count() > 0
        # a full collection now walks only what was allocated since: `alive` is no longer in generation 2
        assert not any(o is alive for o in gc.get_objects(generation=2))
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
