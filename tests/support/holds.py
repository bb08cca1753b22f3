"""Holds: a generation that stops at a chosen point and waits there to be killed or interrupted.

Tests that kill -9 or interrupt a generation must not race it (on a busy
machine it could finish first, or skip the interval they wait for). A hold,
installed in the process that generates (a child script, or a kernel cell),
blocks the generation's own thread once the wanted point is reached, says so
in a file (`ready`, JSON), and sleeps until the signal comes. The parent waits
for the file (`wait_ready`), then sends it. One-shot: an interrupt removes it.

Why nothing deadlocks: a hold waits only for time to pass and for the writer
thread, never for the thread it blocks. In-flight intervals are urgent writes,
which the writer commits while a generation runs (engine/cache/ssd/writer.py's yield rule:
only non-urgent writes wait for the generation, and one in progress goes on at
full speed when an urgent one waits behind it); their records are written on
the writer thread (engine/generate/resume.py); and a hold runs where the owner thread holds
no catalogue transaction.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from catalog_view import inflight_records


def _signal_and_sleep(ready: Path, state: dict) -> None:
    tmp = ready.with_name(ready.name + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, ready)  # the parent never reads half a file
    while True:  # until SIGKILL, or SIGINT (KeyboardInterrupt) in a kernel
        time.sleep(0.05)


def hold_at_inflight(engine, cache_dir, emitted: int, ready) -> None:
    """Hold the next checkpointed generation once its in-flight record in the catalogue under
    `cache_dir`, as another process reads it (catalog_view), holds >= `emitted` tokens.

    No interval is skipped, however slow the machine: at each boundary the generation waits
    until the engine would take the capture (`inflight_busy`: the previous interval written,
    the duty-cycle rest over), and after each capture until it is committed. So with
    checkpoint_every=k the hold comes at the first multiple of k >= `emitted`."""
    cache, ready = engine.cache, Path(ready)
    durability = cache.durability
    inflight_busy, queue_inflight = durability.inflight_busy, durability.queue_inflight

    def waited(request):
        while inflight_busy(request):
            time.sleep(0.01)
        return False

    def held(cp, ns, request, on_commit):
        queue_inflight(cp, ns, request, on_commit)
        while cache.writer.pending(urgent_only=True)[0]:  # until committed, its record written
            time.sleep(0.01)
        reached = max((len(r["emitted"]) for r in inflight_records(cache_dir)), default=0)
        if reached >= emitted:
            try:
                _signal_and_sleep(ready, {"emitted": reached})
            finally:
                del durability.inflight_busy, durability.queue_inflight

    durability.inflight_busy, durability.queue_inflight = waited, held


def hold_after_text(engine, chars: int, ready) -> None:
    """Hold the next generation once its streamed text (on_text) reaches `chars` characters (wrapping
    Engine._generate: generate, generate_tokens and the magics all come through it)."""
    ready = Path(ready)
    generate = engine._generate

    def held(m, tokens, params, options):
        on_text, seen = options.get("on_text"), [0]

        def counting(piece):
            if on_text is not None:
                on_text(piece)
            seen[0] += len(piece)
            if seen[0] >= chars:
                _signal_and_sleep(ready, {"chars": seen[0]})

        try:
            return generate(m, tokens, params, {**options, "on_text": counting})
        finally:
            del engine._generate

    engine._generate = held


def install_code(hold: str, *args) -> str:
    """A kernel cell that installs `hold` (a function here) on the kernel's engine, with `args`."""
    call = ", ".join(["get_engine()"] + [repr(str(a) if isinstance(a, Path) else a) for a in args])
    return (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
            f"from holds import {hold}; from mlxcache_kernel import get_engine\n{hold}({call})")


def wait_ready(ready, alive, timeout: float = 300) -> dict:
    """Wait for a hold's signal. `alive()` returns None while the generating process runs, else
    a message saying how it ended. The timeout only catches a real hang."""
    ready, deadline = Path(ready), time.monotonic() + timeout
    while not ready.exists():
        ended = alive()
        assert ended is None, f"the generation ended before its hold: {ended}"
        assert time.monotonic() < deadline, f"no hold signal in {timeout} s: a hang"
        time.sleep(0.02)
    return json.loads(ready.read_text())
