"""``%%generate --batch VAR`` and ``--n K``: one cell, many prompts, one ``generate_batch``.

The cell is a template over the items of VAR: ``{item}`` is a list's or a
Series' item (a Series' own name works too), ``{col}`` a DataFrame's column or
a dict item's key; other ``{name}`` fields come from the notebook as in
``%%generate``. A field neither defines is an error naming it (a typo would
otherwise send every row wrong). ``--n K`` draws K samples of each prompt from
one prefill, with seeds s..s+K-1. A progress display counts rows and tokens per
second; the result is a table (a pandas DataFrame when pandas is installed,
indexed like VAR), one row per prompt with the footer's provenance.
"""

from __future__ import annotations

import html
import math
import sys
import time

from IPython.core.error import UsageError
from IPython.display import display

from mlxcache_kernel.engine.generate.window import max_chars

from .base import sampling_options
from .constrain import constraint_options, field_columns
from .footer import footer_spans
from .output import DisplayLine
from .prompt import interpolate
from .tables import fmt_s

__all__ = ["BatchTable", "run_batch", "template_rows"]

# ttft_ms and tok_s as the footer shows them (milliseconds; tokens per second), one decimal: numbers
# still (a column's mean, a sort), the exact values in .attrs["results"] (each row's stats)
COLUMNS = ["prompt", "text", "new_tokens", "ram", "ssd", "remote", "shared", "prefilled", "ttft_ms", "tok_s",
           "finish"]


def _one_decimal(x) -> float | None:
    return None if x is None else round(float(x), 1)


def _items(name: str, value) -> tuple[list, list[dict]]:
    """(index, fields per row) of the value bound to VAR."""
    kind = type(value).__name__
    if kind == "DataFrame" and hasattr(value, "columns"):
        cols = [c for c in value.columns if isinstance(c, str)]
        return list(value.index), [{c: row[c] for c in cols} for _, row in value.iterrows()]
    if kind == "Series" and hasattr(value, "index"):
        own = value.name if isinstance(value.name, str) and value.name.isidentifier() else None
        return list(value.index), [{"item": v, **({own: v} if own else {})} for v in value.tolist()]
    if isinstance(value, dict):
        return list(value), [{"item": v} for v in value.values()]
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise UsageError(f"--batch {name}: needs a list, a dict, a pandas Series or DataFrame, got {kind}")
    items = list(value)
    return list(range(len(items))), [dict(v) if isinstance(v, dict) else {"item": v} for v in items]


def item_columns(value) -> list[dict]:
    """Per item of VAR, the columns the table keeps of it: a DataFrame's own, else the item itself."""
    return [{k: v for k, v in fields.items() if k not in COLUMNS} for fields in _items("", value)[1]]


def template_rows(template: str, name: str, value, namespace: dict, hidden=frozenset(), *, limit: int | None = None,
                  truncate: str | None = None) -> tuple[list, list[str]]:
    """(index, prompt per item): the cell filled in for every item of VAR (bound to `value`); a field
    longer than `limit` characters refused, or cut as `truncate` says (prompt.py)."""
    index, rows = _items(name, value)
    if not rows:
        raise UsageError(f"--batch {name}: it has no items")
    prompts, used, missing = [], set(), {}
    for i, fields in zip(index, rows):
        undefined: list[str] = []
        prompt = interpolate(template, {**namespace, **fields}, set(hidden) - set(fields), undefined, limit=limit,
                             truncate=truncate)
        if undefined:
            known = ", ".join("{" + f + "}" for f in fields if isinstance(f, str)) or "none"
            raise UsageError(f"template field {{{undefined[0]}}} is neither a field of {name} ({known}) nor a "
                             f"defined variable; write {{{{{undefined[0]}}}}} for a literal {{{undefined[0]}}}")
        if not prompt.strip():
            raise UsageError(f"--batch {name}: the prompt of item {i!r} is empty")
        mine = {f for f in fields if isinstance(f, str) and "{" + f + "}" in template}
        for f in mine:
            if _missing(fields[f]):
                missing.setdefault(f, []).append((i, fields[f]))
        used |= mine
        prompts.append(prompt)
    for f, where in missing.items():  # pandas' NaN and None would go into the prompt as words
        shown = ", ".join(repr(i) for i, _ in where[:3]) + (", ..." if len(where) > 3 else "")
        print(f"[mlxcache] warning: {name} has no value for {{{f}}} in {len(where)} item(s) ({shown}): "
              f"their prompts say {str(where[0][1])!r} there", file=sys.stderr)
    if not used:
        print(f"[mlxcache] warning: the cell uses no field of {name} ({{item}} or a column): every row gets the "
              "same prompt", file=sys.stderr)
    return index, prompts


def _missing(value) -> bool:
    """None, NaN, or pandas' NA / NaT (pandas is not imported for it)."""
    return (value is None or (isinstance(value, float) and math.isnan(value))
            or type(value).__name__ in ("NAType", "NaTType"))


class BatchProgress:
    """Prefill progress in tokens, then rows done and tokens per second; one display, in a kernel only."""

    def __init__(self, rows: int, enabled: bool):
        self.rows, self.enabled = rows, enabled
        self.done = self.tokens = 0
        self.t_decode: float | None = None
        self.handle = self.bar = self.label = None
        self._last = 0.0

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase == "decode":
            self.tokens = done
            self.t_decode = self.t_decode or time.perf_counter()
            self._show(self.done, self.rows, self.line())
        else:
            self._show(done, total, f"{'Restoring from SSD' if phase == 'restore' else 'Prefill'} "
                                    f"{done:,}/{total:,} tokens", force=done >= total)

    def row_done(self, index, result) -> None:
        self.done += 1
        self._show(self.done, self.rows, self.line(), force=True)

    def line(self) -> str:
        elapsed = time.perf_counter() - self.t_decode if self.t_decode else 0.0
        rate = f" · {self.tokens / elapsed:,.1f} tok/s" if elapsed > 0 else ""
        return f"rows {self.done}/{self.rows} · {self.tokens:,} tokens{rate}"

    def _show(self, done: int, total: int, text: str, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self._last < 0.2):
            return
        self._last = now
        if self.handle is None:
            try:
                import ipywidgets as W

                self.bar, self.label = W.IntProgress(min=0, max=1, bar_style="info"), W.HTML()
                self.handle = display(W.HBox([self.bar, self.label]), display_id=True)
            except Exception:
                self.handle = DisplayLine()
        if self.bar is not None:
            self.bar.max, self.bar.value = max(1, total), min(done, max(1, total))
            self.label.value = f"<span style='font-family:monospace'>{text}</span>"
        else:
            self.handle.write(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.label.close()
        if self.handle is not None:  # the output holds no dead widget view when saved
            handle = self.handle.handle if isinstance(self.handle, DisplayLine) else self.handle
            handle.update({"text/plain": ""}, raw=True)
            self.handle = None


class BatchTable(list):
    """The table without pandas: one dict per row (``.results``: the GenerationResults)."""

    def __init__(self, rows: list[dict], results: list):
        super().__init__(rows)
        self.results = results

    def _text(self) -> str:
        cols = list(self[0]) if self else COLUMNS
        cells = [[_short(r.get(c)) for c in cols] for r in self]
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
        return "\n".join(lines + ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells])

    def __repr__(self) -> str:
        return self._text()

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(self._text())


def _short(v, width: int = 48) -> str:
    s = "" if v is None else " ".join(str(v).split())
    return s if len(s) <= width else s[: width - 1] + "…"


def table(index: list, names: list, prompts: list[str], results: list, seeds: list | None, items: list | None = None):
    """The rows as a DataFrame indexed like VAR (``.attrs["results"]``: the GenerationResults), or a BatchTable:
    VAR's own columns (`items`: the question), the answer, the footer's numbers, then the whole prompt."""
    rows = []
    fields = field_columns(results, set(COLUMNS) | {"seed", "logprob", "incomplete"})
    keys = list(dict.fromkeys(k for f in fields for k in f))  # every row gets every field (None where missing)
    items = items or [{}] * len(results)
    for prompt, r, seed, own, item in zip(prompts, results, seeds or [None] * len(results), fields, items):
        s, spans = r.stats, footer_spans(r.stats)
        row = {**{k: v for k, v in item.items() if k not in keys}, "text": r.text, **{k: own.get(k) for k in keys},
               "new_tokens": len(r.tokens), "ram": spans["ram"], "ssd": spans["ssd"],
               "remote": spans["remote"], "shared": s.get("batch_shared_tokens", 0), "prefilled": spans["prefilled"],
               "ttft_ms": _one_decimal(None if s.get("ttft_s") is None else s["ttft_s"] * 1000),
               "tok_s": _one_decimal(s.get("decode_tokens_per_s")), "finish": s.get("finish_reason")}
        if seeds is not None:
            row["seed"] = seed
        if r.logprobs is not None:  # --logprobs: how sure the model was of the row's text (each token's in .attrs)
            row["logprob"] = round(sum(lp.logprob for lp in r.logprobs), 4)
        if s.get("constraint"):  # why the answer has no fields: "incomplete JSON (max tokens)"
            row["incomplete"] = s.get("constraint_incomplete")
        row["prompt"] = prompt
        rows.append(row)
    try:
        import pandas as pd
    except ImportError:
        return BatchTable([{(n or "index"): i for n, i in zip(names, k if len(names) == 2 else (k,))} | row
                           for k, row in zip(index, rows)], results)
    idx = pd.MultiIndex.from_tuples(index, names=names) if len(names) == 2 else pd.Index(index, name=names[0])
    df = readable_frame(pd)(rows, index=idx)
    df.attrs["results"] = results
    return df


def readable_frame(pd):
    """A DataFrame whose HTML shows each answer whole, its line breaks as breaks (pandas cuts a cell at 50
    characters), without the prompt column (VAR's own columns say what each row asked); what is derived
    from it is a plain DataFrame."""

    class BatchFrame(pd.DataFrame):
        @property
        def _constructor(self):
            return pd.DataFrame

        def _repr_html_(self) -> str:  # (pandas' to_html writes a line break as a literal \n)
            cols = [c for c in self.columns if c != "prompt"]
            head = "".join(f"<th>{html.escape(str(c))}</th>" for c in [" / ".join(map(str, self.index.names))
                                                                       if any(self.index.names) else "", *cols])
            body = "".join("<tr><th>" + html.escape(str(i)) + "</th>" + "".join(
                f"<td>{html.escape('' if v is None else str(v))}</td>" for v in row) + "</tr>"
                for i, row in zip(self.index, self[cols].itertuples(index=False)))
            return ("<div class='mlxc-batch'><style>.mlxc-batch td{white-space:pre-wrap;text-align:left;"
                    "vertical-align:top;max-width:48em}</style>"
                    f"<table class='dataframe'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>")

    return BatchFrame


def summary(results: list, once: int, seconds: float, model: str, use_cache: bool) -> str:
    """The batch's footer: where the prompt tokens came from (``once``: prefilled once for the rows
    sharing them), how many tokens the rows generated and how fast."""
    total = lambda k: sum(int(r.stats.get(k) or 0) for r in results)  # noqa: E731
    tokens = sum(len(r.tokens) for r in results)
    serial = any(r.stats.get("batch_mode") == "serial" for r in results)
    parts = [f"{len(results)} rows, {total('prompt_tokens'):,} prompt tokens: {total('ram_tokens'):,} from RAM, "
             f"{total('ssd_tokens'):,} from SSD, "
             + (f"{total('remote_tokens'):,} from remote, " if total("remote_tokens") else "")
             + (f"{total('batch_shared_tokens'):,} shared ({once:,} prefilled once), " if once else "")
             + f"{total('prefilled_tokens'):,} prefilled by the rows" + ("" if use_cache else " (cache off)"),
             f"{tokens:,} tokens in {fmt_s(seconds)}" + (f" ({tokens / seconds:,.1f} tok/s)" if seconds > 0 else ""),
             "rows one after another" if serial else "batched"]
    incomplete = [r.stats["constraint_incomplete"] for r in results if r.stats.get("constraint_incomplete")]
    if incomplete:  # (their fields stay empty in the table)
        parts.append(f"{len(incomplete)} of {len(results)} answers: {incomplete[0]}")
    return "[mlxcache] " + " · ".join(parts) + f" · model {model}"


def _index_name(value):
    return getattr(value.index, "name", None) if type(value).__name__ in ("DataFrame", "Series") else None


def run_batch(magics, args, cell: str, in_kernel: bool):
    """The batch form of ``%%generate`` (``--batch VAR`` and/or ``--n K``)."""
    if args.session is not None or args.checkpoint_every is not None:
        raise UsageError("--batch and --n take neither --session nor --checkpoint-every (a batch is not a chat)")
    if getattr(args, "image", None):
        raise UsageError("--batch and --n take no --image: a batch is text prompts")
    k = 1 if args.samples is None else args.samples
    if k < 1:
        raise UsageError(f"--n must be >= 1, got {k}")
    shell = magics.shell
    magics._ensure_model(args.model)
    eng = magics.engine
    model = args.model or eng.models.default
    limit = max_chars(eng.models.get(model))  # (an unknown model: one line, before any work)
    if args.batch is not None:
        if not args.batch.isidentifier() or args.batch not in shell.user_ns:
            raise UsageError(f"--batch needs the name of a defined variable (a list, Series or DataFrame), "
                             f"got {args.batch!r}")
        if args.literal:
            raise UsageError("--batch fills the cell's {fields} in for every item: it cannot be --literal")
        if not cell or not cell.strip():
            raise UsageError("empty prompt: write the prompt template in the cell body below %%generate")
        value = shell.user_ns[args.batch]
        index, prompts = template_rows(cell.strip("\n"), args.batch, value, shell.user_ns,
                                       set(getattr(shell, "user_ns_hidden", {})), limit=limit, truncate=args.truncate)
        names = [_index_name(value)] + (["sample"] if k > 1 else [])
        index = [(i, j) for i in index for j in range(k)] if k > 1 else index
    else:
        prompts = [magics._prompt(cell, literal=args.literal, model=model, truncate=args.truncate)]
        index, names = list(range(k)), ["sample"]
    if k > 1 and args.temperature == 0:
        print(f"[mlxcache] warning: --n {k} with --temperature 0 (greedy) gives {k} identical texts; "
              "set --temperature to sample", file=sys.stderr)
    seeds = [args.seed + j for _ in prompts for j in range(k)]
    prompts = [p for p in prompts for _ in range(k)]
    constraint = constraint_options(args, shell.user_ns)
    progress = BatchProgress(len(prompts), enabled=in_kernel)
    t0, prefilled0 = time.perf_counter(), eng.metrics.counters["prefilled_tokens"]
    try:
        results = eng.generate_batch(prompts, **sampling_options(args, seed=seeds), model=model, system=args.system,
                                     raw=args.raw, use_cache=not args.no_cache, on_progress=progress,
                                     on_row=progress.row_done, truncate=args.truncate,
                                     lookup=bool(args.lookup) if args.lookup or args.no_lookup else None,
                                     **constraint)
    except KeyboardInterrupt:
        print("[mlxcache] interrupted; the cache is intact (finished rows are published)", file=sys.stderr)
        raise
    finally:
        progress.close()
    once = eng.metrics.counters["prefilled_tokens"] - prefilled0 - sum(r.stats["prefilled_tokens"] for r in results)
    print(summary(results, once, time.perf_counter() - t0, model, not args.no_cache))
    items = [c for c in item_columns(shell.user_ns[args.batch]) for _ in range(k)] if args.batch else None
    out = table(index, names, prompts, results, seeds if args.temperature > 0 else None, items)
    if args.out:
        shell.user_ns[args.out] = out
    return out
