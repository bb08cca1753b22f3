"""One remote probe of an 8k-token prompt in the engine's 32-token blocks (255 prefix keys), as a
lookup makes it: records read and decrypted, tombstones of the records a hit can end on (issue 30).

    .venv/bin/python benchmarks/bench_remote_probe.py [--rounds 60]

Loopback redis-server this benchmark starts; 1 KB values (this measures round trips and records,
not bytes). Prints one JSON document: probe p50 / p90 in ms.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from common import emit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from redis_servers import RedisServer, missing  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    if missing():
        raise SystemExit(missing())
    from mlxcache_kernel.engine.cache.remote import RemoteTier, Value, block_name

    bs, n = 32, 255
    toks = list(range(1000, 1000 + bs * n + 1))
    values = [os.urandom(1024) for _ in range(n)]
    with tempfile.TemporaryDirectory() as d:
        server = RedisServer(Path(d) / "redis", password="bench-pw-123").start()
        try:
            with RemoteTier(server.url(password="bench-pw-123"), secret=b"bench-team-secret-0123456789") as tier:
                tier.publish("bench", toks, bs, [Value(block_name(v), len(v), lambda v=v: v) for v in values],
                             {"tensors": [], "layers": []})
                assert tier.wait(60) == []
                xs = []
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    assert len(tier.probe("bench", toks, bs).records) == n
                    xs.append(time.perf_counter() - t0)
        finally:
            server.stop()
    xs.sort()
    emit({"case": "remote_probe", "prefix_keys": n, "rounds": args.rounds,
          "probe_p50_ms": round(xs[len(xs) // 2] * 1e3, 2), "probe_p90_ms": round(xs[int(0.9 * (len(xs) - 1))] * 1e3, 2)})


if __name__ == "__main__":
    main()
