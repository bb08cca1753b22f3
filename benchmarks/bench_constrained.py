"""Constrained answers (issue 45), JSON on stdout. On the default model (SmolLM2-135M float32, a 49,152-token
vocabulary), with a 10-field Pydantic schema:

1. Compile: llguidance's tables for the tokenizer (once per tokenizer), the schema and a large one (40
   nested objects, 200 fields) cold and cached (once per tokenizer and grammar).
2. Decode tok/s under the schema against free text, one row and --rows rows (the same prompts), runs
   alternating --repeats times, medians compared; the grammar's own time per token (masks and accepting
   tokens). Target: overhead <= 5%.
3. Speculative decoding under the schema against without: the speed-up of a layer-skip draft (as
   bench_speculative.py builds it) and of drafts from the context over plain decoding, each with and
   without the schema. Target: the same ratio within noise.
4. Extraction over --extract-rows rows of a DataFrame sharing a --prefix-tokens instruction: wall time of
   one constrained batch, of the same batch unconstrained, and of a loop of single constrained
   generations (the cache cleared before each, so each prefills the instruction once).

    python benchmarks/bench_constrained.py [--rows 8] [--max-tokens 128] [--repeats 2] [--extract-rows 32] [--skip speculative]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common import default_model, emit, median, prompt_tokens

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import layer_skip_draft  # noqa: E402

from pydantic import BaseModel  # noqa: E402

from mlxcache_kernel.engine import Engine  # noqa: E402
from mlxcache_kernel.engine.generate import grammars  # noqa: E402

CITIES = ["Lisbon", "Oslo", "Quito", "Nairobi", "Osaka", "Perth", "Lyon", "Tartu"]
JOBS = ["nurse", "welder", "teacher", "pilot", "chemist", "baker", "judge", "farmer"]


class Person(BaseModel):
    name: str
    age: int
    email: str
    city: str
    country: str
    occupation: str
    employer: str
    married: bool
    children: int
    salary: float


# a large schema: 40 nested objects of five typed fields each (enums, bounds, patterns, an array)
LARGE = {"type": "object", "required": [f"section_{i}" for i in range(40)], "properties": {
    f"section_{i}": {"type": "object", "required": ["id", "kind", "score", "code", "tags"], "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 10 ** (i % 6 + 1)},
        "kind": {"enum": [f"kind-{i}-{j}" for j in range(8)]}, "score": {"type": "number", "minimum": -1, "maximum": 1},
        "code": {"type": "string", "pattern": f"^[A-Z]{{{i % 4 + 1}}}-[0-9]{{3,{i % 5 + 3}}}$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}}}
    for i in range(40)}}


def bio(i: int) -> str:
    return (f"{['Ana', 'Bo', 'Chen', 'Dara', 'Emil', 'Fay', 'Gus', 'Hana'][i % 8]} Varga-{i} is {25 + i} years old, lives in "
            f"{CITIES[i % 8]} and works as a {JOBS[i % 8]} for Northwind {i}. Married: {'yes' if i % 2 else 'no'}; "
            f"{i % 4} children; salary {41000 + 1500 * i} a year; write to varga{i}@example.org.")


def ask(text: str) -> str:
    return f"Extract the person's details as JSON with the fields of the schema.\n\n{text}"


def bench_compile(eng) -> dict:
    m = eng.models.get("target")
    grammars._tokenizers.clear()
    grammars._compiled.clear()
    t = time.perf_counter()
    grammars._tokenizer(m)
    tables_s = time.perf_counter() - t
    out = {"tokenizer_tables_s": round(tables_s, 4)}
    for label, schema in (("schema", Person), ("large_schema", LARGE)):
        spec = grammars.spec_of(response_format=schema)
        cold = grammars.compile_for(m, spec)
        cached = [grammars.compile_for(m, spec).compile_s for _ in range(20)]
        out |= {f"{label}_cold_s": round(cold.compile_s, 5), f"{label}_cached_s": round(median(cached), 7)}
    return {**out, "vocab": cold.vocab}


def _batch_tps(rows) -> float:
    """Tokens of all rows over the batch's decode (the first row's first token to the last row's last)."""
    start = min(r.stats["ttft_s"] for r in rows)
    end = max(r.stats["total_s"] for r in rows)
    return (sum(len(r.tokens) for r in rows) - len(rows)) / (end - start)


def bench_decode(eng, rows: int, max_tokens: int, repeats: int) -> dict:
    one, many = ask(bio(0)), [ask(bio(i)) for i in range(rows)]
    kw = dict(model="target", max_tokens=max_tokens, use_cache=False, lookup=False)
    runs = {"free_1": [], "schema_1": [], f"free_{rows}": [], f"schema_{rows}": []}
    mask, share = [], {1: [], rows: []}  # the grammar's time per token; its share of the decode's wall time
    for _ in range(repeats):  # alternating, under the same load
        free = eng.generate(one, **kw)
        schema = eng.generate(one, response_format=Person, **kw)
        runs["free_1"].append(free.stats["decode_tokens_per_s"])
        runs["schema_1"].append(schema.stats["decode_tokens_per_s"])
        mask.append(schema.stats["constraint_s"] / max(1, len(schema.tokens)))
        share[1].append(schema.stats["constraint_s"] / (schema.stats["total_s"] - schema.stats["ttft_s"]))
        runs[f"free_{rows}"].append(_batch_tps(eng.generate_batch(many, **kw)))
        constrained = eng.generate_batch(many, response_format=Person, **kw)
        runs[f"schema_{rows}"].append(_batch_tps(constrained))
        span = max(r.stats["total_s"] for r in constrained) - min(r.stats["ttft_s"] for r in constrained)
        share[rows].append(sum(r.stats["constraint_s"] for r in constrained) / span)
    out = {k: round(median(v), 2) for k, v in runs.items()}
    for n in (1, rows):
        out[f"overhead_{n}"] = round(1 - out[f"schema_{n}"] / out[f"free_{n}"], 4)
    out["grammar_us_per_token"] = round(1e6 * median(mask), 1)  # masks computed and tokens accepted
    for n, v in share.items():  # (an upper bound of the overhead where the masks do not overlap the forward)
        out[f"grammar_share_of_decode_{n}"] = round(median(v), 4)
    out["schema_tokens_1"] = len(schema.tokens)
    out["schema_parsed_1"] = schema.parsed is not None
    out["schema_parsed_rows"] = sum(r.parsed is not None for r in constrained)
    return out


def bench_speculative(eng, max_tokens: int, repeats: int, k: int) -> dict:
    prompt = ask(bio(3))
    kw = dict(model="target", max_tokens=max_tokens, use_cache=False)
    ways = {"plain": dict(lookup=False), "draft": dict(lookup=False, draft="draft", num_draft_tokens=k),
            "lookup": dict(lookup=True)}
    out = {}
    for label, constraint in (("free", {}), ("schema", dict(response_format=Person))):
        tps = {w: [] for w in ways}
        for _ in range(repeats):
            runs = {w: eng.generate(prompt, **kw, **extra, **constraint) for w, extra in ways.items()}
            assert len({tuple(r.tokens) for r in runs.values()}) == 1, "drafts changed the tokens"
            for w, r in runs.items():
                tps[w].append(r.stats["decode_tokens_per_s"])
        out[label] = {"tokens": len(runs["plain"].tokens),
                      "draft_acceptance": runs["draft"].stats["draft_acceptance"],
                      "lookup_acceptance": runs["lookup"].stats.get("lookup_drafts_acceptance"),
                      **{f"{w}_tps": round(median(v), 2) for w, v in tps.items()},
                      "draft_speedup": round(median(tps["draft"]) / median(tps["plain"]), 3),
                      "lookup_speedup": round(median(tps["lookup"]) / median(tps["plain"]), 3)}
    return out


def bench_extraction(eng, rows: int, prefix_tokens: int, max_tokens: int) -> dict:
    """Wall time of the rows as one constrained batch, one free batch, and a loop of constrained singles."""
    import pandas as pd

    tok = eng.models.get("target").tokenizer
    instruction = tok.decode(prompt_tokens(tok, prefix_tokens)) + "\n\nFrom the record below, extract the person."
    df = pd.DataFrame({"text": [bio(i) for i in range(rows)]})
    prompts = [f"{instruction}\n\nRecord: {t}" for t in df["text"]]
    kw = dict(model="target", max_tokens=max_tokens, lookup=False)
    out = {}
    for label, run in (("batch_schema", lambda: eng.generate_batch(prompts, response_format=Person, **kw)),
                       ("batch_free", lambda: eng.generate_batch(prompts, **kw)),
                       ("loop_schema", lambda: [eng.generate(p, response_format=Person, **kw) for p in prompts])):
        eng.flush(timeout=120)
        eng.cache_clear(ssd=True)  # each starts cold: the instruction prefilled once (batch) or by the first row
        t = time.perf_counter()
        results = run()
        out[f"{label}_s"] = round(time.perf_counter() - t, 2)
        out[f"{label}_tokens"] = sum(len(r.tokens) for r in results)
        if "schema" in label:
            out[f"{label}_parsed"] = sum(r.parsed is not None for r in results)
    out["batch_schema_over_free"] = round(out["batch_schema_s"] / out["batch_free_s"], 3)
    out["loop_over_batch_schema"] = round(out["loop_schema_s"] / out["batch_schema_s"], 3)
    out["prompt_tokens"] = len(tok.encode(prompts[0]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--extract-rows", type=int, default=32)
    ap.add_argument("--extract-max-tokens", type=int, default=110)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: decode,speculative,extraction")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    target = Path(default_model())
    import llguidance

    out = {"benchmark": "constrained", "model": str(target), "llguidance": llguidance.__version__,
           "loadavg_before": open("/proc/loadavg").read().split()[:3]}
    with tempfile.TemporaryDirectory() as d:
        draft = layer_skip_draft(target, Path(d) / "draft", args.draft_layers)
        with Engine(cache_dir=Path(d) / "cache", prefetch_budget_bytes=0) as eng:
            eng.load_model(target, name="target")
            eng.load_model(draft, name="draft")
            out["compile"] = bench_compile(eng)
            print(f"[bench] compile {out['compile']}", file=sys.stderr, flush=True)
            if "decode" not in skip:
                out["decode"] = bench_decode(eng, args.rows, args.max_tokens, args.repeats)
                print(f"[bench] decode {out['decode']}", file=sys.stderr, flush=True)
            if "speculative" not in skip:
                out["speculative"] = bench_speculative(eng, args.max_tokens, args.repeats, args.draft_tokens)
                print(f"[bench] speculative {out['speculative']}", file=sys.stderr, flush=True)
            if "extraction" not in skip:
                out["extraction"] = bench_extraction(eng, args.extract_rows, args.prefix_tokens,
                                                     args.extract_max_tokens)
                print(f"[bench] extraction {out['extraction']}", file=sys.stderr, flush=True)
    out["loadavg_after"] = open("/proc/loadavg").read().split()[:3]
    out["targets"] = {"decode.overhead_1, decode.overhead_N": "<= 0.05",
                      "speculative.schema.*_speedup": "== speculative.free.*_speedup within noise"}
    emit(out)


if __name__ == "__main__":
    main()
