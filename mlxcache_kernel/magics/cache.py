"""``%cache``: what the tiered prompt cache holds (``stats``, ``ls``), why a prompt missed (``why``),
and its upkeep (``flush``, ``clear``, ``gc``, ``verify``); ``config`` and ``help``.

Each action prints lines or shows a table (``tables.py``); bad options end in one UsageError line.
"""

from __future__ import annotations

import time

from IPython.core.error import UsageError
from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, kwds, magic_arguments

from .base import EngineMagics, parse_args, usage_errors
from .help import CHEAT_SHEET, examples
from .tables import ENTRY_COLUMNS, entry_row, fmt_s, format_bytes, setting_lines, show_table, stat_lines

__all__ = ["CacheMagics"]

LS_ROWS = 20  # %cache ls shows this many of the newest entries unless --all


@magics_class
class CacheMagics(EngineMagics):
    """``%cache`` over the Engine."""

    @magic_arguments()
    @kwds(epilog=examples("cache"))
    @argument("action", choices=["stats", "ls", "why", "flush", "clear", "gc", "verify", "config", "help"],
              help="what to do")
    @argument("--all", action="store_true", help="ls: every entry, not only the 20 newest; stats: every counter")
    @argument("--model", "-m", default=None, help="ls: only entries of this model")
    @argument("--session", default=None, help="ls: only entries of this chat session")
    @argument("--ssd", action="store_true", help="clear: also delete the SSD tier's files")
    @argument("--timeout", type=float, default=None, help="flush: seconds to wait at most")
    @argument("--dry-run", action="store_true", help="gc: list what would be removed, remove nothing")
    @argument("--quarantine", action="store_true", help="gc: also remove the quarantined files (kept as evidence)")
    @line_magic
    @usage_errors
    def cache(self, line):
        """The tiered prompt cache.

        %cache stats [--all]    counters by group (RAM, SSD, writes, ...); --all: zeros too
        %cache ls [--all] [--model M] [--session S]   RAM and SSD entries, the 20 newest (--all: every one)
        %cache why              why the last cell reused what it did: the nearest cached prefix, where
                                it and the prompt part, and what differed (template, model, eviction...)
        %cache flush [--timeout S]   wait until every queued write is durable
        %cache clear [--ssd]    drop RAM entries (and with --ssd the SSD files)
        %cache gc [--dry-run] [--quarantine]   remove stale and orphaned files (--quarantine: the evidence too)
        %cache verify           re-hash every SSD file and report bad ones
        %cache config           the settings in effect
        %cache help             the cheat sheet of every magic
        """
        args = parse_args(self.cache, line)
        if (args.model or args.session) and args.action != "ls":
            raise UsageError("--model and --session only apply to %cache ls")
        if args.all and args.action not in ("ls", "stats"):
            raise UsageError("--all only applies to %cache ls and %cache stats")
        if args.ssd and args.action != "clear":
            raise UsageError("--ssd only applies to %cache clear")
        if args.timeout is not None and args.action != "flush":
            raise UsageError("--timeout only applies to %cache flush")
        if (args.dry_run or args.quarantine) and args.action != "gc":
            raise UsageError("--dry-run and --quarantine only apply to %cache gc")
        getattr(self, f"_cache_{args.action}")(args)
        return None

    def _cache_config(self, args) -> None:
        print("\n".join(setting_lines(self.settings.summary())))

    def _cache_stats(self, args) -> None:
        print("\n".join(stat_lines(self.engine.stats(), every=args.all)))

    def _cache_help(self, args) -> None:
        print(CHEAT_SHEET)

    def _cache_ls(self, args) -> None:
        entries = sorted(self.engine.admin.entries(), key=lambda e: -(e.get("last_used") or 0))
        entries = [e for e in entries if (args.model is None or e.get("model") == args.model)
                   and (args.session is None or args.session in (e.get("sessions") or ()))]
        shown = entries if args.all else entries[:LS_ROWS]
        which = " and ".join(f"{k} {v!r}" for k, v in (("model", args.model), ("session", args.session)) if v)
        show_table([entry_row(e) for e in shown], ENTRY_COLUMNS,
                   empty=f"no entries of {which}" if which else "the cache is empty")
        if len(shown) < len(entries):
            print(f"... and {len(entries) - len(shown)} older entries (%cache ls --all lists every one)")
        if entries:
            s = self.engine.stats()
            print(f"RAM holds {format_bytes(s['ram_used_bytes'])} in all (shared: held once, shown in each entry "
                  "using it)" + (f"; SSD {format_bytes(s['ssd_bytes'])} unique (file counts a block in each file "
                                 "naming it)" if s.get("ssd_bytes") is not None else ""))

    def _cache_why(self, args) -> None:
        why = self.engine.admin.why()
        print(str(why) if why is not None else "no cell has generated yet: %cache why explains the last one")

    def _cache_flush(self, args) -> None:
        r = self.engine.flush(timeout=args.timeout)
        failed = r.get("failed") or []
        print(f"flushed: {r.get('committed', 0)} writes committed, {r.get('pending', 0)} pending, "
              f"{len(failed)} failed in {fmt_s(r.get('seconds'))}")
        for f in failed:
            print(f"  failed: {f}")
        if r.get("pending") and r.get("late_reason"):
            print(f"  pending: {r['late_reason']}")

    def _cache_clear(self, args) -> None:
        r = self.engine.admin.clear(ssd=args.ssd)
        print(f"cleared {r['ram_entries']} RAM entries"
              + (f" and {r['ssd_files']} SSD files (named checkpoints kept)" if args.ssd else " (SSD files kept)"))
        if r["kept_not_durable"]:
            print(f"kept {r['kept_not_durable']} entries in RAM: their SSD writes have not succeeded "
                  "(see %cache flush)")

    def _cache_gc(self, args) -> None:
        r = self.engine.admin.gc(dry_run=args.dry_run, quarantine=args.quarantine)
        q, t, verb = r["quarantine_removed"], r["temp_removed"], "would remove" if args.dry_run else "removed"
        print(f"gc{' (dry run)' if args.dry_run else ''}: {verb} {len(q)} quarantined file(s), {len(t)} stale temp "
              f"file(s), {len(r.get('blocks_removed', []))} unreferenced block(s), {len(r.get('files_removed', []))} "
              f"unusable checkpoint file(s), {r['inflight_removed']} resume record(s) without their checkpoint")
        for path in q + t:
            print(f"  {path}")
        if r.get("quarantine_kept"):
            print(f"kept {r['quarantine_kept']} quarantined file(s) as evidence (%cache gc --quarantine removes them)")
        if r["dangling_names"]:
            print(f"named checkpoints whose state is gone (remove with %checkpoint rm): {', '.join(r['dangling_names'])}")

    def _cache_verify(self, args) -> None:
        t0 = time.perf_counter()
        bad = self.engine.admin.verify()
        if not bad:
            s = self.engine.stats()
            print(f"verify: all {s.get('ssd_files', '?')} SSD checkpoints and their {s.get('ssd_blocks', 0)} blocks "
                  f"are intact ({fmt_s(time.perf_counter() - t0)})")
            return
        print(f"verify: {len(bad)} bad file(s) (quarantined) or checkpoint(s) that lost a block (dropped):")
        for b in bad:
            print(f"  {b.get('path')}: {b.get('reason') or b.get('error')}" if isinstance(b, dict) else f"  {b}")
