"""What trust adds to a remote lookup (issue 30): the writer's signature over the run, and the
first-layer check that binds the fetched KV to its tokens (SmolLM2, CPU).

    .venv/bin/python benchmarks/bench_remote_trust.py [--lengths 2048 8192] [--rounds 5]

signature: the names digest of every block of the run and one Ed25519 verification (what
tier._vouched does per lookup). first_layer: kv/first_layer.py on the model's own first-layer
keys and values of n tokens (embedding, norm, projections, rotary; no attention), with its
sample of 1 and of 2 positions per block (first_layer.SAMPLE; first_layer_ms is the chosen one), and
first_layer_after_fetch_ms, what is left of it once the sample was computed ahead (a lookup computes it
while the blocks are read: first_layer.ahead); added_ms_per_lookup counts that part. Target: the
added cost per lookup at 8k <= 5 ms (issue 30). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from common import default_model, emit, median, prompt_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import mlx.core as mx

    from mlxcache_kernel.engine import Engine
    from mlxcache_kernel.engine.cache.remote import TeamKeys
    from mlxcache_kernel.engine.cache.remote.records import (CHAIN, RemoteRecord, chain_signature, names_digest,
                                                             seal_chain, unseal)
    from mlxcache_kernel.engine.cache.remote.writers import SigningKey, Writers
    from mlxcache_kernel.engine.kv import first_layer
    from mlxcache_kernel.engine.kv.layers import LayerState

    eng = Engine(ssd=False)
    eng.load_model(default_model(), name="m")
    m = eng.models.get("m")
    key, team = SigningKey.generate(), TeamKeys(b"bench-team-secret-0123456789")
    writers = Writers.parse(f"w={key.public_text()}")
    rows, chosen = [], first_layer.SAMPLE
    for n in args.lengths:
        ids = prompt_tokens(m.tokenizer, n)
        cap = first_layer.Capture(0)
        try:
            m.model(mx.array(ids)[None], cache=[cap, *m.new_caches()[1:]])
        except first_layer.Stop:
            pass
        k, v = cap.got
        mx.eval(k, v)
        layer0 = LayerState.whole(m.new_caches()[0].__class__.__name__, (k, v), {"offset": n})
        by_sample = {}
        for sample in sorted({1, 2, first_layer.SAMPLE}):  # positions checked per 32-token block
            first_layer.SAMPLE, fl = sample, []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                assert first_layer.first_layer_matches(m.model, m.new_caches(), ids, layer0) is True
                fl.append(time.perf_counter() - t0)
            by_sample[sample] = round(median(fl) * 1e3, 2)
        first_layer.SAMPLE = chosen
        fl = [by_sample[chosen] / 1e3]
        after, call = [], []  # a lookup computes the sample while the blocks are read: what is left once they are there
        prompt, cp_tokens = np.asarray(ids, dtype=np.int64), tuple(ids)  # as a lookup has them (tiered.take, Checkpoint)
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            early = first_layer.ahead(m, prompt)  # (its graph built and started: before the fetch)
            call.append(time.perf_counter() - t0)
            mx.eval(*early.got)  # (the fetch: ~0.4 s at 8k, far longer than the sample's forward)
            t0 = time.perf_counter()
            assert first_layer.first_layer_matches(m.model, m.new_caches(), cp_tokens, layer0, early) is True
            after.append(time.perf_counter() - t0)
        blocks = n // 32
        names = [f"{i:064x}" for i in range(blocks)]
        d = b""
        for name in names:
            d = names_digest(d, name)
        pk = bytes(32)
        value = seal_chain(pk, RemoteRecord(blocks - 1, n - 32, n, names[-1], "ns", b"{}"), "{}", team, time.time(),
                           key, d)
        rec, _ = unseal(CHAIN, pk, value, team, now=time.time())
        sig = []
        for _ in range(args.rounds * 10):
            t0 = time.perf_counter()
            dd = b""
            for name in names:
                dd = names_digest(dd, name)
            assert chain_signature(pk, rec, dd, writers) is None
            sig.append(time.perf_counter() - t0)
        rows.append({"tokens": n, "first_layer_ms": round(median(fl) * 1e3, 2), "first_layer_ms_by_sample": by_sample,
                     "first_layer_after_fetch_ms": round(median(after) * 1e3, 2),
                     "first_layer_ahead_call_ms": round(median(call) * 1e3, 2),
                     "signature_ms": round(median(sig) * 1e3, 3),
                     "added_ms_per_lookup": round((median(after) + median(sig)) * 1e3, 2)})
    eng.close()
    emit({"case": "remote_trust", "model": default_model(), "target": "added cost per lookup at 8k <= 5 ms",
          "rounds": args.rounds, "results": rows})


if __name__ == "__main__":
    main()
