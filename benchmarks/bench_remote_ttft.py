"""Remote-tier hits against a cold prefill and a local SSD hit (SmolLM2, loopback Redis), authenticated.

    .venv/bin/python benchmarks/bench_remote_ttft.py [--lengths 2048 8192] [--repeat 3] [--cold-max 2048]

A machine publishes a prompt's KV (its blocks and prefix records, keyed and
sealed with a team secret, signed by a listed writer) to a redis-server this benchmark starts; then,
each in a fresh process: another machine's engine (its own empty cache
directory) reruns the prompt and is served from the remote; the publishing
machine's directory, restarted without a remote, is served from its SSD; and
a cold engine prefills. Prompts longer than --cold-max use KV tiled from a
real prefill (same shapes and value distribution; a cold 8k prefill takes
minutes here), so their cold TTFT is taken from the measured prefill rate
instead (marked "estimated"). Tiled KV is not the KV of its tokens, so the
first-layer check refuses it as a remote hit (a child's "kv_mismatch": 1):
end to end, pass --cold-max at least the longest length (a real prefill, ~3
minutes at 8k here); --auth-only needs no hit and tiles.

`fetch` is the wall-clock of the values of a hit: read raw, through
get_blocks (decrypted, verified, the next chunk read meanwhile), and rebuilt.
--link 1gbit puts the server behind a link of that rate (the loopback of a
network namespace of its own, rate-limited by tc; Linux, root): as on a team's
network, where the transfer is slower than the crypto that follows it.

The cost of authentication per lookup is the CPU work the secret adds to a
lookup: deriving every keyed prefix key of the prompt and decrypting (AES-GCM,
which authenticates) and parsing every record the probe read, timed over the records the
server really holds (median of 50: wall-clock, and this thread's CPU time,
which a busy machine inflates less). The values' part: one AES-GCM decryption
per block value a hit reads (what encryption adds; thread CPU time, median of
3) and the BLAKE3 check of its name that was there before.

Targets: remote hit <= 0.1x cold at 2k; authentication <= 1 ms per lookup at
8k (--auth-only measures only that, in a minute). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import behind_link, default_model, emit, median, prompt_tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from redis_servers import RedisServer, missing  # noqa: E402

SECRET = "bench-team-secret-0123456789"
PW = "bench-pw-123"


def _engine(cache_dir: str, url: str | None):
    from mlxcache_kernel.engine import Engine

    eng = Engine(cache_dir=cache_dir, remote_url=url, remote_secret=SECRET, prefetch_budget_bytes=0)  # a lookup's hit
    eng.load_model(default_model(), name="m")
    return eng


def _publish(cache_dir: str, url: str, n: int, cold_max: int) -> dict:
    """The first machine: its state for an n-token prompt, committed and published."""
    from bench_storage import make_checkpoint, real_kv

    eng = _engine(cache_dir, url)
    tok = eng.models.get("m").tokenizer
    if n <= cold_max:  # a real run: its TTFT is the cold reference
        ids = prompt_tokens(tok, n)
        r = eng.generate_tokens(ids, max_tokens=1, model="m")
        cold, rate = r.stats["ttft_s"], r.stats["prefill_tokens_per_s"]
    else:  # tiled real KV for the first n-1 tokens (what a rerun of the prompt reuses)
        ids = list(range(1, n)) + [7]  # make_checkpoint's state holds tokens 1..n-1
        base, _ = real_kv(2048)
        eng.cache.put(make_checkpoint(n - 1, base), eng.models.get("m").namespace)
        cold, rate = None, None
    report = eng.flush()
    ns = eng.models.get("m").namespace
    eng.close()
    return {"ids": ids, "cold_s": cold, "prefill_tokens_per_s": rate, "publish_failed": report["remote_failed"],
            "namespace": ns}


def _auth_cost(server: RedisServer, ns: str, ids: list[int], rounds: int = 50) -> dict:
    """The CPU a lookup spends on authentication: every keyed prefix key of the prompt, and the
    MAC check and parse of every record (as the server holds them)."""
    from mlxcache_kernel.engine.cache.remote import TeamKeys
    from mlxcache_kernel.engine.cache.remote.keys import KeySpace
    from mlxcache_kernel.engine.cache.remote.records import CHAIN, unseal

    keys = TeamKeys(SECRET.encode())
    toks = np.asarray(ids[: (len(ids) - 1) // 32 * 32], dtype=np.int64)  # as a lookup gets the prompt
    chain = keys.prefix_keys(ns, toks, 32)
    c = server.client()
    values = [c.get(KeySpace(keys).record(k)) for k in chain]
    assert all(values), "the records are not on the server"

    def lookup_crypto():
        now = time.time()
        for k, v in zip(keys.prefix_keys(ns, toks, 32), values):
            rec, why = unseal(CHAIN, k, v, keys, now=now)
            assert why is None

    wall, cpu = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.thread_time()
        lookup_crypto()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return {"records": len(chain), "record_bytes": sum(map(len, values)) // len(values),
            "auth_ms_per_lookup": round(median(wall) * 1e3, 3), "auth_cpu_ms_per_lookup": round(median(cpu) * 1e3, 3)}


def _values_cost(server: RedisServer, ns: str, ids: list[int], rounds: int = 3) -> dict:
    """The CPU a hit spends on its block values as the server holds them: one AES-GCM decryption
    per value (what encryption adds) and the BLAKE3 check of its name (there before)."""
    from mlxcache_kernel.engine.cache.remote import TeamKeys
    from mlxcache_kernel.engine.cache.remote.keys import KeySpace, block_name
    from mlxcache_kernel.engine.cache.remote.records import CHAIN, unseal

    keys = TeamKeys(SECRET.encode())
    space, c = KeySpace(keys), server.client()
    toks = np.asarray(ids[: (len(ids) - 1) // 32 * 32], dtype=np.int64)
    names = [unseal(CHAIN, k, c.get(space.record(k)), keys, now=time.time())[0].block
             for k in keys.prefix_keys(ns, toks, 32)]
    stored = [(space.block(n).encode(), c.get(space.block(n))) for n in names]
    plain = [keys.decrypt(ad, v) for ad, v in stored]
    assert all(p is not None and block_name(p) == n for p, n in zip(plain, names))
    dec, b3 = [], []
    for _ in range(rounds):
        c0 = time.thread_time()
        for ad, v in stored:
            keys.decrypt(ad, v)
        dec.append(time.thread_time() - c0)
        c0 = time.thread_time()
        for p in plain:
            block_name(p)
        b3.append(time.thread_time() - c0)
    return {"values": len(stored), "value_bytes": sum(len(p) for p in plain),
            "decrypt_cpu_ms_per_hit": round(median(dec) * 1e3, 1), "blake3_cpu_ms_per_hit": round(median(b3) * 1e3, 1)}


def _fetch_cost(url: str, ns: str, ids: list[int], rounds: int = 5) -> dict:
    """Wall-clock of fetching a hit's block values, interleaved, median of `rounds`: raw (the same
    STRLEN and GETRANGE pipelines as a lookup, the values kept, nothing decrypted or verified), as
    RemoteTier.get_blocks reads them (decrypted, verified against their names), and the rebuild of
    the checkpoint from them (build_spans: the copies into MLX buffers, and any check left there).
    added = get_blocks - raw: what decryption and verification add to a lookup's wall-clock."""
    from mlxcache_kernel.engine.cache.remote import RemoteTier
    from bench_remote_lookup import raw_values

    from mlxcache_kernel.engine.cache.remote.rebuild import build_spans, parse_layout

    toks = ids[: (len(ids) - 1) // 32 * 32]
    with RemoteTier(url, secret=SECRET) as tier:
        found = tier.probe(ns, toks, 32)
        layout = parse_layout(found.layout, 32)
        items = [(r.block, layout.block_bytes(r.index)) for r in found.records]
        space = tier.spaces[found.key_id]
        n = len(items) * 32
        layers = layout.layers_at(n)

        def raw():
            return raw_values(tier, items, space)  # the same reads as get_blocks makes, kept as a lookup keeps them

        times = {"raw": [], "get_blocks": [], "build_spans": []}
        for _ in range(rounds):
            t0 = time.perf_counter()
            kept = raw()
            times["raw"].append(time.perf_counter() - t0)
            del kept
            t0 = time.perf_counter()
            values = tier.get_blocks(items, key_id=found.key_id)
            times["get_blocks"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            build_spans(toks[:n], layout, layers, values, [r.block for r in found.records])
            times["build_spans"].append(time.perf_counter() - t0)
            del values
    ms = {k: round(median(v) * 1e3, 1) for k, v in times.items()}
    return {"values": len(items), "value_bytes": sum(s for _, s in items), **{f"{k}_ms": v for k, v in ms.items()},
            "added_ms": round(ms["get_blocks"] - ms["raw"], 1), "load": os.getloadavg()[0]}


def _child(cache_dir: str, url: str, ids_file: str) -> None:
    """One rerun in a fresh process: prints its TTFT, source and the remote bytes moved."""
    ids = json.loads(Path(ids_file).read_text())
    eng = _engine(cache_dir, url or None)
    r = eng.generate_tokens(ids, max_tokens=1, model="m")
    s = eng.stats()
    print(json.dumps({"ttft_s": r.stats["ttft_s"], "source": r.stats["cache_source"],
                      "cached": r.stats["cached_tokens"], "remote_bytes_read": s["remote_bytes_read"],
                      "kv_mismatch": s["remote_kv_mismatch"], "deadline_missed": s["remote_deadline_missed"]}))
    eng.close()


def _run_child(*args) -> dict:
    out = subprocess.run([sys.executable, __file__, "_child", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["_child"]:
        _child(*sys.argv[2:5])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cold-max", type=int, default=2048)
    ap.add_argument("--auth-only", action="store_true", help="publish (tiled KV) and time authentication only")
    ap.add_argument("--link", help="the server behind a link of this rate (tc tbf, e.g. 1gbit, 2500mbit): "
                                   "loopback rate-limited in a network namespace of its own (Linux, root)")
    args = ap.parse_args()
    if args.link and os.environ.get("MLXCACHE_BENCH_LINK") != args.link:
        behind_link(args.link, __file__)
    if args.auth_only:
        args.cold_max = 0
    if missing():
        raise SystemExit(missing())
    from mlxcache_kernel.engine.cache.remote.writers import SigningKey

    key = SigningKey.generate()  # every machine here signs with it and lists it: signatures on, as a team runs
    os.environ.update(MLXCACHE_REMOTE_SIGNING_KEY=key.seed_text(), MLXCACHE_REMOTE_WRITERS=f"bench={key.public_text()}")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        server = RedisServer(Path(d) / "redis", password=PW).start()
        try:
            url = server.url(password=PW)
            for n in args.lengths:
                server.client().flushall()
                a = str(Path(d) / f"a{n}")
                pub = _publish(a, url, n, args.cold_max)
                if args.auth_only:
                    rows.append({"tokens": n, "auth": _auth_cost(server, pub["namespace"], pub["ids"]),
                                 "values": _values_cost(server, pub["namespace"], pub["ids"]),
                                 "fetch": _fetch_cost(url, pub["namespace"], pub["ids"])})
                    continue
                ids_file = Path(d) / f"ids{n}.json"
                ids_file.write_text(json.dumps(pub["ids"]))
                remote = [_run_child(str(Path(d) / f"b{n}-{i}"), url, str(ids_file)) for i in range(args.repeat)]
                ssd = [_run_child(a, "", str(ids_file)) for _ in range(args.repeat)]
                assert all(r["source"] == "remote" for r in remote), remote
                assert all(r["source"] == "ssd" for r in ssd), ssd
                row = {"tokens": n, "auth": _auth_cost(server, pub["namespace"], pub["ids"]),
                       "values": _values_cost(server, pub["namespace"], pub["ids"]),
                       "fetch": _fetch_cost(url, pub["namespace"], pub["ids"]),
                       "remote_hit_ttft_s": median([r["ttft_s"] for r in remote]),
                       "ssd_hit_ttft_s": median([r["ttft_s"] for r in ssd]),
                       "remote_bytes_per_hit": remote[0]["remote_bytes_read"], "cached_tokens": remote[0]["cached"],
                       "publish_failed": pub["publish_failed"]}
                if pub["cold_s"] is not None:
                    row["cold_ttft_s"] = pub["cold_s"]
                    row["remote_over_cold"] = round(row["remote_hit_ttft_s"] / pub["cold_s"], 4)
                    row["prefill_tokens_per_s"] = pub["prefill_tokens_per_s"]
                row["remote_over_ssd"] = round(row["remote_hit_ttft_s"] / row["ssd_hit_ttft_s"], 3)
                rows.append(row)
        finally:
            server.stop()
    for row in rows:  # longer prompts: cold estimated from the shorter run's measured prefill rate
        if "cold_ttft_s" not in row and rows[0].get("prefill_tokens_per_s") and "remote_hit_ttft_s" in row:
            est = row["tokens"] / rows[0]["prefill_tokens_per_s"]  # optimistic: attention grows with length
            row["cold_ttft_s_estimated"] = round(est, 2)
            row["remote_over_cold_estimated"] = round(row["remote_hit_ttft_s"] / est, 4)
    emit({"case": "remote_ttft", "model": default_model(),
          "target": "remote hit <= 0.1x cold at 2k; authentication <= 1 ms per lookup at 8k",
          "repeat": args.repeat, "link": args.link or "loopback", "results": rows})


if __name__ == "__main__":
    main()
