"""Chat as people run modern models (issue 47), JSON on stdout. On the default model (SmolLM2-135M float32),
loaded with a tool-calling template (the tests' Hermes template, tests/support/chat_models.py):

  (a) an agent loop of --steps forced tool calls (tool_choice="required") over a system prompt of about
      --system-tokens tokens and three tools: per step, the prompt, the tokens the cache prefilled and the
      TTFT; against a cold prefill of each step's prompt, and against mlx-lm's server cache
      (`LRUPromptCache`) on the same conversation, tokenized as its server tokenizes a request (the
      client sends back the calls and results; the template renders them; the replies are the same ids);
      and the same loop again after a restart (RAM empty, the SSD tier warm);
  (b) a --turns-turn thinking conversation through the tests' Qwen3 template (it drops the reasoning of
      earlier turns), each reply forced to think first: per turn, the tokens prefilled against the tokens
      the template changed (target: equal), and the footer's note.

    python benchmarks/bench_chat.py [--system-tokens 2000] [--steps 10] [--turns 6]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

from common import default_model, emit, prompt_tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from chat_models import HERMES, QWEN3  # noqa: E402

from mlxcache_kernel.engine import Engine  # noqa: E402

THINKING = 'start: "<think>\\n" /[a-z][a-z ,.]{150,300}[a-z.]/ "\\n</think>\\n\\n" /[A-Z][a-z ,]{30,80}/ "."\n'


def order_status(order: Literal["A-17", "B-22", "C-31"]) -> dict:
    """Where an order is.

    Args:
        order: The order number
    """
    return {"order": order, "status": "shipped", "days": 2}


def stock(item: Literal["lamp", "desk", "chair"]) -> dict:
    """How many of an item are in stock.

    Args:
        item: The item
    """
    return {"item": item, "in_stock": 12}


def shipping(country: Literal["NO", "FR", "DE"]) -> str:
    """The shipping time to a country.

    Args:
        country: The country code
    """
    return f"3 days to {country}"


TOOLS = [order_status, stock, shipping]


def common_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def mlx_lm_server_cache(path: str, system: str, messages: list, replies: list) -> list:
    """Per step: the tokens mlx-lm's server would prefill, its LRUPromptCache serving the conversation
    (each request tokenized as the server does; the replies forced to the engine's ids), and that prefill's
    seconds."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
    from transformers.utils import get_json_schema

    model, tok = mlx_lm.load(path)
    tok.chat_template = HERMES
    schemas = [get_json_schema(f) for f in TOOLS]
    lru, out = LRUPromptCache(max_size=10), []
    turn = [{"role": "system", "content": system}, messages[0]]
    for i, reply in enumerate(replies):
        prompt = list(tok.apply_chat_template(turn, tools=schemas, add_generation_prompt=True, tokenize=True))
        cache, rest = lru.fetch_nearest_cache("m", prompt)
        cache = cache if cache is not None else make_prompt_cache(model)
        t0 = time.perf_counter()
        for at in range(0, len(rest), 512):
            model(mx.array(rest[at:at + 512])[None], cache=cache)
            mx.eval([c.state for c in cache])
        out.append({"prompt_tokens": len(prompt), "prefilled_tokens": len(rest),
                    "prefill_s": round(time.perf_counter() - t0, 4)})
        model(mx.array(reply)[None], cache=cache)  # the reply, as the server generated it
        mx.eval([c.state for c in cache])
        lru.insert_cache("m", prompt + list(reply), cache)
        turn = turn + messages[1 + 2 * i: 3 + 2 * i]  # the call and its result, as the client sends them back
    return out


def agent_loop(path: str, cache_dir: Path, system_tokens: int, steps: int) -> dict:
    with Engine(cache_dir=cache_dir, prefetch_budget_bytes=0) as eng:
        eng.load_model(path, name="m", chat_template=HERMES)
        tok = eng.models.get("m").tokenizer
        system = tok.decode(prompt_tokens(tok, system_tokens))
        r = eng.generate("Where is order A-17, is a lamp in stock, and how long is shipping to Norway?",
                         session="loop", system=system, tools=TOOLS, tool_choice="required", max_steps=steps,
                         max_tokens=160)
        walk = [(s.prompt_tokens, s.tokens, s.stats, s.grammar) for s in r.steps]
        walk.append((r.prompt_tokens, r.tokens, r.stats, None))
        rows = []
        for i, (prompt, tokens, stats, grammar) in enumerate(walk):
            cold = eng.generate_tokens(prompt, use_cache=False, max_tokens=1, lookup=False,
                                       **({"grammar": grammar} if grammar else {}))
            added = len(prompt) - (len(walk[i - 1][0]) + len(walk[i - 1][1])) if i else len(prompt)
            rows.append({"step": i + 1, "call": r.steps[i].call if i < len(r.steps) else None,
                         "prompt_tokens": len(prompt), "added_tokens": added,
                         "prefilled_tokens": stats["prefilled_tokens"], "ttft_s": round(stats["ttft_s"], 4),
                         "cold_ttft_s": round(cold.stats["ttft_s"], 4), "note": stats.get("prefill_note")})
        messages = eng.sessions.get("loop").messages
    with Engine(cache_dir=cache_dir, prefetch_budget_bytes=0) as eng:  # a restart: RAM empty, SSD warm
        eng.load_model(path, name="m", chat_template=HERMES)
        again = eng.generate("Where is order A-17, is a lamp in stock, and how long is shipping to Norway?",
                             session="loop", system=system, tools=TOOLS, tool_choice="required", max_steps=steps,
                             max_tokens=160)
        restarted = [s.stats["prefilled_tokens"] for s in again.steps] + [again.stats["prefilled_tokens"]]
    server = mlx_lm_server_cache(path, system, messages, [w[1] for w in walk])
    for row, s in zip(rows, server):
        row["mlx_lm_prompt_tokens"], row["mlx_lm_prefilled_tokens"] = s["prompt_tokens"], s["prefilled_tokens"]
        row["mlx_lm_prefill_s"] = s["prefill_s"]
    later = rows[1:]
    return {"steps": rows, "tool_steps": len(r.steps), "prefilled_per_step_after_a_restart": restarted,
            "prefilled_after_step_1": sum(x["prefilled_tokens"] for x in later),
            "added_after_step_1": sum(x["added_tokens"] for x in later),
            "mlx_lm_prefilled_after_step_1": sum(x["mlx_lm_prefilled_tokens"] for x in later),
            "ttft_s_after_step_1": round(sum(x["ttft_s"] for x in later), 3),
            "cold_ttft_s_after_step_1": round(sum(x["cold_ttft_s"] for x in later), 3)}


def thinking_conversation(path: str, cache_dir: Path, turns: int) -> dict:
    with Engine(cache_dir=cache_dir, prefetch_budget_bytes=0) as eng:
        eng.load_model(path, name="q", chat_template=QWEN3)
        rows, before = [], None
        for t in range(turns):
            r = eng.generate(f"Question {t + 1}: what should the committee review next, and why?", session="think",
                             think=True, grammar=THINKING, max_tokens=200)  # (mlx-lm turns it off: no <think> token)
            changed = len(r.prompt_tokens) - (common_prefix(before, r.prompt_tokens) if before else 0)
            rows.append({"turn": t + 1, "prompt_tokens": len(r.prompt_tokens), "changed_tokens": changed,
                         "prefilled_tokens": r.stats["prefilled_tokens"], "reasoning_chars": len(r.reasoning),
                         "note": r.stats.get("prefill_note")})
            before = r.prompt_tokens + r.tokens
    return {"turns": rows, "prefilled_equals_changed": all(
        x["changed_tokens"] <= x["prefilled_tokens"] <= x["changed_tokens"] + 1 for x in rows)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--turns", type=int, default=6)
    args = ap.parse_args()
    path = default_model()
    with tempfile.TemporaryDirectory() as tmp:
        loop = agent_loop(path, Path(tmp) / "a", args.system_tokens, args.steps)
        thinking = thinking_conversation(path, Path(tmp) / "b", args.turns)
    emit({"benchmark": "chat", "model": Path(path).name, "system_tokens": args.system_tokens,
          "agent_loop": loop, "thinking": thinking})


if __name__ == "__main__":
    main()
