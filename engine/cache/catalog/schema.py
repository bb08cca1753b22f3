"""The catalogue's tables, triggers and indexes, and the migration of older catalogues.

Totals (bytes of files and blocks, pins per file) are kept by triggers, so
the SSD cap and the stats never scan a table. `migrate(db)` runs inside
the opening transaction of a catalogue older than SCHEMA_VERSION.
"""

from __future__ import annotations

import sqlite3

SCHEMA_VERSION = 4

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS files(
    namespace TEXT NOT NULL, key TEXT NOT NULL, path TEXT NOT NULL, length INTEGER NOT NULL,
    tokens BLOB NOT NULL, file_bytes INTEGER NOT NULL, kv_bytes INTEGER NOT NULL,
    min_reusable_offset INTEGER NOT NULL, trimmable INTEGER NOT NULL, format_version INTEGER NOT NULL,
    created REAL NOT NULL, last_used REAL NOT NULL, identity TEXT NOT NULL, block_bytes INTEGER NOT NULL DEFAULT 0,
    pinned INTEGER NOT NULL DEFAULT 0, PRIMARY KEY(namespace, key));
CREATE INDEX IF NOT EXISTS files_unpinned_lru ON files(pinned, last_used);
CREATE TABLE IF NOT EXISTS blocks(name TEXT PRIMARY KEY, bytes INTEGER NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS refs(namespace TEXT NOT NULL, key TEXT NOT NULL, block TEXT NOT NULL,
    PRIMARY KEY(namespace, key, block));
CREATE INDEX IF NOT EXISTS refs_block ON refs(block);
CREATE TABLE IF NOT EXISTS claims(block TEXT NOT NULL, owner TEXT NOT NULL, write_id INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS claims_block ON claims(block);
CREATE INDEX IF NOT EXISTS claims_owner ON claims(owner, write_id);
CREATE TABLE IF NOT EXISTS freeing(name TEXT PRIMARY KEY, owner TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS changes(seq INTEGER PRIMARY KEY AUTOINCREMENT, op TEXT NOT NULL,
    namespace TEXT NOT NULL, key TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS pins(name TEXT PRIMARY KEY, namespace TEXT NOT NULL, key TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS pins_key ON pins(namespace, key);
CREATE TABLE IF NOT EXISTS leases(id INTEGER PRIMARY KEY AUTOINCREMENT, owner TEXT NOT NULL,
    namespace TEXT NOT NULL, key TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS leases_key ON leases(namespace, key);
CREATE TABLE IF NOT EXISTS inflight(request TEXT PRIMARY KEY, record TEXT NOT NULL, time REAL NOT NULL);
CREATE TABLE IF NOT EXISTS procs(owner TEXT PRIMARY KEY, tag TEXT NOT NULL, pid INTEGER NOT NULL,
    host TEXT NOT NULL, boot TEXT NOT NULL, pidns TEXT NOT NULL, start INTEGER, started REAL NOT NULL,
    pending_writes INTEGER NOT NULL DEFAULT 0, pending_bytes INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS totals(k TEXT PRIMARY KEY, v INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS writers(namespace TEXT NOT NULL, key TEXT NOT NULL, owner TEXT NOT NULL,
    pid INTEGER NOT NULL, host TEXT NOT NULL, time REAL NOT NULL, bytes INTEGER NOT NULL, PRIMARY KEY(namespace, key));
CREATE INDEX IF NOT EXISTS files_view ON files(namespace, last_used, key, length, file_bytes, block_bytes, kv_bytes,
    pinned, created);
CREATE INDEX IF NOT EXISTS writers_owner ON writers(owner, pid, host, bytes);
CREATE TRIGGER IF NOT EXISTS files_writer AFTER DELETE ON files BEGIN
    DELETE FROM writers WHERE namespace = OLD.namespace AND key = OLD.key; END;
CREATE TRIGGER IF NOT EXISTS files_in AFTER INSERT ON files BEGIN
    UPDATE totals SET v = v + NEW.file_bytes WHERE k = 'file_bytes'; END;
CREATE TRIGGER IF NOT EXISTS files_out AFTER DELETE ON files BEGIN
    UPDATE totals SET v = v - OLD.file_bytes WHERE k = 'file_bytes'; END;
CREATE TRIGGER IF NOT EXISTS files_size AFTER UPDATE OF file_bytes ON files BEGIN
    UPDATE totals SET v = v - OLD.file_bytes + NEW.file_bytes WHERE k = 'file_bytes'; END;
CREATE TRIGGER IF NOT EXISTS files_pinned AFTER INSERT ON files BEGIN
    UPDATE files SET pinned = (SELECT COUNT(*) FROM pins p WHERE p.namespace = NEW.namespace AND p.key = NEW.key)
    WHERE rowid = NEW.rowid; END;
CREATE TRIGGER IF NOT EXISTS pins_in AFTER INSERT ON pins BEGIN
    UPDATE files SET pinned = pinned + 1 WHERE namespace = NEW.namespace AND key = NEW.key; END;
CREATE TRIGGER IF NOT EXISTS pins_out AFTER DELETE ON pins BEGIN
    UPDATE files SET pinned = pinned - 1 WHERE namespace = OLD.namespace AND key = OLD.key; END;
CREATE TRIGGER IF NOT EXISTS blocks_in AFTER INSERT ON blocks BEGIN
    UPDATE totals SET v = v + 1 WHERE k = 'blocks'; UPDATE totals SET v = v + NEW.bytes WHERE k = 'block_bytes'; END;
CREATE TRIGGER IF NOT EXISTS blocks_out AFTER DELETE ON blocks BEGIN
    UPDATE totals SET v = v - 1 WHERE k = 'blocks'; UPDATE totals SET v = v - OLD.bytes WHERE k = 'block_bytes'; END
"""
# Schema 2 kept pids in its process, claim and lease tables: they go (a build that
# old must not share the directory with this one); inflight rows learn their owner.
# Schema 4 adds `writers` (which process committed each file) and `files_view`, an index that holds
# what the panel reads of every file, so its scans never read the rows' token blobs: nothing goes.
_MIGRATE_2 = """
DROP TABLE IF EXISTS processes; DROP TABLE IF EXISTS pending; DROP TABLE IF EXISTS leases;
DROP TRIGGER IF EXISTS files_in; DROP TRIGGER IF EXISTS files_out; DROP TRIGGER IF EXISTS files_size;
DROP TRIGGER IF EXISTS blocks_in; DROP TRIGGER IF EXISTS blocks_out; DROP INDEX IF EXISTS files_lru
"""
_TOTALS = """
UPDATE files SET pinned = (SELECT COUNT(*) FROM pins p WHERE p.namespace = files.namespace AND p.key = files.key);
INSERT OR REPLACE INTO totals VALUES('file_bytes', (SELECT COALESCE(SUM(file_bytes), 0) FROM files));
INSERT OR REPLACE INTO totals VALUES('blocks', (SELECT COUNT(*) FROM blocks));
INSERT OR REPLACE INTO totals VALUES('block_bytes', (SELECT COALESCE(SUM(bytes), 0) FROM blocks))
"""


def _statements(script: str) -> list[str]:
    out, buf = [], ""
    for part in script.split(";"):  # a trigger's body holds ";": wait for its END
        buf += part + ";"
        if sqlite3.complete_statement(buf):
            out.append(buf.strip())
            buf = ""
    return [s for s in out if s.strip(";").strip()]


def migrate(db: sqlite3.Connection) -> None:
    """Create or bring up to date every table (inside the caller's transaction)."""
    try:
        version = int(db.execute("SELECT v FROM meta WHERE k='schema'").fetchone()[0])
    except (sqlite3.OperationalError, TypeError):
        version = 0
    for statement in _statements((_MIGRATE_2 + ";" if version < 3 else "") + _SCHEMA):
        db.execute(statement)
    have = {r[1] for r in db.execute("PRAGMA table_info(files)")}
    if "block_bytes" not in have:  # a schema 1 catalogue: format 1 files only
        db.execute("ALTER TABLE files ADD COLUMN block_bytes INTEGER NOT NULL DEFAULT 0")
    if "pinned" not in have:
        db.execute("ALTER TABLE files ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0")
    have = {r[1] for r in db.execute("PRAGMA table_info(inflight)")}
    for column in ("owner", "namespace", "key"):
        if column not in have:
            db.execute(f"ALTER TABLE inflight ADD COLUMN {column} TEXT NOT NULL DEFAULT ''")
    for statement in _statements(_TOTALS):
        db.execute(statement)
    db.execute("INSERT OR REPLACE INTO meta VALUES('schema', ?)", (str(SCHEMA_VERSION),))
