"""Write the example notebooks in examples/ (kept as code so they are reviewable).

    python scripts/make_examples.py            # rewrite examples/*.ipynb (no outputs)
    python scripts/make_examples.py --check    # exit 1 if a notebook differs from this script

The notebooks run on the ``mlxcache`` kernel (``mlxcache-kernel install``) and
load the configured default model with ``%model load``: SmolLM2-135M-Instruct
unless ``MLXCACHE_DEFAULT_MODEL`` names another (the tests run them on a tiny
random model that way). A code cell tagged ``restart-kernel`` is where a person
restarts the kernel; ``mlxcache-kernel run`` restarts it there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

sys.path.insert(0, str(Path(__file__).resolve().parent))
from example_texts import DOCUMENT, NOTES  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
KERNELSPEC = {"name": "mlxcache", "display_name": "MLX Cache (Python 3)", "language": "python"}


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str, *tags: str):
    cell = new_code_cell(text.strip("\n"))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def notebook(cells) -> nbformat.NotebookNode:
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"  # stable ids: regenerating gives the same file
    return nb


def quickstart():
    return notebook([
        md("""
# Quickstart: the MLX Cache kernel

This kernel keeps a language model and the KV state of every prompt it has seen
resident across cells. Rerun a cell, or ask another question about the same
text, and the prompt comes back from RAM (or, after a restart, from the SSD
tier) instead of being computed again.

`%model load` without a path loads the configured default model:
SmolLM2-135M-Instruct, converted from the bundled GGUF the first time
(set `MLXCACHE_DEFAULT_MODEL` to use another).
"""),
        code("%model load"),
        md("""
## A first generation

The cell body is the prompt; `{notes}` is replaced by the variable `notes`
(only names that exist are substituted, other braces stay as written).
Tokens stream into the output; the footer says where the prompt tokens came
from, the time to first token (TTFT) and the decode speed. `--out first`
keeps the result (`.text`, `.tokens`, `.stats`).
"""),
        code(f"notes = '''{NOTES}'''"),
        code("""
%%generate --max-tokens 40 --out first
{notes}

In two sentences: what did the group decide, and why?
"""),
        md("""
## The same cell again

Everything but the last prompt token comes from RAM, so the first token
arrives almost at once. Greedy decoding gives the same text.
"""),
        code("""
%%generate --max-tokens 40 --out again
{notes}

In two sentences: what did the group decide, and why?
"""),
        md("""
Each run is labelled by where its prompt came from: the first run of this
notebook prefills everything (cold), but run the notebook again and even the
first generation finds its prompt cached: on SSD, or already back in RAM
(loading a model brings its most recently used prompts back in the background).
"""),
        code("""
def came_from(r):
    s = r.stats
    if not s["cached_tokens"]:
        return f"cold: all {s['prompt_tokens']} prompt tokens prefilled"
    return f"{s['cached_tokens']} of {s['prompt_tokens']} prompt tokens from {s['cache_source'].upper()}"

print("identical text:", again.text == first.text)
for label, r in (("first run", first), ("second run", again)):
    print(f"{label}: TTFT {r.stats['ttft_s'] * 1000:.0f} ms ({came_from(r)})")
"""),
        md("""
## Sampling is seeded

With a temperature above zero the output depends only on the seed, so a cached
rerun (or a rerun after a restart) samples the same text.
"""),
        code("""
%%generate --max-tokens 24 --temperature 0.8 --seed 42 --out slogan
Write a one-line slogan for a library that never forgets.
"""),
        md("""
## What is resident

`%cache ls` lists every checkpoint in RAM and on SSD; `%cache stats` has the
counters. Checkpoints are written to SSD in the background between cells.
"""),
        code("%cache flush\n%cache ls"),
        code("%cache stats"),
        md("""
Every magic has help: `%%generate?`, `%model?`, `%session?`, `%checkpoint?`,
`%cache?`, `%kv?` (each with one example per option), and `%mlxcache` prints
a one-screen cheat sheet. A wrong option or unknown name is one `UsageError`
line and nothing else changes.
"""),
        code("%session show nobody", "raises-exception"),
    ])


def restart_resume():
    return notebook([
        md("""
# Restart resume

A kernel restart loses everything in memory, but the prompt cache's SSD tier
survives it: shutdown flushes pending writes first (and says so in the kernel
log), and the rerun of the same cell restores the prompt's KV state from disk.
Greedy and seeded outputs are identical to the first run.
"""),
        code("%model load"),
        code("""
report = '''Quarterly maintenance report, pumping station 4.
The north intake screen was cleaned twice; silt load was higher than last year.
Pump B ran 1,912 hours and its bearing temperature stayed below 61 C.
Pump C was down for six days in May while its seal was replaced.
The backup generator started within 9 seconds in all four monthly tests.
Energy use fell 7 percent after the variable-speed drive on pump A was retuned.'''
"""),
        code("""
%%generate --max-tokens 32 --out before
Summarize this report in one sentence:
{report}
"""),
        code("""
%%generate --max-tokens 24 --temperature 0.7 --seed 5 --out before_sampled
Give the report a short title:
{report}
"""),
        md("""
Remember what the first run produced, in a file: the kernel is about to lose
its variables.
"""),
        code("""
import json, pathlib, tempfile
saved = pathlib.Path(tempfile.gettempdir()) / "mlxcache_restart_resume.json"
saved.write_text(json.dumps({"greedy": before.tokens, "sampled": before_sampled.tokens}))
print(f"saved {len(before.tokens)} + {len(before_sampled.tokens)} tokens to {saved}")
"""),
        md("""
## Restart the kernel now

In JupyterLab: **Kernel → Restart Kernel**, then run the cells below.
(`mlxcache-kernel run` restarts it here: the next cell is tagged
`restart-kernel`.) The kernel log shows the flush, e.g.
`[mlxcache] before restart: flushed 2 pending writes ...`.
"""),
        code("""
report = '''Quarterly maintenance report, pumping station 4.
The north intake screen was cleaned twice; silt load was higher than last year.
Pump B ran 1,912 hours and its bearing temperature stayed below 61 C.
Pump C was down for six days in May while its seal was replaced.
The backup generator started within 9 seconds in all four monthly tests.
Energy use fell 7 percent after the variable-speed drive on pump A was retuned.'''
%model load
""", "restart-kernel"),
        md("""
The same cells again. `%model load` above also started reading the most
recently used prompt states from SSD back into RAM in the background, so the
footer says the prompt came from RAM (or from SSD, when a cell runs before
its read has finished: it then waits for that read instead of starting another).
"""),
        code("""
%%generate --max-tokens 32 --out after
Summarize this report in one sentence:
{report}
"""),
        code("""
%%generate --max-tokens 24 --temperature 0.7 --seed 5 --out after_sampled
Give the report a short title:
{report}
"""),
        code("""
import json, pathlib, tempfile
saved = json.loads((pathlib.Path(tempfile.gettempdir()) / "mlxcache_restart_resume.json").read_text())
print("greedy identical: ", after.tokens == saved["greedy"])
print("sampled identical:", after_sampled.tokens == saved["sampled"])
print("restored from:", after.stats["cache_source"], f"({after.stats['cached_tokens']} of {after.stats['prompt_tokens']} tokens)")
"""),
        md("""
## Interrupted generations resume too

With `--checkpoint-every N`, a long generation commits an in-flight checkpoint
every N tokens. If the kernel is interrupted, killed or crashes, running the
identical cell again continues from the newest committed checkpoint and
produces exactly the text the uninterrupted run would have (the footer says
`resumed from an in-flight checkpoint at token ...`).
"""),
        code("""
%%generate --max-tokens 24 --checkpoint-every 8
List three checks for a pump before winter.
"""),
    ])


def long_document():
    return notebook([
        md("""
# One long document, several questions

A document of several hundred tokens is the expensive part of every question
about it. The first question prefills it; the following questions share that
prefix and only prefill their own few tokens. The last cell puts the timings
side by side, with a run that bypasses the cache (`--no-cache`) as the
baseline.

The document contains braces (a JSON snippet): `%%generate` substitutes only
`{name}` for variables that exist, so the text goes in unchanged.
"""),
        code("%model load"),
        code(f"document = '''{DOCUMENT}'''\nprint(len(document.split()), 'words')"),
        code("""
%%generate --max-tokens 32 --out q1
{document}

Question: Where is the station and what does it consist of?
"""),
        code("""
%%generate --max-tokens 32 --out q2
{document}

Question: How often are values stored, and why are they averaged?
"""),
        code("""
%%generate --max-tokens 32 --out q3
{document}

Question: What was the highest level ever recorded, and when?
"""),
        md("The same question as the last one, with the cache bypassed:"),
        code("""
%%generate --max-tokens 32 --no-cache --out cold
{document}

Question: What was the highest level ever recorded, and when?
"""),
        code("""
rows = [("q1 (cold)", q1), ("q2", q2), ("q3", q3), ("q3 --no-cache", cold)]
print(f"{'run':<15}{'prompt':>8}{'cached':>8}{'prefilled':>11}{'prefill':>10}{'TTFT':>9}{'tok/s':>8}")
for label, r in rows:
    s = r.stats
    print(f"{label:<15}{s['prompt_tokens']:>8}{s['cached_tokens']:>8}{s['prefilled_tokens']:>11}"
          f"{s['prefill_s']:>9.2f}s{s['ttft_s']:>8.2f}s{(s['decode_tokens_per_s'] or 0):>8.1f}")
print()
print("q3 identical with and without the cache:", q3.tokens == cold.tokens)
print(f"TTFT speed-up for q3: {cold.stats['ttft_s'] / q3.stats['ttft_s']:.0f}x")
"""),
        code("%cache ls"),
    ])


def chat_session():
    return notebook([
        md("""
# A chat session

`%%generate --session ID` treats the cell as the next user turn of a
conversation. Each turn renders the whole conversation with the chat template;
the session index maps the session to its latest checkpoint, so the earlier
turns come from the cache and only the new turn is prefilled.
"""),
        code("%model load"),
        code('%session new chat --system "You are a concise assistant. Answer in one or two sentences."'),
        code("""
%%generate --session chat --max-tokens 40 --out t1
What is a tide gauge?
"""),
        code("""
%%generate --session chat --max-tokens 40 --out t2
Why would it need a backup sensor?
"""),
        code("""
print(f"turn 2: {t2.stats['prompt_tokens']} prompt tokens, {t2.stats['cached_tokens']} from the cache, "
      f"{t2.stats['prefilled_tokens']} prefilled")
"""),
        code("%session show chat"),
        md("""
## Named checkpoints

`%checkpoint save` pins the session's latest state under a name: it is written
to SSD and the cache budgets never evict it. Restoring it later (even after a
restart) brings back the KV state and the conversation.
"""),
        code("%checkpoint save tide-chat --session chat\n%checkpoint list"),
        code("%kv inspect --session chat --layer 0"),
        code("""
%kv export --session chat --layer 0 --to kv
{name: (a.shape, str(a.dtype)) for name, a in kv.items()}
"""),
        md("Closing the session drops its references; the named checkpoint brings it back."),
        code("%session close chat\n%session list"),
        code("%checkpoint restore tide-chat\n%session show chat"),
        code("""
%%generate --session chat --max-tokens 40 --out t3
Where should it be installed?
"""),
        code("%checkpoint rm tide-chat\n%session list"),
        md("A live view of the cache (RAM and SSD entries, writes, hits):"),
        code("%dashboard"),
    ])


NOTEBOOKS = {
    "quickstart.ipynb": quickstart,
    "restart_resume.ipynb": restart_resume,
    "long_document.ipynb": long_document,
    "chat_session.ipynb": chat_session,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that examples/ is up to date")
    args = parser.parse_args(argv)
    EXAMPLES.mkdir(exist_ok=True)
    stale = []
    for name, build in NOTEBOOKS.items():
        text = nbformat.writes(build()) + "\n"
        path = EXAMPLES / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"out of date (run scripts/make_examples.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
