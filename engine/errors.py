"""Every exception the engine raises to its callers, in one place (all exported from
`mlxcache_kernel.engine`). Bad input is a ValueError (or TypeError) with a message naming the
problem; storage and server trouble is a miss inside the engine and reaches a caller only from
the tools that ask for it (verification, the panel's reads).

Internal signals stay beside the code that raises and catches them: `kv.cascade.Unroutable`,
`cache.remote.reads.RemoteMiss`, `cache.ssd.writer.WriteCancelled`, `cache.ssd.store.LostClaims`,
`cache.ssd.tensor_read.MissingBlock`.
"""

from __future__ import annotations

import errno
from typing import Any


class ConfigError(ValueError):
    """An option that cannot be used; the message names it (and never shows a secret)."""


class RemoteConfigError(ConfigError):
    """A remote tier setting that cannot be used (a URL: shown redacted; a secret: never shown)."""


class ModelError(ValueError):
    """A model path, name or directory problem, with a message naming it."""


class VisionUnavailable(ImportError):
    """A vision-language model, but mlx-vlm (the `[vision]` extra) is not installed or cannot load it."""


class GenerationError(ValueError):
    """Bad generation input, with a message naming the problem."""


class ConstraintError(GenerationError):
    """A constraint (JSON Schema, Pydantic model, regex, choices, grammar) that cannot be compiled, or a
    model whose tokenizer the grammar library cannot read; the message names the part refused."""


class PassageError(GenerationError):
    """Passages that cannot be placed (generate(..., passages=...)): a model whose position encoding
    cannot move, a passage longer than the window, an option that does not go with them; the message
    names what to do instead."""


class SessionError(ValueError):
    """An unknown session, or one used with another model than its own."""


class ToolError(ValueError):
    """A tool the model cannot be offered (no schema from its signature and docstring), or a tool option
    that cannot be used."""


class CheckpointNameError(ValueError):
    """A checkpoint name that is not allowed, or unknown."""


class UnsupportedCache(TypeError):
    """A cache class no codec knows: the model generates, uncached."""


class Unkeyable(TypeError):
    """A key (or memo argument) that cannot be encoded exactly; `where` says which part."""

    def __init__(self, where: str, what: Any):
        self.where, self.type_name = where, type(what).__qualname__
        super().__init__(f"{where} is of type {self.type_name}, which cannot be part of an exact key")


class Unstorable(TypeError):
    """A value the object cache cannot store exactly."""


class CatalogBusy(Exception):
    """Another process held the catalogue's write lock longer than this caller may wait."""


class CatalogCorrupt(Exception):
    """The database is damaged (SQLITE_CORRUPT, SQLITE_NOTADB or a failed integrity check)."""


class ReadBusy(Exception):
    """The catalogue could not be read within READ_WAIT_S: ask again."""


class ReadCorrupt(Exception):
    """The catalogue is not a database, or a damaged one."""


class CorruptCheckpoint(Exception):
    """The file is not a valid, complete, intact checkpoint."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class NewerFormat(Exception):
    """A format version this build does not know: a newer build's file, left alone."""


class CorruptBlock(Exception):
    """A block that does not hold what its name says: it goes to quarantine."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"block {name[:16]}: {reason}")
        self.name, self.reason = name, f"block {name[:16]}: {reason}"


class UnsupportedFilesystem(OSError):
    """The directory is not on a filesystem known to be local (system.LOCAL_FILESYSTEMS) and the
    user did not name its type: SQLite's WAL needs a local disk."""


class LinkedDirectory(OSError):
    """A directory inside the cache directory is a symbolic link (or not a directory): the cache
    runs without it and touches nothing in it or behind it (host/safe_dirs.py)."""

    def __init__(self, path: str, why: str):
        super().__init__(errno.ELOOP, why, path)
        self.path, self.why = path, why

    def __str__(self) -> str:
        return f"{self.path} is {self.why}: the cache does not use it and touches nothing behind it"


class CheckpointUnavailable(Exception):
    """A checkpoint could not be restored; treat it as a cache miss."""


class RemoteError(Exception):
    """A remote call failed; the message is redacted (no user, no password)."""
