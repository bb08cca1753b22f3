"""What the engine needs from the machine: private directories, atomic JSON
files, physical memory. Cache files hold people's prompts, so every
directory is 0700 and every file 0600."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path


def make_private_dir(path) -> Path:
    """Create (or tighten) a directory readable by its owner only.

    Another user's directory is refused (PermissionError), even where we
    could write to it: its owner could read the prompts we would put there.
    """
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    owner = os.stat(path).st_uid
    if hasattr(os, "geteuid") and owner != os.geteuid():
        raise PermissionError(f"{path} belongs to another user (uid {owner})")
    os.chmod(path, 0o700)
    return path


def write_json_atomic(path, obj, *, durable: bool = True) -> None:
    """Replace `path` with `obj` as JSON (0600): a temp file, fsync, rename.

    A reader sees the old record or the new one, never half of one.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise


def fsync_dir(path) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path) -> None:
    """Remove a file that may already be gone (a temp file after a failed write)."""
    try:
        os.unlink(path)
    except OSError:
        pass


def physical_memory() -> int | None:
    """Bytes of physical memory, or None where the OS does not say."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None
