"""``%memo``: the results ``@memo`` keeps (``ls``) and forgetting them (``clear``).

Rows come from ``Engine.objects.entries()``: every object whose label is
``memo:<function>`` (mlxcache_kernel/memo.py), grouped by function.
"""

from __future__ import annotations

import time

from IPython.core.error import UsageError
from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, kwds, magic_arguments

from .base import EngineMagics, parse_args, usage_errors
from .help import examples
from .tables import format_bytes, show_table

__all__ = ["MemoMagics", "memo_rows"]

COLUMNS = ["function", "results", "in_ram", "on_ssd", "ram", "value", "file", "hits", "last_used"]


def memo_rows(entries: list[dict]) -> list[dict]:
    """One row per memoized function (newest use first) from object rows."""
    by_name: dict[str, dict] = {}
    for e in entries:
        label = e.get("label") or ""
        if not label.startswith("memo:"):
            continue
        r = by_name.setdefault(label[5:], {"function": label[5:], "results": 0, "in_ram": 0, "on_ssd": 0,
                                           "ram": 0, "value": 0, "file": 0, "hits": 0, "last_used": 0.0})
        r["results"] += 1
        r["in_ram"] += "ram" in e["tier"]
        r["on_ssd"] += "ssd" in e["tier"]
        for col, k in (("ram", "ram_bytes"), ("value", "kv_bytes"), ("file", "file_bytes")):
            r[col] += e.get(k) or 0
        r["hits"] += e.get("hits") or 0
        r["last_used"] = max(r["last_used"], e.get("last_used") or 0.0)
    return sorted(by_name.values(), key=lambda r: -r["last_used"])


@magics_class
class MemoMagics(EngineMagics):
    """``%memo ls`` and ``%memo clear``."""

    @magic_arguments()
    @kwds(epilog=examples("memo"))
    @argument("action", choices=["ls", "clear"], help="what to do")
    @argument("name", nargs="?", help="clear: the function, as %%memo ls names it")
    @argument("--all", action="store_true", help="clear: every memoized function's results")
    @line_magic
    @usage_errors
    def memo(self, line):
        """Results cached by @memo (``from mlxcache_kernel import memo``).

        %memo ls              memoized functions: results, where they are, bytes, hits
        %memo clear NAME      forget NAME's results, in RAM and on SSD
        %memo clear --all     forget every memoized result
        """
        args = parse_args(self.memo, line)
        eng = self.engine
        rows = memo_rows(eng.objects.entries())
        if args.action == "ls":
            if args.name or args.all:
                raise UsageError("%memo ls takes no name and no --all")
            for r in rows:
                r["last_used"] = time.strftime("%H:%M:%S", time.localtime(r["last_used"])) if r["last_used"] else ""
                for col in ("ram", "value", "file"):
                    r[col] = format_bytes(r[col])
            show_table(rows, COLUMNS, empty="no memoized results (decorate a function: from mlxcache_kernel "
                                            "import memo; @memo)")
            return None
        if bool(args.name) == args.all:
            raise UsageError("%memo clear needs a function name (as %memo ls shows it) or --all")
        known = [r["function"] for r in rows]
        if not args.all and args.name not in known:
            raise UsageError(f"no memoized results of {args.name!r} (memoized functions: {', '.join(known) or 'none'})")
        names = known if args.all else [args.name]
        removed = sum(eng.objects.clear(label="memo:" + n) for n in names)
        which = "every function" if args.all else repr(args.name)
        print(f"forgot {removed} memoized result{'s' if removed != 1 else ''} of {which} (RAM and SSD)")
        return None
