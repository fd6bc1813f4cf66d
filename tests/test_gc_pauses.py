"""serve_app/online/gc_pauses.py: counting this process's collections and their time."""

import gc
import os

from serve_app.online import gc_pauses


def test_the_watch_counts_each_generations_collections_and_their_time():
    w = gc_pauses.watch()
    assert gc_pauses.watch() is w and gc.callbacks.count(w._callback) == 1
    before = w.snapshot()
    gc.collect(0)
    gc.collect(2)
    after = w.snapshot()
    assert after["collections"][0] >= before["collections"][0] + 1
    assert after["collections"][2] >= before["collections"][2] + 1
    assert after["seconds"][2] > before["seconds"][2] and after["max_ms"][2] > 0
    assert after["frozen"] == gc.get_freeze_count() and after["pid"] == os.getpid()
