"""Help for the magics: one example per option and action (appended to each
magic's ``?`` help as its epilog), and the one-screen cheat sheet that
``%mlxcache`` and ``%cache help`` print.
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

__all__ = ["CHEAT_SHEET", "EXAMPLES", "HelpMagics", "examples"]

# magic -> (example, what it does); every option and action of the magic appears in one example
EXAMPLES: dict[str, list[tuple[str, str]]] = {
    "generate": [
        ("%%generate", "the cell body is the prompt; {name} is replaced by the variable's value"),
        ("%%generate --max-tokens 64", "at most 64 new tokens (-n 64)"),
        ("%%generate --temperature 0.8 --seed 7", "sample (-t); the same seed gives the same text (-s)"),
        ("%%generate --temperature 0.8 --top-p 0.9", "sample from the top 90% of probability mass"),
        ("%%generate --temperature 0.8 --top-k 40", "sample from the 40 most likely tokens"),
        ("%%generate --stop '###' --stop END", "stop at either string"),
        ("%%generate --session chat1", "the cell is the next user turn of chat 'chat1'"),
        ("%%generate --system 'Answer in French.'", "a system prompt for this cell"),
        ("%%generate --raw", "no chat template: the cell is sent as written"),
        ("%%generate --out r", "keep the result: r.text, r.tokens, r.stats (-o r)"),
        ("%%generate --model small", "use the model loaded as 'small' (-m small)"),
        ("%%generate --checkpoint-every 32", "an interrupted or killed run resumes from its last 32-token mark"),
        ("%%generate --no-cache", "neither look up nor publish prompt caches (a cold baseline)"),
        ("%%generate --image cat.png", "a vision-language model sees the image (repeatable: -i a.png -i b.png)"),
        ("%%generate --image {picture}", "a variable holding a path, a PIL image or an array"),
        ("%%generate --video clip.mp4 --fps 1 --max-frames 16", "Qwen2-VL / Qwen2.5-VL see the clip (sampled frames)"),
        ("%%generate --audio talk.wav", "Gemma 4 hears the recording (or --audio {waveform})"),
        ("%%generate --literal", "no {name} interpolation (or write {{name}} for one literal {name})"),
        ("%%generate --passages docs", "the passages in `docs` (a list, a Series, df.text) go before the cell, each "
         "placed from its own cached KV (approximate)"),
        ("%%generate --passages docs --recompute 0.3", "recompute 30% of the placed passage tokens (1: a full "
         "prefill's numbers)"),
        ("%%generate --truncate left", "a prompt past the model's window drops its oldest tokens (middle: keeps "
                                       "start and end) instead of being refused"),
        ("%%generate --batch questions", "the cell is a template: one row per item ({item}); a table of results"),
        ("%%generate --batch df --out answers", "{question} names a column of DataFrame df; answers keeps the table"),
        ("%%generate --n 4 --temperature 0.8", "4 samples of one prompt (seeds 0..3) from one prefill"),
        ("%%generate --logprobs 5", "each token's log-probability and its 5 most likely alternatives (r.logprobs)"),
        ("%%generate --draft small", "speculative decoding: model 'small' proposes, the model verifies; same text"),
        ("%%generate --draft small --draft-tokens 6", "6 proposed tokens per verification (default 4)"),
        ("%%generate --no-draft", "without the model's default draft (%model load --draft)"),
        ("%%generate --json Invoice --out r", "the answer is JSON following the Pydantic model (or schema dict) "
                                              "Invoice; r.parsed holds it"),
        ("%%generate --regex '[A-Z]{2}-[0-9]{4}'", "the answer matches the pattern, whole"),
        ("%%generate --choice 'yes|no|unsure'", "the answer is one of the choices (or --choice labels: a list)"),
        ("%%generate --grammar calc", "the answer follows the Lark or GBNF grammar held by variable calc"),
        ("%%generate --batch df --json Invoice", "one answer per row; the table gets a column per field"),
        ("%%generate --think", "thinking on (the template's enable_thinking); the reasoning shows collapsed above "
                               "the answer (r.reasoning)"),
        ("%%generate --no-think --session chat1", "thinking off; the session keeps its options for later turns"),
        ("%%generate --template-arg reasoning_effort=low", "any chat-template keyword (gpt-oss's here); repeatable"),
        ("%%generate --session s --tools weather,convert", "the model may call these notebook functions; each call "
                                                          "and its result shows, then the answer (r.steps)"),
        ("%%generate --tools weather --tool-choice required --max-steps 3",
         "every step calls a tool, arguments valid for its schema (3 steps), then the answer (none: no calls)"),
        ("%%generate --tools weather --confirm", "ask before each call runs"),
        ("%%generate --lookup / --no-lookup", "drafts from the prompt itself, verified (same text): always / never (default: where they pay)"),
    ],
    "eval": [
        ("%eval mmlu --num-fewshot 5", "lm-evaluation-harness's MMLU, 5-shot, on the default model (-k 5)"),
        ("%eval hellaswag,arc_easy --limit 100", "two tasks, 100 documents each (-l 100; 0.1: a tenth)"),
        ("%eval my_task --include-path tasks/", "a task YAML of your own, in folder tasks/"),
        ("%eval gsm8k --model small --chat", "the model loaded as 'small', prompts in its chat template"),
        ("%eval mmlu --seed 1", "the harness's seeds (which few-shot examples it samples)"),
        ("%eval mmlu --out results", "keep the harness's results dict (results['results'][task])"),
    ],
    "score": [
        ("%%score options", "the cell is the context; rank the strings of list `options` by log-likelihood"),
        ("%%score options --out ranked", "keep the ranked results (.logprob, .token_logprobs, .greedy)"),
        ("%%score options --chat", "the cell is a chat turn; each option the assistant's reply"),
        ("%%score options --chat --system 'Be brief.'", "with a system prompt"),
        ("%%score options --model small", "score with the model loaded as 'small'"),
        ("%%score options --no-cache", "neither look up nor publish the context's cache"),
        ("%%score options --literal", "no {name} interpolation in the cell"),
        ("%%score options --truncate left", "a context past the model's window drops its oldest tokens (or middle)"),
    ],
    "model": [
        ("%model load", "the configured default model (SmolLM2-135M-Instruct unless set)"),
        ("%model load ~/models/qwen --name small", "a model directory or hub id, under a name"),
        ("%model load --kv-bits 8", "quantize the KV cache to 8 (or 4) bits from token 5000 on"),
        ("%model load --kv-bits 8 --kv-start 0", "... from the first token (--kv-start N: from token N)"),
        ("%model load --kv-bits 4 --kv-group-size 32", "values per quantization group: 32, 64 or 128"),
        ("%model load ~/models/qwen --adapter ~/adapters/legal --name legal",
         "with an mlx-lm LoRA adapter; its cache is its own (never the base model's)"),
        ("%model load ~/models/qwen-7b --draft small", "'small' (loaded first) drafts for it by default"),
        ("%model load ~/models/gemma-3-4b-it", "a vision-language model loads through mlx-vlm ([vision] extra)"),
        ("%model load ~/models/gemma-3-4b-it --image-attention causal",
         "image tokens attend causally (as mlx-vlm generates), not bidirectionally"),
        ("%model load ~/models/qwen3 --chat-template qwen3.jinja",
         "render chats with another template (a .jinja file or a tokenizer_config.json) than the model's own"),
        ("%model list", "resident models; * marks the default"),
        ("%model use small", "make 'small' the default for %%generate"),
        ("%model unload small", "free its memory"),
        ("%model info", "identity, layers and KV scheme of the default model"),
    ],
    "session": [
        ("%session new chat1 --system 'Be brief.'", "a chat with a system prompt"),
        ("%session new chat2 --model small", "a chat on another loaded model"),
        ("%session list", "every chat"),
        ("%session show chat1", "the conversation so far"),
        ("%session switch chat1", "bring its cached state back into RAM"),
        ("%session reset chat1", "forget the turns"),
        ("%session close chat1", "drop the chat"),
    ],
    "checkpoint": [
        ("%checkpoint save intro", "the last generation's state, kept until removed"),
        ("%checkpoint save intro --session chat1", "a chat's latest state"),
        ("%checkpoint save intro --model small", "the last state of model 'small'"),
        ("%checkpoint list", "named checkpoints"),
        ("%checkpoint restore intro", "back into RAM"),
        ("%checkpoint rm intro", "forget it"),
    ],
    "cache": [
        ("%cache stats", "counters by group: RAM, SSD, writes, remote, objects, vision (zeros hidden)"),
        ("%cache stats --all", "every counter, zeros and empty groups too"),
        ("%cache ls", "the 20 newest entries, newest first"),
        ("%cache ls --all", "every entry"),
        ("%cache ls --model default", "entries of one model"),
        ("%cache ls --session chat1", "entries of one chat"),
        ("%cache why", "why the last cell reused no more: the nearest cached prefix, where they part, what differed"),
        ("%cache flush --timeout 30", "wait (at most 30 s) until every queued write is durable"),
        ("%cache clear", "drop RAM entries (SSD files stay)"),
        ("%cache clear --ssd", "and delete the SSD files (named checkpoints stay)"),
        ("%cache gc --dry-run", "list stale and orphaned files; gc without it removes them"),
        ("%cache gc --quarantine", "also remove the quarantined files, kept as evidence until then"),
        ("%cache verify", "re-hash every SSD file"),
        ("%cache config", "the settings in effect"),
        ("%cache help", "the cheat sheet (same as %mlxcache)"),
    ],
    "memo": [
        ("%memo ls", "functions decorated with @memo (from mlxcache_kernel import memo): results, bytes, hits"),
        ("%memo clear embed", "forget embed's results, in RAM and on SSD"),
        ("%memo clear --all", "forget every memoized result"),
    ],
    "kv": [
        ("%kv inspect", "shapes, bytes, hashes and statistics of the last generation's KV (--last)"),
        ("%kv inspect --last --layer 0", "one layer"),
        ("%kv inspect --session chat1", "a chat's latest state"),
        ("%kv inspect --checkpoint intro --widget", "the interactive inspector on a named checkpoint"),
        ("%kv export --to kvs", "kvs = {'layer0.keys': numpy array, ...}"),
    ],
}


def examples(magic: str) -> str:
    """The ``Examples:`` block for ``magic``'s help."""
    rows = EXAMPLES[magic]
    width = max(len(e) for e, _ in rows)
    return "Examples:\n" + "\n".join(f"  {e.ljust(width)}  {what}" for e, what in rows)


CHEAT_SHEET = """\
mlxcache: a resident model and a RAM/SSD prompt cache. Add ? to any magic for every option.

  %model load [PATH] [--name N] [--kv-bits 8] [--adapter DIR]   load a model (no PATH: SmolLM2)
  %model list | use N | unload N | info [N]

  %%generate [-n 64] [-t 0.8 --top-p P --top-k K --seed 7] [--out r]   the cell is the prompt
      --session ID  --system TEXT  --raw  --stop S  --no-cache  --checkpoint-every N
      --think | --no-think  --template-arg K=V  --tools F [--tool-choice C --max-steps N --confirm]
      --image P | --video P [--fps F] [--max-frames N] | --audio P: for vision-language models
      --draft NAME [--draft-tokens K] | --no-draft | --lookup | --no-lookup: verified drafts
      --truncate left|middle: a prompt past the model's window is cut, not refused
      {name} -> the value of name; {{name}} writes a literal {name}; --literal: neither
      --batch VAR: the cell is a template over a list/Series/DataFrame ({item}, {col}) -> a table
      --n K: K samples from one prefill (seeds s..s+K-1)  --logprobs K: K alternatives per token
      --passages VAR [--recompute F]: VAR's passages before the cell, from their cached KV (approx.)
      --json MODEL | --regex P | --choice 'a|b' | --grammar VAR: answers that parse (r.parsed)
      the footer: tokens from RAM / SSD / prefilled, TTFT, tok/s, context used, why a prefix missed

  %%score OPTIONS [--chat] [--out r]              rank list OPTIONS as continuations of the cell
  %eval TASKS [--num-fewshot K] [--limit N]      lm-evaluation-harness tasks over the cache
  %session new|list|show|switch|reset|close ID    multi-turn chats (%%generate --session ID)
  %checkpoint save|list|restore|rm NAME           named states no budget evicts
  %cache stats|ls [--all] [--model M] [--session S]|why|flush|clear [--ssd]|gc|verify|config|help
  %kv inspect|export [--session ID | --checkpoint NAME | --last] [--layer L] [--to VAR] [--widget]
  %dashboard                                      live RAM/SSD residency, writes, hits
  @memo (from mlxcache_kernel import memo)        a function's array results, kept in RAM and on SSD
  %memo ls | clear NAME | clear --all             what @memo keeps

Settings: MLXCACHE_CACHE_DIR, MLXCACHE_RAM_BUDGET, MLXCACHE_SSD_BUDGET, MLXCACHE_PREFETCH_BUDGET,
MLXCACHE_DEFAULT_MODEL (or c.MLXCache.* in IPython config); %cache config shows them."""


@magics_class
class HelpMagics(Magics):
    """``%mlxcache``: the cheat sheet."""

    @line_magic
    def mlxcache(self, line):
        """Print the mlxcache cheat sheet: every magic on one screen."""
        if line.strip() not in ("", "help"):
            raise UsageError(f"%mlxcache takes no arguments, got {line.strip()!r} (try %cache? or %%generate?)")
        print(CHEAT_SHEET)
