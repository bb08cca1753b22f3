"""Passages placed from their cached KV (issue 51), JSON on stdout. On the default model (SmolLM2-135M
float32): --questions questions, each over --per-question passages drawn from a pool of --pool (about
--passage-tokens tokens each) in shuffled order, the question about one of them. The passages are the
documentation of Python's standard library modules, each headed by its module (--corpus stdlib), or
records of made-up towns written from a few sentence templates (--corpus towns: passages so much alike
that each leans on the others, the hard case for passages encoded apart).

Time to first token, once the pool is cached (each passage encoded before the timed runs), of
  - a full prefill of the prompt (use_cache=False),
  - prefix caching (the plain prompt with the cache on: what earlier questions left reuses the system
    prompt, and more only where a question starts with the same passages),
  - the passages placed at the default recompute fraction;                      target <= 0.3x full.
Accuracy against the full prefill (chunk 512), per recompute fraction (--fractions): the greedy answer
(--answer-tokens tokens) equal to the full prefill's (also: its first token equal, and the share of the answer
before the first difference), and the KL divergence of the next-token distribution at the answer's first
position; the same for a full prefill with another chunk size (--floor-chunk): the
floor any two exact computations show. Target: greedy answers equal in >= 90% of questions at the default.

The accuracy runs decode by hand (argmax over the model's logits) from the state each way computes, so
the full distribution is there; the timed runs are `Engine.generate(max_tokens=1)`.

    python benchmarks/bench_passages.py                    # the issue's run: 50 questions, 8 of 40 passages of ~250
    python benchmarks/bench_passages.py --small            # 8 questions, 4 of 12 passages of ~120 (a shared 2-core box)
"""

from __future__ import annotations

import argparse
import math
import os
import random
import tempfile
import time

from common import default_model, emit, median

import mlx.core as mx  # noqa: E402  (after common: the fast BLAS first)

from mlxcache_kernel.engine import Engine  # noqa: E402
from mlxcache_kernel.engine.generate.passages.run import place_passages  # noqa: E402
from mlxcache_kernel.engine.generate.prefill import prefill  # noqa: E402

SYSTEM = "Answer the question from the records above, in one sentence."
SYLLABLES = ["bar", "cel", "dor", "fen", "gal", "hol", "ist", "kar", "lum", "mor", "nes", "ost", "pra", "quil",
             "ros", "sil", "tor", "ulm", "ves", "wyn"]
RIVERS = ["Amber", "Slate", "Willow", "Copper", "Heron", "Mist", "Ash", "Linden", "Otter", "Flint"]
TRADES = ["weaver", "miller", "glassblower", "shipwright", "tanner", "brewer", "clockmaker", "potter", "mason",
          "salt merchant"]
GOODS = ["wool", "glass", "barley", "timber", "copper pots", "salted fish", "paper", "linen", "cider", "bricks"]
SENTENCES = [
    "{t} lies on the {r} River, {d} miles from the coast, where the valley opens into farmland.",
    "It was founded in {y} by {f}, a {trade} who came upriver with {n} families.",
    "Today about {p} people live in {t}, most of them in the old quarter around the market hall.",
    "The town is best known for its {g}, which barges carry downstream every spring.",
    "Its festival, held each {m}, remembers the flood of {y2}, when the water reached the church steps.",
    "The mayor, {mayor}, was elected in {y3} after promising a new bridge over the {r}.",
    "Records from {y4} mention a fire that destroyed {k} houses on the eastern bank.",
    "The school of {t} teaches {n2} children, and its library holds a map drawn by {f} himself.",
    "Travellers reach {t} by the road from {other}, a journey of {h} hours by cart.",
    "In winter the {r} freezes for about {w} weeks, and the town trades {g} for coal.",
]
DOC_QUESTIONS = ["What is the {t} module for?", "According to the documentation above, what does the {t} module "
                 "provide?", "Summarize what the passages say about the {t} module."]
MONTHS = ["March", "April", "May", "June", "July", "August", "September", "October"]
QUESTIONS = ["When was {t} founded, and by whom?", "What is {t} best known for?", "How many people live in {t}?",
             "Who is the mayor of {t}?", "On which river does {t} lie?"]


def towns(n: int, rng: random.Random) -> list[str]:
    names = set()
    while len(names) < n:
        names.add((rng.choice(SYLLABLES) + rng.choice(SYLLABLES) + rng.choice(["ford", "by", "ton", "wick", "mere"]))
                  .capitalize())
    return sorted(names)


def passage(town: str, others: list, tokenizer, n_tokens: int, rng: random.Random) -> str:
    """A record of one town, about n_tokens long: its facts in varied sentences."""
    f = f"{rng.choice(['Anna', 'Tomas', 'Irena', 'Mikel', 'Sofie', 'Jonas'])} {rng.choice(SYLLABLES).capitalize()}"
    facts = dict(t=town, r=rng.choice(RIVERS), d=rng.randint(3, 90), y=rng.randint(1100, 1800), f=f,
                 trade=rng.choice(TRADES), n=rng.randint(4, 40), p=rng.randint(800, 60000), g=rng.choice(GOODS),
                 m=rng.choice(MONTHS), y2=rng.randint(1801, 1950), mayor=f"{rng.choice(['Eva', 'Lars', 'Mira'])} "
                 f"{rng.choice(SYLLABLES).capitalize()}", y3=rng.randint(1990, 2024), y4=rng.randint(1600, 1900),
                 k=rng.randint(5, 80), n2=rng.randint(40, 900), other=rng.choice(others), h=rng.randint(2, 14),
                 w=rng.randint(1, 9))
    text, order = f"Record of {town}.", list(range(len(SENTENCES)))
    while len(tokenizer.encode(text)) < n_tokens:
        rng.shuffle(order)
        for i in order:
            text += " " + SENTENCES[i].format(**facts)
            if len(tokenizer.encode(text)) >= n_tokens:
                break
    return text


def stdlib_passages(tokenizer, n: int, n_tokens: int) -> tuple[list, list]:
    """(n passages of about n_tokens, the module each is from): the documentation of Python's standard
    library modules (their docstrings, in paragraphs), each passage headed by its module's name."""
    import importlib
    import inspect
    import sys
    import warnings

    out, names = [], []
    warnings.simplefilter("ignore")
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in ("antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"):
            continue
        try:
            doc = inspect.getdoc(importlib.import_module(name)) or ""
        except Exception:  # noqa: BLE001 - a module this platform lacks
            continue
        text = f"From the documentation of the {name} module:"
        for sentence in " ".join(doc.split()).replace(". ", ".\n").splitlines():
            text += " " + sentence
            if len(tokenizer.encode(text)) >= n_tokens:
                out.append(text)
                names.append(name)
                text = f"From the documentation of the {name} module (continued):"
                if len(out) == n:
                    return out, names
    raise SystemExit(f"the standard library's documentation gives only {len(out)} passages of {n_tokens} tokens")


def greedy(model, caches, last: int, n: int, eos: set) -> tuple:
    """(log-probabilities at the first answer position, the greedy answer) from caches holding all but `last`."""
    y, out, first = last, [], None
    for _ in range(n):
        logits = model(mx.array([[y]]), cache=caches)[0, -1].astype(mx.float32)
        lp = logits - mx.logsumexp(logits)
        if first is None:
            first = lp
        y = int(mx.argmax(lp).item())
        out.append(y)
        if y in eos:
            break
    return first, out


def same_start(a: list, b: list) -> float:
    """The share of the reference answer `b` that `a` repeats before they first differ."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n / len(b)


def kl(p_log: mx.array, q_log: mx.array) -> float:
    return float((mx.exp(p_log) * (p_log - q_log)).sum().item())


def full(m, tokens: list, chunk: int, n: int) -> tuple:
    caches = m.new_caches()
    prefill(m.model, caches, tokens[:-1], chunk=chunk)
    return greedy(m.model, caches, tokens[-1], n, m.eos_token_ids)


def placed(eng, m, question: str, passages: list, fraction: float, n: int) -> tuple:
    tokens, state = place_passages(eng._services, eng.objects, m, question, passages, fraction=fraction, system=SYSTEM)
    try:
        prefill(m.model, state.caches, tokens[state.length : -1], chunk=eng.prefill_chunk)
        return tokens, greedy(m.model, state.caches, tokens[-1], n, m.eos_token_ids)
    finally:
        state.release()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--questions", type=int, default=50)
    ap.add_argument("--per-question", type=int, default=8)
    ap.add_argument("--pool", type=int, default=40)
    ap.add_argument("--passage-tokens", type=int, default=250)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--fractions", default="0,0.05,0.15,0.3,0.5,1")
    ap.add_argument("--floor-chunk", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", choices=("stdlib", "towns"), default="stdlib",
                    help="passages from the standard library's documentation, or made-up town records (templated: "
                         "passages much alike, which makes each lean on the others)")
    ap.add_argument("--small", action="store_true", help="8 questions, 4 of 12 passages of ~120 tokens")
    args = ap.parse_args()
    if args.small:
        args.questions, args.per_question, args.pool, args.passage_tokens = 8, 4, 12, 120
    fractions = [float(f) for f in args.fractions.split(",")]
    rng = random.Random(args.seed)
    load0, t_start = os.getloadavg(), time.time()
    with tempfile.TemporaryDirectory() as tmp, Engine(cache_dir=tmp, prefetch_budget_bytes=0) as eng:
        eng.load_model(default_model(), name="default")
        m = eng.models.get()
        default = eng.config.passage_recompute
        if args.corpus == "towns":
            names = towns(args.pool, rng)
            pool = [passage(t, [o for o in names if o != t], m.tokenizer, args.passage_tokens, rng) for t in names]
        else:
            pool, names = stdlib_passages(m.tokenizer, args.pool, args.passage_tokens)
        t0 = time.perf_counter()
        for p in pool:  # the pool cached: each passage encoded once, stored as an object
            eng.generate("Which town?", passages=[p], system=SYSTEM, max_tokens=1)
        encode_s = time.perf_counter() - t0
        rows = []
        for q in range(args.questions):
            chosen = rng.sample(range(args.pool), args.per_question)
            about = rng.choice(chosen)
            question = rng.choice(QUESTIONS if args.corpus == "towns" else DOC_QUESTIONS).format(t=names[about])
            passages = [pool[i] for i in chosen]
            text = "\n\n".join(passages) + "\n\n" + question
            row = {"ttft": {}, "agree": {}, "kl": {}, "first": {}, "prefix": {}}
            r = eng.generate(text, system=SYSTEM, max_tokens=1, use_cache=False)
            row["ttft"]["full"], row["prompt_tokens"] = r.stats["ttft_s"], r.stats["prompt_tokens"]
            r = eng.generate(question, passages=passages, system=SYSTEM, max_tokens=1)
            row["ttft"]["passages"] = r.stats["ttft_s"]
            row["passage_sources"] = sorted(set(r.stats["passage_sources"]))
            row["exact_passage_tokens"] = r.stats["passage_tokens_exact"]
            assert r.prompt_tokens == eng.encode_prompt(text, system=SYSTEM)
            ref_lp, ref = full(m, r.prompt_tokens, 512, args.answer_tokens)
            floor_lp, floor = full(m, r.prompt_tokens, args.floor_chunk, args.answer_tokens)
            row["agree"]["floor"], row["kl"]["floor"] = floor == ref, kl(ref_lp, floor_lp)
            row["first"]["floor"], row["prefix"]["floor"] = floor[0] == ref[0], same_start(floor, ref)
            for f in fractions:
                _, (lp, ans) = placed(eng, m, question, passages, f, args.answer_tokens)
                row["agree"][str(f)], row["kl"][str(f)] = ans == ref, kl(ref_lp, lp)
                row["first"][str(f)], row["prefix"][str(f)] = ans[0] == ref[0], same_start(ans, ref)
            # last: it publishes this prompt exactly, which a later question sharing its first passages reuses
            r = eng.generate(text, system=SYSTEM, max_tokens=1)
            row["ttft"]["prefix"], row["prefix_cached"] = r.stats["ttft_s"], r.stats["cached_tokens"]
            rows.append(row)
        load1 = os.getloadavg()

    def ttft(kind: str) -> float:
        return median([r["ttft"][kind] for r in rows])

    keys = ["floor"] + [str(f) for f in fractions]
    emit({
        "model": "SmolLM2-135M-Instruct float32", "corpus": args.corpus, "questions": args.questions, "per_question": args.per_question,
        "pool": args.pool, "passage_tokens": args.passage_tokens, "answer_tokens": args.answer_tokens,
        "prompt_tokens_median": median([r["prompt_tokens"] for r in rows]), "default_recompute": default,
        "pool_encode_s": round(encode_s, 2),
        "ttft_s_median": {k: round(ttft(k), 3) for k in ("full", "prefix", "passages")},
        "ttft_ratio_passages_to_full": round(ttft("passages") / ttft("full"), 3),
        "ttft_ratio_passages_to_prefix": round(ttft("passages") / ttft("prefix"), 3),
        "ttft_ratio_prefix_to_full": round(ttft("prefix") / ttft("full"), 3),
        "target_ttft_at_most_0.3x_full": ttft("passages") / ttft("full") <= 0.3,
        "prefix_cached_tokens_median": median([r["prefix_cached"] for r in rows]),
        "passage_sources": sorted({s for r in rows for s in r["passage_sources"]}),
        "exact_passage_tokens_median": median([r["exact_passage_tokens"] for r in rows]),
        "greedy_agreement": {k: round(sum(r["agree"][k] for r in rows) / len(rows), 3) for k in keys},
        "first_token_agreement": {k: round(sum(r["first"][k] for r in rows) / len(rows), 3) for k in keys},
        "answer_share_before_divergence": {k: round(sum(r["prefix"][k] for r in rows) / len(rows), 3) for k in keys},
        "kl_median": {k: float(f"{median([r['kl'][k] for r in rows]):.3g}") for k in keys},
        "kl_max": {k: float(f"{max(r['kl'][k] for r in rows):.3g}") for k in keys},
        "target_agreement_at_default_0.9": (sum(r["agree"][str(default)] for r in rows) / len(rows) >= 0.9
                                            if str(default) in keys else None),
        "load_before": [round(x, 2) for x in load0], "load_after": [round(x, 2) for x in load1],
        "wall_s": round(time.time() - t_start, 1), "cpus": os.cpu_count(),
        "nan": any(math.isnan(r["kl"][k]) for r in rows for k in keys),
    })


if __name__ == "__main__":
    main()
