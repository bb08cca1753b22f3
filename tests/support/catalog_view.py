"""What tests read of a cache directory's catalogue from outside the engine (another
process's view): in-flight resume records."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path


def inflight_records(cache_dir: Path) -> list[dict]:
    db = Path(cache_dir) / "checkpoints" / "catalog.db"
    if not db.exists():
        return []
    con = sqlite3.connect(db, timeout=30)
    try:
        return [json.loads(r[0]) for r in con.execute("SELECT record FROM inflight")]
    except sqlite3.OperationalError:  # not created yet
        return []
    finally:
        con.close()
