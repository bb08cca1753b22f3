"""Which filesystems the SSD tier uses: the local ones it knows (system.LOCAL_FILESYSTEMS; on
macOS apfs and hfs on a volume marked local), and others only when the user names their type
(ssd_filesystems); anything else runs RAM-only with the reason. The mount holding a path is
psutil's (disk_partitions(all=True), the longest mount point holding the resolved path).

Real mounts where they can be made: tmpfs and ramfs mounted by a subprocess in a user and
mount namespace of its own (`unshare -Urm`, Linux; without /proc: test_without_proc.py). The
verdict on types no test machine mounts (nfs4, virtiofs, apfs on a network volume, ...) from
mount tables in psutil's own named tuple."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import psutil
import pytest
from namespaces import in_namespace, needs_namespaces

from mlxcache_kernel.engine.host import system
from mlxcache_kernel.engine.host.system import mount_of, refusal

LOCAL = ["ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "overlay"]
REFUSED = ["nfs4", "cifs", "virtiofs", "fakeowner", "9p", "vboxsf", "prl_fs", "vmhgfs", "fuse", "fuse.mergerfs",
           "fuse.sshfs", "fuseblk", "exfat", "vfat", "ramfs"]
Part = type(psutil.disk_partitions(all=True)[0])  # psutil's named tuple: device, mountpoint, fstype, opts


def table(*mounts: tuple[Path | str, str, str]) -> list:
    """A mount table as psutil answers: / on ext4, then each (mount point, type, options)."""
    return [Part(device="/dev/sda1", mountpoint="/", fstype="ext4", opts="rw,relatime")] + [
        Part(device="src", mountpoint=os.path.realpath(at), fstype=kind, opts=opts) for at, kind, opts in mounts]


@pytest.mark.parametrize("kind", LOCAL + REFUSED)
def test_only_known_local_filesystems_unless_named(tmp_path, kind):
    at = tmp_path / "a share"
    at.mkdir()  # (a mount point)
    mounts = table((at, kind, "rw"))
    why = refusal(mount_of(at / "cache" / "checkpoints", mounts))  # (not created yet)
    if kind in LOCAL:
        assert why is None
    else:
        assert why is not None and why.startswith(f"{kind} ("), why
        assert ("network or shared" in why) == (kind in system.NETWORK_FILESYSTEMS), why
    assert refusal(mount_of(at, mounts), ("other", kind)) is None  # named: used
    assert refusal(mount_of(tmp_path / "elsewhere", mounts)) is None  # the ext4 around it


def test_macos_uses_apfs_and_hfs_on_a_local_volume(tmp_path):
    mounts = table((tmp_path / "ssd", "apfs", "rw,local,dovolfs,journaled"), (tmp_path / "nas", "apfs", "rw,nosuid"),
                   (tmp_path / "share", "smbfs", "rw,nodev"), (tmp_path / "linux", "ext4", "rw,local"))
    for d in ("ssd", "nas", "share", "linux"):
        (tmp_path / d).mkdir()
    assert refusal(mount_of(tmp_path / "ssd" / "cache", mounts), darwin=True) is None
    assert refusal(mount_of(tmp_path / "nas", mounts), darwin=True) == "apfs (a volume that is not local)"
    assert refusal(mount_of(tmp_path / "share", mounts), darwin=True).startswith("smbfs (a network or shared")
    assert refusal(mount_of(tmp_path / "linux", mounts), darwin=True).startswith("ext4 (not a filesystem")
    assert refusal(mount_of(tmp_path / "nas", mounts), ("apfs",), darwin=True) is None  # named: used


def test_the_longest_mount_point_and_the_last_mount_on_it_decide(tmp_path):
    (tmp_path / "a" / "inner").mkdir(parents=True)
    (tmp_path / "ab").mkdir()
    mounts = table((tmp_path / "a", "nfs4", "rw"), (tmp_path / "a" / "inner", "xfs", "rw"),
                   (tmp_path / "a", "virtiofs", "rw"))  # mounted over the nfs4 one
    assert mount_of(tmp_path / "a" / "x", mounts).fstype == "virtiofs"
    assert mount_of(tmp_path / "a" / "inner" / "x", mounts).fstype == "xfs"
    assert mount_of(tmp_path / "ab", mounts).fstype == "ext4", "a/ is not a mount point of ab/"


def test_an_unreadable_type_is_refused_unless_named():
    assert refusal(None).startswith("unknown (its type could not be read)")
    assert refusal(None, ("unknown",)) is None


def test_this_machines_disk_as_findmnt_sees_it(tmp_path):
    if shutil.which("findmnt") is None:
        pytest.skip("findmnt (util-linux) is not here to compare with")
    seen = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", str(tmp_path)], capture_output=True, text=True)
    assert system.filesystem_type(tmp_path) == seen.stdout.strip()


@needs_namespaces
def test_real_mounts_as_psutil_reports_them(tmp_path):
    share, inner, over = tmp_path / "a share", tmp_path / "a share" / "in ner", tmp_path / "over"
    for d in (share, over):
        d.mkdir()
    q = shlex.quote
    got = in_namespace([f"mount -t ramfs none {q(str(share))}", f"mkdir {q(str(inner))}",
                        f"mount -t tmpfs none {q(str(inner))}",
                        f"mount -t tmpfs none {q(str(over))}", f"mount -t ramfs none {q(str(over))}"], f"""
        import json
        from mlxcache_kernel.engine.host import system
        paths = {[str(share / "cache" / "checkpoints"), str(inner / "x"), str(over), str(tmp_path)]!r}
        print(json.dumps([[system.filesystem_type(p), system.unsupported_filesystem(p)] for p in paths]))
    """)
    assert got[0][0] == "ramfs" and got[0][1].startswith("ramfs (not a filesystem the SSD tier knows")
    assert got[1] == ["tmpfs", None]  # the longest mount point, its name with spaces
    assert got[2][0] == "ramfs", "the last mount on a point hides the ones below"
    assert got[3] == [system.filesystem_type(tmp_path), system.unsupported_filesystem(tmp_path)]


@needs_namespaces
def test_a_share_runs_ram_only_with_the_reason_unless_the_user_names_it(tmp_path):
    cache = tmp_path / "docker desktop"
    cache.mkdir()
    got = in_namespace([f"mount -t ramfs none {shlex.quote(str(cache))}"], f"""
        import json, os, warnings
        from pathlib import Path
        from mlxcache_kernel.engine import Engine
        cache, out = Path({str(cache)!r}), []

        def run(**kw):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                eng = Engine(cache_dir=cache, **kw)
            out.append([eng.stats()["ssd_disabled_reason"], (cache / "checkpoints" / "catalog.db").exists(),
                        any("RAM-only" in str(w.message) for w in caught)])
            eng.close()

        run()
        os.environ["MLXCACHE_SSD_FILESYSTEMS"] = "fuse.mergerfs, ramfs"
        run()
        del os.environ["MLXCACHE_SSD_FILESYSTEMS"]
        run(ssd_filesystems="fuse.mergerfs")  # the keyword, and a type not named
        print(json.dumps(out))
    """)
    (reason, made, warned), named, other = got
    assert "ramfs (not a filesystem the SSD tier knows" in reason and "ssd_filesystems" in reason, reason
    assert warned and not made
    assert named == [None, True, False]
    assert other[0] is not None and other[2]
