"""Directories inside the cache directory, never followed out of it.

A symbolic link inside the cache (planted, or made by a user who moved part of the
cache to another disk) must never cost a file elsewhere. Each caller names the
directory it anchors at (`root`): the cache directory, which may itself be a link
(the user chose where the cache lives: it is followed), or the directory above one
of the cache's own. Below the root, every directory is opened one component at a
time with O_NOFOLLOW | O_DIRECTORY relative to its parent's descriptor, and every
listing, create, unlink, rename and chmod acts relative to the descriptor of the
directory it is in (dir_fd). A directory swapped for a link between a check and a
use is caught too: the descriptor still names the directory that was opened, and a
later opening of the link fails.

A directory found to be a link (or not a directory) raises LinkedDirectory, an
OSError, so every caller's "the disk said no" path takes it; it is reported once
per process (a warning), listed by `found(root)` (`cache_links` in `%cache stats`)
and not used: nothing in it or behind it is touched. Reads elsewhere may follow
links (what they read is verified); nothing here writes, removes or chmods through one.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
import warnings
from pathlib import Path

from ..cache.faults import fault
from ..errors import LinkedDirectory
from .system import fsync_dir, fsync_file

NOFOLLOW = os.O_NOFOLLOW | os.O_DIRECTORY  # how every directory below a root is opened
_found: dict[str, str] = {}  # path -> why, as of the last look (this process)
_lock = threading.Lock()


def found(root) -> dict[str, str]:
    """The directories under `root` last found to be links (or not directories): path -> why."""
    prefix = os.path.join(os.path.abspath(os.path.expanduser(root)), "")
    with _lock:
        return {p: why for p, why in _found.items() if p.startswith(prefix)}


def _linked(path: str, parent_fd: int, name: str) -> LinkedDirectory:
    """The error for `name` (in `parent_fd`) at `path`, recorded and warned about on first sight."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            why = f"a symbolic link (to {os.readlink(name, dir_fd=parent_fd)})"
        else:
            why = "not a directory"
    except OSError as e:
        why = f"not a directory ({e.strerror})"
    with _lock:
        first = _found.get(path) != why
        _found[path] = why
    error = LinkedDirectory(path, why)
    if first:
        warnings.warn(f"mlxcache: {error}", stacklevel=4)
    return error


def _parts(path, root) -> tuple[str, tuple[str, ...]]:
    root = os.path.abspath(os.path.expanduser(root))
    rel = os.path.relpath(os.path.abspath(os.path.expanduser(path)), root)
    if rel == os.curdir:
        return root, ()
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise ValueError(f"{path} is not inside {root}")
    return root, tuple(Path(rel).parts)


def _open_root(root: str) -> int:
    """The root, followed (it is where the user put the cache); where it cannot be read (a
    parent with search permission only), a path descriptor is enough to open below it (Linux)."""
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except PermissionError:
        if not hasattr(os, "O_PATH"):
            raise
        return os.open(root, os.O_PATH | os.O_DIRECTORY)


def _made(parent_fd: int) -> None:
    """A directory was created in `parent_fd`: make that durable (fault point dir.fsync)."""
    fault("dir.fsync")
    try:
        fsync_file(parent_fd)
    except OSError as e:
        if e.errno != errno.EBADF:  # (a path descriptor of a root we may not read: not ours to sync)
            raise


def _make_root(root: Path) -> None:
    """Create the root and its missing parents, each durable in its parent."""
    created, p = [], root
    while not p.exists() and p != p.parent:
        created.append(p)
        p = p.parent
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    for d in reversed(created):
        fsync_dir(d.parent)


def open_dir(path, root, *, create: bool = False) -> int:
    """A descriptor of directory `path` (inside `root`), each component below `root` opened
    without following links (create: made where missing, 0700, durable in its parent)."""
    root, parts = _parts(path, root)
    if create:
        _make_root(Path(root))
    fd = _open_root(root) if parts else os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    here = root
    try:
        for name in parts:
            here = os.path.join(here, name)
            if create:
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                    _made(fd)
                except FileExistsError:
                    pass
            try:
                child = os.open(name, os.O_RDONLY | NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise _linked(here, fd, name) from None
            os.close(fd)
            fd = child
            if _found:
                with _lock:
                    _found.pop(here, None)
        return fd
    except BaseException:
        os.close(fd)
        raise


class Dir:
    """An open directory inside the cache: what is done in it is done relative to its descriptor.

        with Dir(path, root) as d:
            for name in d.names(): ...
    """

    def __init__(self, path, root, *, create: bool = False):
        self.path = Path(path)
        self.fd = open_dir(path, root, create=create)

    def __enter__(self) -> "Dir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def subdirs(self, wanted=lambda name: True) -> list[str]:
        """The `wanted` entries that are directories; a wanted one that is a link (or not a
        directory) is reported (found, warned once) and left out."""
        out = []
        with os.scandir(self.fd) as entries:
            for entry in entries:
                if not wanted(entry.name):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    out.append(entry.name)
                elif entry.is_symlink():
                    _linked(str(self.path / entry.name), self.fd, entry.name)
        return sorted(out)

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def exists(self, name: str) -> bool:
        try:
            self.lstat(name)
            return True
        except FileNotFoundError:
            return False

    def open(self, name: str, flags: int, mode: int = 0o600) -> int:
        """A file in this directory (never through a link: O_NOFOLLOW)."""
        return os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=self.fd)

    def unlink(self, name: str) -> bool:
        """Remove `name` (a link itself, never its target); False where it could not be."""
        try:
            os.unlink(name, dir_fd=self.fd)
            return True
        except OSError:
            return False

    def replace(self, name: str, dest: "Dir", dest_name: str) -> None:
        os.replace(name, dest_name, src_dir_fd=self.fd, dst_dir_fd=dest.fd)

    def private(self) -> None:
        """0700, ours: another user's directory is refused (PermissionError), even where we could write to it."""
        st = os.fstat(self.fd)
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise PermissionError(f"{self.path} belongs to another user (uid {st.st_uid})")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(self.fd, 0o700)

    def fsync(self, point: str = "dir.fsync") -> None:
        fault(point)
        fsync_file(self.fd)


def make_private_dir(path, root=None) -> Path:
    """Create (or tighten to 0700) directory `path` inside `root`, never through a link: a
    link there raises LinkedDirectory and its target is left as it is. Without `root`, `path`
    is the cache directory itself: followed where it is a link (the user chose where the cache
    lives). Another user's directory is refused (PermissionError): its owner could read the
    prompts we would put there."""
    path = Path(path).expanduser()
    with Dir(path, path if root is None else root, create=True) as d:
        d.private()
    return path


def listdir(path, root) -> list[str]:
    with Dir(path, root) as d:
        return d.names()


def exists(path, root) -> bool:
    """Whether `path` (a file or a directory inside `root`) is there, found without following links."""
    path = Path(path)
    try:
        with Dir(path.parent, root) as d:
            return d.exists(path.name)
    except FileNotFoundError:
        return False


def unlink(path, root) -> bool:
    """Remove the file `path` inside `root` (quietly: False where it is gone or could not be)."""
    return unlink_all([path], root) == 1


def unlink_all(paths, root) -> int:
    """Remove these files inside `root`, each directory opened once; a directory that is a
    link (or gone) keeps its names. Returns how many went."""
    by_dir: dict[Path, list[str]] = {}
    for p in map(Path, paths):
        by_dir.setdefault(p.parent, []).append(p.name)
    removed = 0
    for d, names in by_dir.items():
        try:
            with Dir(d, root) as opened:
                removed += sum(opened.unlink(n) for n in names)
        except OSError:
            pass
    return removed


def replace(src, dst, root) -> None:
    """os.replace(src, dst), both inside `root`, relative to their directories' descriptors."""
    src, dst = Path(src), Path(dst)
    with Dir(src.parent, root) as a:
        if dst.parent == src.parent:
            a.replace(src.name, a, dst.name)
            return
        with Dir(dst.parent, root) as b:
            a.replace(src.name, b, dst.name)


def write_json_atomic(path, obj, *, durable: bool = True, root=None) -> None:
    """Replace `path` with `obj` as JSON (0600): a temp file, fsync, rename, all in `path`'s
    directory (opened from `root`, default: that directory itself, without following links).

    A reader sees the old record or the new one, never half of one.
    """
    path = Path(path)
    tmp = f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    with Dir(path.parent, path.parent if root is None else root) as d:
        fd = d.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(obj, f)
                if durable:
                    f.flush()
                    fsync_file(f.fileno())
            d.replace(tmp, d, path.name)
            if durable:
                d.fsync()
        except BaseException:
            d.unlink(tmp)
            raise
