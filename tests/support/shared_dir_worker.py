"""A kernel stand-in for multi-process tests: one Engine on a shared cache
directory, driven by JSON commands on stdin, one JSON answer per line.

    python shared_dir_worker.py CACHE_DIR MODEL_DIR [SSD_BUDGET_BYTES]

Commands: {"op": "generate", "prompt": [...], "max_tokens": n}, "save"
(name), "restore" (name), "clear" (ssd: bool), "gc", "flush", "stats",
"exit". With "random": true the worker instead runs random operations until
killed, appending one JSON line per finished operation to the log file given
as "log" (flushed and fsynced, so what it logged was acknowledged).
"""

from __future__ import annotations

import json
import os
import random
import sys

from mlxcache_kernel.engine import Engine


def run(eng: Engine, cmd: dict) -> dict:
    op = cmd["op"]
    if op == "generate":
        r = eng.generate_tokens(cmd["prompt"], max_tokens=cmd.get("max_tokens", 8))
        return {"tokens": r.tokens, "source": r.stats["cache_source"], "cached": r.stats["cached_tokens"]}
    if op == "save":
        return eng.checkpoint_save(cmd["name"])
    if op == "restore":
        return eng.checkpoint_restore(cmd["name"])
    if op == "clear":
        return eng.cache_clear(ssd=cmd.get("ssd", False))
    if op == "gc":
        return eng.cache_gc()
    if op == "flush":
        return eng.flush()
    if op == "stats":
        return eng.stats()
    raise ValueError(f"unknown op {op!r}")


def random_ops(eng: Engine, spec: dict) -> None:
    rng = random.Random(spec["seed"])
    prompts = spec["prompts"]
    with open(spec["log"], "a") as log:
        while True:
            roll = rng.random()
            i = rng.randrange(len(prompts))
            if roll < 0.6:
                cmd = {"op": "generate", "prompt": prompts[i], "max_tokens": spec["max_tokens"], "i": i}
            elif roll < 0.7:
                eng.generate_tokens(prompts[i], max_tokens=spec["max_tokens"])
                cmd = {"op": "save", "name": f"w{spec['seed']}-{rng.randrange(10**6)}", "i": i}
            elif roll < 0.8:
                cmd = {"op": "clear", "ssd": rng.random() < 0.3}
            elif roll < 0.9:
                cmd = {"op": "flush"}
            else:
                cmd = {"op": "gc"}
            out = run(eng, cmd)
            log.write(json.dumps({**cmd, "prompt": None, "out": out}, default=str) + "\n")
            log.flush()
            os.fsync(log.fileno())


def main() -> None:
    cache_dir, model = sys.argv[1], sys.argv[2]
    budget = int(sys.argv[3]) if len(sys.argv) > 3 else None
    eng = Engine(cache_dir=cache_dir, ssd_budget_bytes=budget)
    eng.load_model(model, name="m")
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        if cmd.get("random"):
            random_ops(eng, cmd)
        try:
            out = {"ok": run(eng, cmd)}
        except Exception as e:  # the test reads the error
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out, default=str), flush=True)
    eng.close()


if __name__ == "__main__":
    main()
