"""Which filesystems the SSD tier uses: the local ones it knows (system.LOCAL_FILESYSTEMS),
and others only when the user names their type (ssd_filesystems); anything else runs
RAM-only with the reason. Linux: read from a mountinfo written here (the real format)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mlxcache_kernel.engine import Engine
from mlxcache_kernel.engine.host import system

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mountinfo is Linux's")

LOCAL = ["ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "overlay"]
REFUSED = ["nfs4", "cifs", "virtiofs", "fakeowner", "9p", "vboxsf", "prl_fs", "vmhgfs", "fuse", "fuse.mergerfs",
           "fuse.sshfs", "fuseblk", "exfat", "vfat"]


def mountinfo(tmp_path: Path, at: Path, kind: str) -> Path:
    """/ on ext4, and `at` (its name with a space, escaped as the kernel does) on `kind`."""
    path = tmp_path / "mountinfo"
    path.write_text("22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
                    f"40 22 0:51 / {str(at).replace(' ', chr(92) + '040')} rw,relatime - {kind} src rw\n")
    return path


@pytest.mark.parametrize("kind", LOCAL + REFUSED)
def test_only_known_local_filesystems_unless_named(tmp_path, kind):
    at = tmp_path / "a share"
    at.mkdir()  # (a mount point)
    info = str(mountinfo(tmp_path, at, kind))
    why = system.unsupported_filesystem(at / "cache" / "checkpoints", mountinfo=info)  # (not created yet)
    if kind in LOCAL:
        assert why is None
    else:
        assert why is not None and why.startswith(f"{kind} (")
    assert system.unsupported_filesystem(at, ("other", kind), mountinfo=info) is None  # named: used
    assert system.unsupported_filesystem(tmp_path / "elsewhere", mountinfo=info) is None  # the ext4 around it


def test_an_unreadable_type_is_refused_unless_named(tmp_path):
    missing = str(tmp_path / "no-mountinfo")
    assert system.unsupported_filesystem(tmp_path, mountinfo=missing).startswith("unknown (its type could not be")
    assert system.unsupported_filesystem(tmp_path, ("unknown",), mountinfo=missing) is None


def test_a_share_runs_ram_only_with_the_reason_unless_the_user_names_it(tmp_path, monkeypatch):
    cache = tmp_path / "docker desktop"
    cache.mkdir()
    monkeypatch.setattr(system, "MOUNTINFO", str(mountinfo(tmp_path, cache, "virtiofs")))
    with pytest.warns(UserWarning, match="RAM-only"):
        eng = Engine(cache_dir=cache)
    reason = eng.stats()["ssd_disabled_reason"]
    assert "virtiofs (a network or shared filesystem" in reason and "ssd_filesystems" in reason, reason
    assert not (cache / "checkpoints" / "catalog.db").exists()
    eng.close()
    monkeypatch.setenv("MLXCACHE_SSD_FILESYSTEMS", "fuse.mergerfs, virtiofs")
    eng = Engine(cache_dir=cache)
    assert eng.stats()["ssd_disabled_reason"] is None and (cache / "checkpoints" / "catalog.db").exists()
    eng.close()
    monkeypatch.delenv("MLXCACHE_SSD_FILESYSTEMS")
    with pytest.warns(UserWarning, match="RAM-only"):  # the keyword, and a type not named
        eng = Engine(cache_dir=cache, ssd_filesystems="fuse.mergerfs")
    eng.close()
