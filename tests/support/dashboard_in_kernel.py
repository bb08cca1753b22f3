"""Run in a stock ipykernel by tests/widgets/test_widgets.py (``%run -i``): a dashboard on an
Engine over the tiny model, every widget trait change recorded with its
thread, then 50 events emitted from a background thread.

Arguments come from the kernel's environment: MLXCACHE_TEST_CACHE (cache
directory) and MLXCACHE_TEST_MODEL (where to build the tiny model). Leaves
``eng``, ``db``, ``threads`` (names of the threads that set traits) and
``r0`` (refreshes so far) in the namespace for the test's later cells.
"""

import os
import sys
import threading
import time

import traitlets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_model import build_tiny_model  # noqa: E402

from mlxcache_kernel.engine import Engine  # noqa: E402
from mlxcache_kernel.widgets import ResidencyDashboard  # noqa: E402

eng = Engine(cache_dir=os.environ["MLXCACHE_TEST_CACHE"])
eng.load_model(str(build_tiny_model(os.environ["MLXCACHE_TEST_MODEL"])))
db = ResidencyDashboard(eng, throttle_s=0.05)
threads = []


def rec(change):
    threads.append(threading.current_thread().name)


stack = [db]
while stack:
    w = stack.pop()
    w.observe(rec, names=traitlets.All)
    stack.extend(getattr(w, "children", ()) or ())


def bg():
    for i in range(50):
        eng.events.emit("evict", ns="x", tokens=i, nbytes=1, reason="budget")
        time.sleep(0.002)


t = threading.Thread(target=bg, name="bg")
t.start()
t.join()
r0 = db.refreshes
