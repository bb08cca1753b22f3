"""One view of every process's cache on a cache directory (the JupyterLab panel's JSON).

Read from outside the engine, and only read: the catalogue through a read-only
connection (cache/catalog/reading.py), the named-checkpoint records, each
process's report (reports.py), the quarantine folder. Who is alive is judged as
the engine judges it (cache/catalog/liveness.py: pid and start time on this boot, else the
heartbeat). A directory that is missing, another user's, unreadable, or whose
catalogue is damaged or busy is a state with a message (`state` is not "ok"),
never an exception; a busy read carries `retry_s`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..cache.catalog.liveness import Identity, Peers
from ..cache.catalog.reading import CatalogReader, ReadBusy, ReadCorrupt, check_page
from ..cache.objects.naming import NAMESPACE_PREFIX, is_object_namespace
from ..cache.ssd.layout import HEARTBEATS, NAMESPACE_RE, QUARANTINE
from ..kv.tokens import token_key
from ..named.checkpoints import NamedCheckpoints
from .reports import read_reports

OBJECTS = "objects"  # the group of every object namespace (one per object: @memo, image encodings)
BUSY_RETRY_S = 1.0
QUARANTINE_LISTED = 10_000  # files counted in quarantine at most (a huge one is not walked per refresh)


def _uid_name(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


class DirectoryOverview:
    def __init__(self, cache_dir: str | os.PathLike):
        self.cache_dir = Path(cache_dir).expanduser()
        self.root = self.cache_dir / "checkpoints"
        self.reader = CatalogReader(self.root / "catalog.db")
        self.peers = Peers(Identity.current(), "", self.root / HEARTBEATS)  # kept: heartbeats are judged over time

    def snapshot(self, group: str | None = None, **page) -> dict:
        """The whole view; `group` (a namespace or OBJECTS) and `page` (sort, descending,
        query, pinned, limit, offset) choose the page of files (cache/catalog/reading.py)."""
        check_page(page.get("sort", "last_used"), page.get("pinned", "all"))
        if group is not None and group != OBJECTS and not NAMESPACE_RE.fullmatch(group):
            raise ValueError(f"invalid model namespace {group!r}")
        base = {"cache_dir": str(self.cache_dir), "time": time.time(), "message": None, "warnings": []}
        refused = self._refused(base)
        if refused is not None:
            return refused
        names = self._names(NamedCheckpoints.reading(self.cache_dir / "names").list())
        reports = read_reports(self.cache_dir)
        base.update(names=names, ssd=self._files_outside(), reports=len(reports))
        prefix = NAMESPACE_PREFIX if group == OBJECTS else None
        try:
            read = self.reader.snapshot(None if group in (None, OBJECTS) else group, prefix=prefix, **page)
        except FileNotFoundError:
            return {**base, "state": "empty", "processes": self._processes({"processes": [], "activity": {}}, reports),
                    "models": [], "page": None, "message": f"no SSD tier in {self.cache_dir} yet: the first kernel "
                                                           "that generates creates it"}
        except ReadBusy as e:
            return {**base, "state": "busy", "message": str(e), "retry_s": BUSY_RETRY_S}
        except ReadCorrupt as e:
            return {**base, "state": "corrupt", "message": f"{e}: the next kernel to open it keeps it as evidence "
                                                           "and rebuilds the catalogue from the files"}
        except OSError as e:
            return {**base, "state": "unreadable", "message": f"cannot read the catalogue: {e}"}
        processes = self._processes(read, reports)
        live = {p["owner"]: p for p in processes if p["alive"]}
        return {**base, "state": "ok", "schema": read["schema"], "processes": processes,
                "ssd": {**base["ssd"], **self._totals(read, reports)},
                "models": self._models(read["namespaces"], reports, names),
                "page": self._page(read["page"], reports, names, live, group)}

    # --- states ---

    def _refused(self, base: dict) -> dict | None:
        """The directory's state when it cannot (or must not) be read, else None."""
        d = self.cache_dir
        try:
            st = os.stat(d)
        except FileNotFoundError:
            return {**base, "state": "missing", "message": f"{d} does not exist yet: the first kernel that uses "
                                                           "the cache creates it"}
        except OSError as e:
            return {**base, "state": "unreadable", "message": f"cannot look at {d}: {e}"}
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            return {**base, "state": "foreign", "message": f"{d} belongs to another user ({_uid_name(st.st_uid)}): "
                                                           "its prompts are not yours to read"}
        if not os.path.isdir(d) or not os.access(d, os.R_OK | os.X_OK):
            return {**base, "state": "unreadable", "message": f"{d} is not a readable directory"}
        if st.st_mode & 0o077:
            base["warnings"].append(f"{d} is readable by other users (mode {st.st_mode & 0o777:o}); the next "
                                    "kernel makes it 0700")
        try:
            db = os.stat(self.root / "catalog.db")
        except OSError:
            return None
        if hasattr(os, "geteuid") and db.st_uid != os.geteuid():
            return {**base, "state": "foreign", "message": f"the catalogue in {self.root} belongs to another user "
                                                           f"({_uid_name(db.st_uid)})"}
        return None

    # --- parts ---

    def _files_outside(self) -> dict:
        """Quarantine and set-aside catalogues: what the catalogue does not list."""
        count, size = 0, 0
        try:
            with os.scandir(self.root / QUARANTINE) as it:
                for entry in it:
                    if count >= QUARANTINE_LISTED:
                        break
                    if entry.is_file(follow_symlinks=False):
                        count, size = count + 1, size + entry.stat(follow_symlinks=False).st_size
        except OSError:
            pass
        try:
            set_aside = sorted(n for n in os.listdir(self.root) if n.startswith("catalog.db.corrupt."))
        except OSError:
            set_aside = []
        return {"quarantine_files": count, "quarantine_bytes": size, "set_aside_catalogues": set_aside}

    def _processes(self, read: dict, reports: dict) -> list[dict]:
        """Every process the directory knows of: catalogue rows (alive or not yet swept), reports
        of processes without a row (died, or swept), writers of files that are gone."""
        out, activity = {}, read["activity"]
        now = time.time()
        for row in read["processes"]:
            beat = self.root / HEARTBEATS / row["owner"]
            try:
                age = max(0.0, now - os.stat(beat).st_mtime)
            except OSError:
                age = None
            out[row["owner"]] = {"owner": row["owner"], "pid": row["pid"], "host": row["host"],
                                 "started": row["started"], "alive": self.peers.alive(row), "heartbeat_age_s": age,
                                 "pending_writes": row["pending_writes"], "pending_bytes": row["pending_bytes"],
                                 "in_catalogue": True}
        for owner, report in reports.items():
            out.setdefault(owner, {"owner": owner, "pid": report.get("pid"), "host": None, "started": None,
                                   "alive": False, "heartbeat_age_s": None, "in_catalogue": False})
        for owner, act in activity.items():
            out.setdefault(owner, {"owner": owner, "pid": act.get("pid"), "host": act.get("host"), "started": None,
                                   "alive": False, "heartbeat_age_s": None, "in_catalogue": False})
        for owner, p in out.items():
            act = activity.get(owner, {})
            p.update(writing=act.get("writing", 0), reading=act.get("reading", 0),
                     resume_records=act.get("resume_records", 0), files=act.get("files", 0), bytes=act.get("bytes", 0))
            report = reports.get(owner)
            p["report"] = None if report is None else {k: report.get(k) for k in (
                "time", "models", "default_model", "sessions", "ram", "writes", "ssd_budget_bytes", "late_reason",
                "remote")}
        return sorted(out.values(), key=lambda p: (not p["alive"], p.get("started") or 0, p["owner"]))

    @staticmethod
    def _totals(read: dict, reports: dict) -> dict:
        t = read["totals"]
        caps = sorted({r["ssd_budget_bytes"] for r in reports.values() if r.get("ssd_budget_bytes")})
        return {"bytes": t.get("file_bytes", 0) + t.get("block_bytes", 0), "blocks": t.get("blocks", 0),
                "block_bytes": t.get("block_bytes", 0), "files": sum(n["files"] for n in read["namespaces"]),
                "caps": caps}

    @staticmethod
    def _model_names(reports: dict, names: list[dict]) -> dict:
        known: dict = {}
        for r in reports.values():
            for m in r.get("models") or ():
                known.setdefault(m["namespace"], set()).add(m["name"])
        for rec in names:
            if rec.get("model"):
                known.setdefault(rec["namespace"], set()).add(rec["model"])
        return known

    def _models(self, namespaces: list[dict], reports: dict, names: list[dict]) -> list[dict]:
        """One group per model namespace, and one for every object namespace together."""
        known, groups = self._model_names(reports, names), {}
        for n in namespaces:
            group = OBJECTS if is_object_namespace(n["namespace"]) else n["namespace"]
            g = groups.setdefault(group, {"group": group, "kind": "object" if group == OBJECTS else "prefix",
                                          "names": sorted(known.get(group, ())), "files": 0, "tokens": 0, "bytes": 0,
                                          "kv_bytes": 0, "pinned": 0, "last_used": 0.0})
            for k in ("files", "tokens", "bytes", "kv_bytes", "pinned"):
                g[k] += n[k] or 0
            g["last_used"] = max(g["last_used"], n["last_used"] or 0.0)
        return sorted(groups.values(), key=lambda g: (g["kind"] == "object", -g["last_used"]))

    @staticmethod
    def _names(records: list[dict]) -> list[dict]:
        out = []
        for r in records:
            try:
                out.append({"name": r["name"], "namespace": r["namespace"], "key": token_key(r["tokens"]),
                            "tokens": len(r["tokens"]), "model": r.get("model"), "saved": r.get("saved"),
                            "session": (r.get("session") or {}).get("id"), "preview": r.get("preview"),
                            "saved_by": r.get("saved_by")})
            except (KeyError, TypeError, ValueError):
                continue  # a damaged record: skipped, as the engine skips it
        return out

    def _page(self, page: dict, reports: dict, names: list[dict], live: dict, group: str | None) -> dict:
        """The page's files, with what the processes' reports and the names say of each."""
        held: dict = {}  # (namespace, key) -> [(owner, entry)] of live processes' RAM entries
        for owner, report in reports.items():
            if owner in live:
                for e in report.get("entries") or ():
                    held.setdefault((e.get("namespace"), e.get("key")), []).append((owner, e))
        by_key: dict = {}
        for rec in names:
            by_key.setdefault((rec["namespace"], rec["key"]), []).append(rec)
        files = []
        for f in page["files"]:
            k = (f["namespace"], f["key"])
            ram = held.get(k, [])
            recs = by_key.get(k, [])
            writer = f["writer"]
            if writer is not None:
                writer = {**writer, "alive": writer["owner"] in live}
            files.append({**f, "writer": writer, "kind": "object" if is_object_namespace(f["namespace"]) else "prefix",
                          "in_ram": [{"owner": o, "pid": live[o]["pid"], "write_state": e.get("write_state"),
                                      "hits": e.get("hits")} for o, e in ram],
                          "sessions": sorted({s for _, e in ram for s in e.get("sessions") or ()}
                                             | {r["session"] for r in recs if r["session"]}),
                          "names": [{**r, "held_by": self._holder(r, live, ram)} for r in recs],
                          "preview": next((e.get("preview") for _, e in ram if e.get("preview")),
                                          next((r["preview"] for r in recs if r["preview"]), None))})
        return {**page, "group": group, "files": files}

    @staticmethod
    def _holder(record: dict, live: dict, ram: list) -> int | None:
        """The pid of the live kernel whose name this is (None: none; the panel may remove it): the one
        that saved it (not the panel itself), or one holding it in RAM pinned by it (a restore)."""
        by = record.get("saved_by") or {}
        if by.get("owner") in live and not by.get("panel"):
            return live[by["owner"]]["pid"]
        return next((live[o]["pid"] for o, e in ram if record["name"] in (e.get("pinned") or ())), None)
