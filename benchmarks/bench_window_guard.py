"""The window guard (issue 49), JSON on stdout: how long a prompt past the model's window takes to be
refused (target: a 100k-token prompt in under a second), on the default model (SmolLM2-135M; its
window is its config's max_position_embeddings), and what the guard costs a prompt that fits.

  (a) Engine.generate of a ~100k-token document in a chat turn: past 16 characters a token of the window,
      refused before it is tokenized; and of a 2.5x-window document (under that bound): tokenized, then refused
  (b) the same through %%generate with the document in a {var}: refused before tokenizing (too many
      characters for the window), and a {var} of 10 million characters
  (c) Engine.generate of a 10-million-character prompt (refused before it is tokenized)
  (d) a prompt that fits, --repeats times with and without truncate="left" (nothing to cut): the
      guard's cost is within the noise of a cached run

    python benchmarks/bench_window_guard.py [--tokens 100000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from common import default_model, emit, median, prompt_tokens

from mlxcache_kernel.engine import Engine, GenerationError
from mlxcache_kernel.engine.generate.window import window_of


def refused_s(fn) -> float:
    t = time.perf_counter()
    try:
        fn()
    except (GenerationError, Exception) as e:  # (a UsageError from the magic)
        if "window" not in str(e) and "characters" not in str(e):
            raise
        return time.perf_counter() - t
    raise AssertionError("not refused")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, Engine(cache_dir=d) as eng:
        eng.load_model(default_model())
        m = eng.models.get()
        doc = m.tokenizer.decode(prompt_tokens(m.tokenizer, args.tokens))
        huge = "word " * 2_000_000
        a = refused_s(lambda: eng.generate(f"Summarize:\n{doc}", max_tokens=64))
        over = m.tokenizer.decode(prompt_tokens(m.tokenizer, int(2.5 * window_of(m.config))))
        a2 = refused_s(lambda: eng.generate(f"Summarize:\n{over}", max_tokens=64))
        c = refused_s(lambda: eng.generate(huge, max_tokens=64))

        from IPython.core.error import UsageError  # noqa: F401 (the magic's one line)
        from mlxcache_kernel.magics.prompt import interpolate
        from mlxcache_kernel.engine.generate.window import max_chars

        b = refused_s(lambda: interpolate("Summarize:\n{doc}", {"doc": doc}, limit=max_chars(m)))
        b10 = refused_s(lambda: interpolate("Summarize:\n{doc}", {"doc": huge}, limit=max_chars(m)))
        fits = m.tokenizer.decode(prompt_tokens(m.tokenizer, 1000))
        eng.generate(fits, max_tokens=8)  # cached from here on
        plain, cut = [], []
        for _ in range(args.repeats):
            for out, kw in ((plain, {}), (cut, {"truncate": "left"})):
                t = time.perf_counter()
                eng.generate(fits, max_tokens=8, **kw)
                out.append(time.perf_counter() - t)
        emit({"model": m.name, "window": window_of(m.config), "document_tokens": args.tokens,
              "document_chars": len(doc), "refuse_generate_100k_s": round(a, 3),
              "over_window_tokens": int(2.5 * window_of(m.config)), "refuse_generate_over_window_s": round(a2, 3),
              "refuse_magic_var_100k_s": round(b, 4), "refuse_magic_var_10M_chars_s": round(b10, 4),
              "refuse_generate_10M_chars_s": round(c, 2),
              "cached_1k_prompt_s": {"plain": round(median(plain), 4), "truncate_left": round(median(cut), 4)}})


if __name__ == "__main__":
    main()
