"""Format 2 (content-addressed blocks): bytes written, and verified restore speed.

    .venv/bin/python benchmarks/bench_blocks.py chat [--block-tokens 32 64 128 256]
    .venv/bin/python benchmarks/bench_blocks.py restore [--tokens 1536 8192] [--repeat 5]

chat: SmolLM2, the real engine. A 20-turn chat session (total bytes written /
the final state's KV bytes; target <= 2), rerunning an identical cell (bytes
written; target 0), and a second question over a 1.5k-token document (bytes
written / the document's KV bytes; target <= 0.5), for each block size, with
the block files each leaves and the warm restore time of the final state.

restore: real SmolLM2 KV (tiled past the prefill), stored as format 2 blocks,
as one whole file (every tensor inline), and as mlx-lm's `save_prompt_cache` file; each restore runs in a fresh process,
page cache warm or dropped (fadvise DONTNEED after fsync). Ours verifies
every byte (BLAKE3); mlx-lm's `load_prompt_cache` verifies nothing. Ours is
timed as the store's `restore_seconds` (Engine.stats()["ssd_restore_seconds"]).
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import default_model, emit, median, prompt_tokens

HERE = Path(__file__).parent
NS, IDENTITY = "bench", {"artifact": "bench-blocks"}


def _engine_case(d: str, block_tokens: int) -> dict:
    from mlxcache_kernel.engine import Engine
    from mlxcache_kernel.engine.cache.ssd import blocks

    blocks.BLOCK_TOKENS = block_tokens
    out = {"block_tokens": block_tokens}
    with Engine(cache_dir=d) as eng:
        eng.load_model(default_model(), name="m")
        tok = eng.models.get("m").tokenizer
        per_token = None
        eng.generate("Warm up.", max_tokens=2)
        eng.flush()
        w0 = eng.stats()["bytes_written"]
        for turn in range(20):
            r = eng.generate(f"Turn {turn}: tell me one more short fact about rivers.", max_tokens=12, session="chat")
            eng.flush()
        final_tokens = r.stats["prompt_tokens"] + len(r.tokens)
        per_token = eng.stats()["ram_kv_bytes"] / max(1, sum(len(e.tokens) for e in eng.cache.entries()))
        written = eng.stats()["bytes_written"] - w0
        out["chat_bytes_written"] = written
        out["chat_final_kv_bytes"] = int(final_tokens * per_token)
        out["chat_written_over_final_kv"] = round(written / (final_tokens * per_token), 3)
        # an identical rerun of a cell: its state is stored already
        eng.generate("Summarise the history of the river Thames in one line.", max_tokens=8)
        eng.flush()
        w1 = eng.stats()["bytes_written"]
        eng.cache.clear()  # from SSD, as after a restart: the same KV comes back and is written again
        eng.generate("Summarise the history of the river Thames in one line.", max_tokens=8)
        eng.flush()
        out["identical_rerun_bytes_written"] = eng.stats()["bytes_written"] - w1
        # two questions over one 1.5k-token document
        doc = tok.decode(prompt_tokens(tok, 1500))
        eng.generate(f"{doc}\n\nQuestion: which region had the largest variance?", max_tokens=8)
        eng.flush()
        w2 = eng.stats()["bytes_written"]
        eng.generate(f"{doc}\n\nQuestion: what was asked for by week 3?", max_tokens=8)
        eng.flush()
        doc_kv = 1500 * per_token
        out["second_question_bytes_written"] = eng.stats()["bytes_written"] - w2
        out["second_question_over_doc_kv"] = round(out["second_question_bytes_written"] / doc_kv, 3)
        s = eng.stats()
        out["ssd_unique_bytes"], out["ssd_blocks"] = s["ssd_bytes"], s["ssd_blocks"]
        out["ssd_bytes_deduplicated"] = s["ssd_bytes_deduplicated"]
    out["block_files"] = sum(1 for _ in Path(d, "checkpoints", "blocks").glob("*.blk"))
    return out


def chat(args) -> dict:
    rows = []
    for bt in args.block_tokens:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            rows.append(_engine_case(d, bt))
    return {"case": "chat", "model": default_model(), "targets": {"chat_written_over_final_kv": "<= 2",
            "identical_rerun_bytes_written": "0", "second_question_over_doc_kv": "<= 0.5"}, "results": rows}


# --- restore in fresh processes ---------------------------------------------


def _files_of(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file() and p.suffix in (".blk", ".ckpt", ".safetensors")]


def _drop(paths) -> None:
    from bench_storage import drop_cache

    for p in paths:
        drop_cache(p)


def _child(kind: str, d: str, cold: bool) -> None:
    """One restore in this fresh process; prints milliseconds."""
    import mlx.core as mx

    d = Path(d)
    if kind in ("blocks", "whole"):
        from mlxcache_kernel.engine.cache.ssd.restore import restore
        from mlxcache_kernel.engine.cache.ssd.store import CheckpointStore

        store = CheckpointStore(d / kind)
        store.register_namespace(NS, IDENTITY)
        [e] = store.entries()
        if cold:
            _drop(_files_of(d / kind))
        restore(store, e)
        print(store.stats()["restore_seconds"] * 1000)
    else:
        from mlx_lm.models import cache as lm_cache

        path = d / "mlxlm.safetensors"
        if cold:
            _drop([path])
        t0 = time.perf_counter()
        c = lm_cache.load_prompt_cache(str(path))
        mx.eval([x.state for x in c])
        print((time.perf_counter() - t0) * 1000)


def restore_case(args) -> dict:
    from bench_storage import make_checkpoint, real_kv
    from mlx_lm.models import cache as lm_cache

    from mlxcache_kernel.engine.cache.ssd import format as fmt
    from mlxcache_kernel.engine.cache.ssd.persist import persist
    from mlxcache_kernel.engine.cache.ssd.store import CheckpointStore
    from mlxcache_kernel.engine.cache.ssd.writer import WriteJob

    base_kv, _ = real_kv(min(args.tokens))
    rows = []
    for n in args.tokens:
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            cp = make_checkpoint(n, base_kv)
            store = CheckpointStore(Path(d) / "blocks")  # format 2: manifest + blocks
            store.register_namespace(NS, IDENTITY)
            store.publish(persist(store, WriteJob.from_checkpoint(cp, NS, IDENTITY)).info)
            store.close()
            whole = CheckpointStore(Path(d) / "whole")  # the same state in one file (every tensor inline)
            whole.register_namespace(NS, IDENTITY)
            whole.publish(fmt.write_checkpoint(
                whole.prepare_path(NS, cp.tokens), identity=IDENTITY, namespace=NS, tokens=cp.tokens,
                layout=cp.layout(), min_reusable_offset=0, host_tensors=cp.host_tensors(), trimmable=True,
                commit=whole.commit))
            whole.close()
            lm_cache.save_prompt_cache(str(Path(d) / "mlxlm.safetensors"), cp.lend())
            row = {"tokens": n, "kv_bytes": cp.kv_bytes}
            for temp in ("warm", "dropped"):
                for kind in ("blocks", "whole", "mlxlm"):
                    ms = []
                    for _ in range(args.repeat):
                        r = subprocess.run([sys.executable, __file__, "_child", kind, d, temp], capture_output=True,
                                           text=True, check=True)
                        ms.append(float(r.stdout.strip().splitlines()[-1]))
                    row[f"{kind}_{temp}_ms"] = round(median(ms), 2)
                row[f"{temp}_blocks_over_mlxlm"] = round(row[f"blocks_{temp}_ms"] / row[f"mlxlm_{temp}_ms"], 3)
                row[f"{temp}_blocks_over_whole_file"] = round(row[f"blocks_{temp}_ms"] / row[f"whole_{temp}_ms"], 3)
            rows.append(row)
    return {"case": "restore", "target": "blocks / mlx-lm <= 1.0 and blocks / whole file <= 1.0, warm and dropped",
            "repeat": args.repeat,
            "cpus": os.cpu_count(), "results": rows}


def main() -> None:
    if sys.argv[1:2] == ["_child"]:
        _child(sys.argv[2], sys.argv[3], sys.argv[4] == "dropped")
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=["chat", "restore"])
    ap.add_argument("--block-tokens", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1536, 8192])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None, help="directory on the disk to test (default: a temp dir)")
    args = ap.parse_args()
    emit(chat(args) if args.case == "chat" else restore_case(args))


if __name__ == "__main__":
    main()
