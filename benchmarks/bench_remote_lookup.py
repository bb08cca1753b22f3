"""One remote lookup (probe, then the hit's block values) on its own, as the engine makes it (issue 30).

    .venv/bin/python benchmarks/bench_remote_lookup.py [--blocks 255] [--value-bytes 1476868] [--rounds 7]
        [--probe-rounds 40] [--link 1gbit]

A writer publishes a prompt of --blocks 32-token blocks (random values of an
8k SmolLM2 float32 block's size, its 30-layer layout) to a redis-server this
benchmark starts; a reader's tier then looks it up --rounds times: `probe`
(every prefix record read, decrypted, parsed; tombstones, layout, the writer's
signature) and `get_blocks` (every value read, decrypted and hashed against its
name). Each is timed beside `raw`, the same round trips with the replies kept
and nothing opened, so `*_added_ms` is what opening and checking cost a
lookup's wall-clock (medians of interleaved rounds; the probe's also in this
thread's CPU time, `*_cpu_ms`, steadier between processes, which on two cores
land beside redis-server or not); `after_last_byte_ms` is the
part of get_blocks after its last read returned. The first-layer check needs
the model: bench_remote_trust.py.

The same file runs against an older checkout (PYTHONPATH=<a git archive of it>,
engine/ and widgets/ symlinked under its mlxcache_kernel/): it uses only
RemoteTier(url, secret), publish, wait, probe and get_blocks, and passes a
signing key and an allow-list only where the tier takes them (--ahead needs this
checkout: it times the first-layer sample's call serially and beside a fetch on
the tier's fetch thread, as engine/cache/remote/link.py makes it). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import behind_link, emit, median

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from redis_servers import RedisServer, missing  # noqa: E402

SECRET = b"bench-team-secret-0123456789"
BS = 32
LAYERS = 30  # SmolLM2-135M: 30 layers, 3 KV heads of 64, float32 -> 1,476,868 bytes a 32-token block


def _layout() -> dict:
    return {"layers": [{"kind": "KVCache", "arrays": 2, "meta": {"offset": 0}} for _ in range(LAYERS)],
            "tensors": [[f"layers.{i}.{j}", "float32", [1, 3, BS, 64]] for i in range(LAYERS) for j in range(2)]}


def _tier(url: str, **trust):
    from mlxcache_kernel.engine.cache.remote import RemoteTier

    takes = inspect.signature(RemoteTier).parameters
    return RemoteTier(url, secret=SECRET, **{k: v for k, v in trust.items() if k in takes})


def _trust() -> dict:
    try:
        from mlxcache_kernel.engine.cache.remote.writers import SigningKey
    except ImportError:  # a checkout from before signatures
        return {}
    key = SigningKey.generate()
    return {"signing_key": key.seed_text(), "writers": f"bench={key.public_text()}"}


def _raw_probe(tier, chain: list, space, pair: bool) -> None:
    """The probe's round trips (what this checkout's probe sends: `pair`, a STRLEN beside each GETRANGE),
    replies kept, nothing opened."""
    from mlxcache_kernel.engine.cache.remote import tier as tier_module

    size = tier_module.MAX_RECORD_BYTES
    for first in range(0, len(chain), tier.probe_batch):
        chunk = chain[first:first + tier.probe_batch]

        def fill(p, chunk=chunk):
            for k in chunk:
                if pair:
                    p.strlen(space.record(k))
                p.getrange(space.record(k), 0, size - 1)
        tier.reader.pipeline("probe", fill, None)
    if hasattr(space, "tomb"):  # the round trip for tombstones at the keys a hit can end on
        tier.reader.pipeline("tombstones", lambda p: [p.getrange(space.tomb(k), 0, size - 1) for k in chain[-4:]], None)


def raw_values(tier, items: list, space) -> list:
    """get_blocks' reads of `items` (its read plan, where this checkout has one), the values kept as a
    lookup keeps them, nothing decrypted or verified."""
    sized, why = tier._sized(items, space, None)
    assert why is None and len(sized) == len(items)
    if hasattr(tier, "read_plan"):
        kept = []
        for chunk, pieces in tier.read_plan(sized):
            kept += [tier._read_piece(space, chunk[0], lo, hi, None) for lo, hi in pieces] if pieces else \
                tier._read_values(chunk, space, None)
        return kept
    return [v for i in range(0, len(sized), 8) for v in tier._read_values(sized[i:i + 8], space, None)]


def _overlap(tier, items: list, toks: list, rounds: int, ends: list) -> dict:
    """The first-layer sample's call (kv/first_layer.ahead, the default model) and the fetch, as a
    lookup makes them: serially (the call, then get_blocks on this thread) and overlapped (get_blocks
    on the tier's fetch thread, started first: engine/cache/remote/link.py). `*_first_read_ms`: from the
    lookup's decision to fetch until the fetch's first read begins; `*_fetch_ms`: until the values are there."""
    import mlx.core as mx
    from common import default_model

    from mlxcache_kernel.engine import Engine
    from mlxcache_kernel.engine.kv import first_layer

    eng = Engine(ssd=False)
    eng.load_model(default_model(), name="m")
    m, prompt = eng.models.get("m"), np.asarray(toks, dtype=np.int64)
    starts, real = [], tier._sized
    tier._sized = lambda *a: starts.append(time.perf_counter()) or real(*a)
    out = {k: [] for k in ("serial_first_read", "serial_fetch", "overlapped_first_read", "overlapped_fetch",
                           "ahead_call")}
    for _ in range(rounds):
        t0 = time.perf_counter()
        early = first_layer.ahead(m, prompt)
        out["ahead_call"].append(time.perf_counter() - t0)
        tier.get_blocks(items)
        out["serial_first_read"].append(starts[-1] - t0)
        out["serial_fetch"].append(ends[-1] - t0)
        mx.eval(*early.got)
        t0 = time.perf_counter()
        fetch = tier.start_blocks(items)
        early = first_layer.ahead(m, prompt)
        fetch.result()
        out["overlapped_first_read"].append(starts[-1] - t0)
        out["overlapped_fetch"].append(ends[-1] - t0)
        mx.eval(*early.got)
    tier._sized = real
    eng.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=255)
    ap.add_argument("--value-bytes", type=int, default=1_476_868)
    ap.add_argument("--rounds", type=int, default=7, help="fetches of the values (each timed raw and opened)")
    ap.add_argument("--probe-rounds", type=int, default=40)
    ap.add_argument("--ahead", action="store_true", help="also time the first-layer sample's call beside the fetch "
                                                         "(serial and overlapped; loads the default model)")
    ap.add_argument("--link", help="the server behind a link of this rate (tc tbf, e.g. 1gbit; Linux, root)")
    args = ap.parse_args()
    if args.link and os.environ.get("MLXCACHE_BENCH_LINK") != args.link:
        behind_link(args.link, __file__)
    if missing():
        raise SystemExit(missing())
    from mlxcache_kernel.engine.cache.remote import Value, block_name

    rng = np.random.default_rng(0)
    values = [rng.bytes(args.value_bytes) for _ in range(args.blocks)]
    blocks = [Value(block_name(v), len(v), (lambda v=v: v)) for v in values]
    toks = rng.integers(0, 49_152, args.blocks * BS + 7)  # int64, as a lookup has the prompt (tiered.take)
    ns = "bench-lookup"
    trust = _trust()
    with tempfile.TemporaryDirectory() as d:
        server = RedisServer(Path(d) / "redis", password="bench-pw-123").start()
        try:
            url = server.url(password="bench-pw-123")
            with _tier(url, **trust) as writer:
                assert writer.publish(ns, toks.tolist(), BS, blocks, _layout())
                assert writer.wait(300) == []
            with _tier(url, **trust) as tier:
                keys = tier.keys[0]
                space = tier.spaces[keys.key_id]
                chain = keys.prefix_keys(ns, toks, BS)
                found = tier.probe(ns, toks, BS)
                assert len(found.records) == args.blocks, len(found.records)
                items = [(b.name, b.size) for b in blocks]
                ends, reads = [], [m for m in ("_read_values", "_read_piece") if hasattr(tier, m)]
                for m in reads:  # when the last read of a fetch returned
                    def timed(*a, real=getattr(tier, m)):
                        r = real(*a)
                        ends.append(time.perf_counter())
                        return r
                    setattr(tier, m, timed)
                pair = "strlen" in inspect.getsource(type(tier)._probe)  # older probes read STRLEN beside each record
                t = {k: [] for k in ("raw_probe", "probe", "raw_probe_cpu", "probe_cpu", "raw_values", "get_blocks",
                                     "after_last_byte")}
                for _ in range(args.probe_rounds):  # apart from the fetches, whose 377 MB churn the memory
                    t0, c0 = time.perf_counter(), time.thread_time()
                    _raw_probe(tier, chain, space, pair)
                    t["raw_probe"].append(time.perf_counter() - t0)
                    t["raw_probe_cpu"].append(time.thread_time() - c0)
                    t0, c0 = time.perf_counter(), time.thread_time()
                    f = tier.probe(ns, toks, BS)
                    t["probe"].append(time.perf_counter() - t0)
                    t["probe_cpu"].append(time.thread_time() - c0)
                    assert len(f.records) == args.blocks
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    kept = raw_values(tier, items, space)
                    t["raw_values"].append(time.perf_counter() - t0)
                    del kept
                    t0 = time.perf_counter()
                    got = tier.get_blocks(items, key_id=f.key_id)
                    t1 = time.perf_counter()
                    t["get_blocks"].append(t1 - t0)
                    t["after_last_byte"].append(t1 - ends[-1])
                    assert got == values
                    del got
                if args.ahead:
                    t.update(_overlap(tier, items, toks[:args.blocks * BS], args.rounds, ends))
                ms = {k: round(median(v) * 1e3, 2) for k, v in t.items()}
        finally:
            server.stop()
    emit({"case": "remote_lookup", "link": args.link or "loopback", "blocks": args.blocks,
          "value_bytes": args.value_bytes, "rounds": args.rounds, "probe_rounds": args.probe_rounds,
          "signed": bool(trust),
          "results": {**{f"{k}_ms": v for k, v in ms.items()},
                      "probe_added_ms": round(ms["probe"] - ms["raw_probe"], 2),
                      "probe_added_cpu_ms": round(ms["probe_cpu"] - ms["raw_probe_cpu"], 2),
                      "values_added_ms": round(ms["get_blocks"] - ms["raw_values"], 2),
                      "lookup_ms": round(ms["probe"] + ms["get_blocks"], 2), "load": os.getloadavg()[0]}})


if __name__ == "__main__":
    main()
