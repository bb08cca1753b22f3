"""What the engine needs from the machine: durable fsyncs, the filesystem a directory is
on, physical memory, process tags. Directories and files inside the cache (0700 and 0600:
they hold people's prompts) are safe_dirs.py's."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import psutil

from ..cache.faults import fault

# macOS: fsync stops at the drive's cache; F_FULLFSYNC reaches the medium.
_FULLFSYNC = getattr(__import__("fcntl"), "F_FULLFSYNC", None) if sys.platform == "darwin" else None
# The filesystems the SSD tier uses unless told otherwise: local ones, where fsync reaches the
# disk in order and SQLite's WAL (a shared-memory file mapped by every process) is coherent.
# overlay: a container's own root (its upper layer is a local disk of this host; containers do
# not share it, they share bind mounts, which show the filesystem below). tmpfs: local memory
# (durable until reboot), /tmp or /dev/shm on many machines and CI runners. Not listed, so
# refused unless named in ssd_filesystems: network and cluster filesystems (nfs, cifs, ceph,
# ...), the shares of VMs and Docker Desktop (virtiofs, fakeowner, 9p, vboxsf, prl_fs,
# vmhgfs), any FUSE filesystem (mergerfs, sshfs, ntfs-3g ...), and FAT/exFAT (no journal).
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "bcachefs", "tmpfs", "overlay"})
LOCAL_FILESYSTEMS_DARWIN = frozenset({"apfs", "hfs"})  # and the volume marked local (MNT_LOCAL)
NETWORK_FILESYSTEMS = frozenset({  # (only to word the refusal)
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "afpfs", "webdav", "davfs", "9p", "afs", "coda", "ncpfs", "ceph",
    "glusterfs", "lustre", "gpfs", "ocfs2", "gfs2", "beegfs", "virtiofs", "fakeowner", "vboxsf", "prl_fs",
    "vmhgfs", "fuse.sshfs", "fuse.glusterfs", "fuse.cephfs", "fuse.s3fs", "fuse.rclone", "fuse.gcsfuse",
    "fuse.juicefs", "fuse.davfs2",
})
_tag = os.urandom(6).hex()


def process_tag() -> str:
    """A random name for this process (a new one after fork): temp files carry it,
    so their writer can be told alive or dead in any PID namespace."""
    return _tag


def _new_tag() -> None:
    global _tag
    _tag = os.urandom(6).hex()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_tag)


def fsync_file(fd: int) -> None:
    """Make a file's data durable (on macOS through the drive's cache: F_FULLFSYNC)."""
    if _FULLFSYNC is not None:
        try:
            __import__("fcntl").fcntl(fd, _FULLFSYNC)
            return
        except OSError:  # a filesystem without it: fsync is the best there is
            pass
    os.fsync(fd)


def fsync_dir(path, point: str = "dir.fsync") -> None:
    """Make renames, new files and deletions in `path` durable (`point`: its fault point)."""
    fault(point)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fsync_file(fd)
    finally:
        os.close(fd)


def mount_of(path, partitions=None):
    """The mount holding `path`: of `partitions` (psutil.disk_partitions(all=True) unless
    given, in its shape: device, mountpoint, fstype, opts), the one whose mount point is the
    longest that contains the resolved path; of equal ones the last listed (mounted over the
    others). None where none does or the mount table cannot be read."""
    p = _existing(path)
    try:
        table = psutil.disk_partitions(all=True) if partitions is None else partitions
    except (psutil.Error, OSError):
        return None
    found = None
    for part in table:
        point = part.mountpoint
        if (p == point or p.startswith(point.rstrip("/") + "/")) and (
                found is None or len(point) >= len(found.mountpoint)):
            found = part
    return found


def filesystem_type(path) -> str | None:
    """The type of the filesystem holding `path` ("ext4", "nfs4", "apfs", ...); None where unknown."""
    mount = mount_of(path)
    return mount.fstype if mount is not None else None


def unsupported_filesystem(path, allowed=()) -> str | None:
    """Why the SSD tier must not use the filesystem holding `path` (see refusal), or None
    where it may. Systems other than Linux and macOS: not checked."""
    darwin = sys.platform == "darwin"
    if not (darwin or sys.platform.startswith("linux")):
        return None
    return refusal(mount_of(path), allowed, darwin=darwin)


def refusal(mount, allowed=(), *, darwin: bool = False) -> str | None:
    """Why the SSD tier must not use `mount` (one of psutil.disk_partitions; None: not found),
    the type and what it is, or None where it may: a local filesystem (LOCAL_FILESYSTEMS; on
    macOS LOCAL_FILESYSTEMS_DARWIN on a volume marked local), or one whose type is in
    `allowed` (the user opted in by name; "unknown" where the type cannot be read)."""
    kind = mount.fstype if mount is not None else "unknown"
    if kind in allowed:
        return None
    if darwin and kind in LOCAL_FILESYSTEMS_DARWIN:
        # psutil lists MNT_LOCAL among a macOS mount's options as "local"
        return None if "local" in mount.opts.split(",") else f"{kind} (a volume that is not local)"
    if not darwin and kind in LOCAL_FILESYSTEMS:
        return None
    return f"{kind} ({_what(kind)})"


def _what(kind: str) -> str:
    if kind == "unknown":
        return "its type could not be read"
    if kind in NETWORK_FILESYSTEMS:
        return "a network or shared filesystem: SQLite's WAL is not coherent across it"
    return "not a filesystem the SSD tier knows to be local"


def _existing(path) -> str:
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return os.path.realpath(p)


def physical_memory() -> int | None:
    """Bytes of physical memory, or None where the OS does not say."""
    try:
        return int(psutil.virtual_memory().total)
    except (psutil.Error, OSError):
        return None
