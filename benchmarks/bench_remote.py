"""The remote tier over loopback (issue 13), JSON on stdout.

- GET/SET throughput by value size (64 KiB .. 16 MiB): redis-py pipelines of
  8 values, as the tier sends them (MB/s and ops/s, median of repeats), and
  the tier's own get_blocks (pipelined GETs plus BLAKE3 verification).
- Probe latency: a pipelined probe of an 8192-token prompt in 256-token
  blocks (32 prefix keys, 2 round trips of 16) that finds every record, and
  one that misses at the first key (1 round trip); one server and a 3-node
  cluster (whose pipelines redis-py splits by node).
- Planted values: the same probe when a 512 MB value sits at the first
  record key, and a block read when one sits at a block key: bounded reads
  make them cost what a miss costs (single server only).

Starts its own redis-server processes (tests/support/redis_servers.py) on loopback.

    python benchmarks/bench_remote.py [--total-mib 256] [--repeats 3] [--no-cluster]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import emit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from redis_servers import RedisClusterNodes, RedisServer, missing  # noqa: E402

from mlxcache_kernel.engine.cache.remote import RemoteMiss, RemoteTier, Value, block_name  # noqa: E402
from mlxcache_kernel.engine.cache.remote.tier import GET_BATCH  # noqa: E402

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
PW = "bench-password"


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def throughput(server: RedisServer, tier: RemoteTier, size: int, total: int, repeats: int) -> dict:
    n = max(GET_BATCH, total // size)
    value = os.urandom(size)  # one value under n keys: the server stores n copies, the client sends n
    keys = [f"bench:{size}:{i}" for i in range(n)]
    c = server.client()

    def pipelined(op):
        for i in range(0, n, GET_BATCH):
            p = c.pipeline(transaction=False)
            for k in keys[i:i + GET_BATCH]:
                p.set(k, value) if op == "set" else p.get(k)
            p.execute()

    out = {"value_bytes": size, "values": n}
    for op in ("set", "get"):
        s = statistics.median(timed(lambda: pipelined(op)) for _ in range(repeats))
        out[f"{op}_mb_s"], out[f"{op}_ops_s"] = round(n * size / s / 1e6, 1), round(n / s, 1)
    # The tier reads blocks by content name: store a handful under their names and read them through it.
    blocks = [os.urandom(size) for _ in range(min(n, GET_BATCH * 4))]
    names = [block_name(b) for b in blocks]
    space = tier.spaces[tier.keys[0].key_id]
    p = c.pipeline(transaction=False)
    for name, b in zip(names, blocks):
        p.set(space.block(name), b)
    p.execute()
    s = statistics.median(timed(lambda: tier.get_blocks([(n, size) for n in names])) for _ in range(repeats))
    out["tier_get_blocks_mb_s"] = round(len(blocks) * size / s / 1e6, 1)
    c.flushall()
    return out


def _q(xs, p):
    return round(sorted(xs)[int(p * (len(xs) - 1))] * 1e3, 3)


def probe_latency(tier: RemoteTier, rounds: int, server: RedisServer | None = None) -> dict:
    bs, n_blocks = 256, 32
    toks = list(range(1000, 1000 + bs * n_blocks))
    values = [os.urandom(1024) for _ in range(n_blocks)]  # small: this measures round trips, not bytes
    tier.publish("bench", toks, bs, [Value(block_name(v), len(v), (lambda v=v: v)) for v in values], {"bench": 1})
    failures = tier.wait(60)
    assert not failures, failures
    hit, miss = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        found = tier.probe("bench", toks, bs)
        hit.append(time.perf_counter() - t0)
        assert len(found.records) == n_blocks
        t0 = time.perf_counter()
        assert tier.probe("bench", [7] + toks[1:], bs).records == []
        miss.append(time.perf_counter() - t0)
    out = {"prompt_tokens": len(toks), "block_tokens": bs, "prefix_keys": n_blocks,
           "round_trips_hit": -(-n_blocks // tier.probe_batch), "hit_p50_ms": _q(hit, 0.5), "hit_p90_ms": _q(hit, 0.9),
           "miss_p50_ms": _q(miss, 0.5), "miss_p90_ms": _q(miss, 0.9)}
    if server is not None:
        out.update(planted(tier, server, toks, bs, values, rounds))
    return out


def planted(tier: RemoteTier, server: RedisServer, toks, bs, values, rounds: int) -> dict:
    """A 512 MB value at the first record key (the probe) and at a block key (the read), against
    the same lookups missing: time and bytes the server sent per lookup (INFO's
    total_net_output_bytes around each, so a few hundred bytes are the INFO reply itself)."""
    space, c = tier.spaces[tier.keys[0].key_id], server.client()
    key = space.record(tier.keys[0].prefix_keys("bench", toks, bs)[0])
    items = [(block_name(v), len(v)) for v in values]

    def measure(fn, before=lambda: None, n=rounds):
        times, sent = [], 0
        for _ in range(n):
            before()  # untimed, and its bytes not counted
            b0 = server.bytes_sent()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            sent += server.bytes_sent() - b0
        return _q(times, 0.5), sent // n

    def read():
        try:
            tier.get_blocks(items)
        except RemoteMiss:
            pass

    original = c.get(key)
    c.unlink(key)
    miss_probe = measure(lambda: tier.probe("bench", toks, bs))
    c.setrange(key, (512 << 20) - 1, "x")
    planted_probe = measure(lambda: tier.probe("bench", toks, bs))
    c.set(key, original)
    block = space.block(items[0][0])
    c.unlink(block)
    miss_read = measure(read)
    # planted again before each read (a read removes what fails its check)
    planted_read = measure(read, lambda: (tier.wait(10), c.setrange(block, (512 << 20) - 1, "x")), min(rounds, 20))
    tier.wait(10)
    c.set(block, values[0])
    return {"planted_512mb": {"probe_miss_p50_ms": miss_probe[0], "probe_miss_bytes": miss_probe[1],
                              "probe_planted_p50_ms": planted_probe[0], "probe_planted_bytes": planted_probe[1],
                              "read_miss_p50_ms": miss_read[0], "read_miss_bytes": miss_read[1],
                              "read_planted_p50_ms": planted_read[0], "read_planted_bytes": planted_read[1]}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--total-mib", type=int, default=256, help="bytes moved per size and operation")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--probe-rounds", type=int, default=300)
    ap.add_argument("--no-cluster", action="store_true")
    args = ap.parse_args()
    why = missing()
    if why:
        sys.exit(f"bench_remote: {why}")
    result = {"benchmark": "remote", "get_batch": GET_BATCH}
    with tempfile.TemporaryDirectory() as d:
        server = RedisServer(Path(d) / "single", password=PW).start()
        try:
            with RemoteTier(server.url(password=PW), secret=b"benchmark team secret!") as tier:
                result["throughput"] = [throughput(server, tier, s, args.total_mib << 20, args.repeats) for s in SIZES]
                result["probe_single"] = probe_latency(tier, args.probe_rounds, server)
                result["tier_stats"] = {k: tier.stats()[k] for k in ("get_bandwidth_bytes_per_s", "latency_s")}
        finally:
            server.stop()
        if not args.no_cluster:
            cluster = RedisClusterNodes(Path(d) / "cluster", password=PW).start()
            try:
                with RemoteTier(cluster.url(password=PW), secret=b"benchmark team secret!") as tier:
                    result["probe_cluster"] = probe_latency(tier, args.probe_rounds)
            finally:
                cluster.stop()
    emit(result)


if __name__ == "__main__":
    main()
