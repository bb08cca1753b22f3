"""Mutation check of the cache's defences (issue 27): each mutation removes one defence
from a temporary copy of the package; the test files that guard it then run against the
copy (workers too: tests/support/paused.py keeps PYTHONPATH first) and must fail.

    .venv/bin/python scripts/mutations.py [--only NAME] [--no-baseline]

Prints JSON: per mutation, whether it was killed (>= 1 test failed) and which tests
failed; first a baseline (the same files on the unmutated copy must pass, so a failure
is the mutation's). Exit status 0 when every mutation was killed. Last result:
docs/faults.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MUTATIONS = [
    {"name": "commit without its in-transaction re-check of claims",
     "file": "engine/cache/ssd/store.py",
     "old": "if write_id is not None and not self.catalog.claims_held(db, write_id, blocks):",
     "new": "if False:",
     "tests": ["tests/engine/cache/test_fencing.py"]},
    {"name": "quarantine without the confirming second read",
     "file": "engine/cache/ssd/upkeep.py",
     "old": "verdict = blocks.intact(path, name)",
     "new": "verdict = blocks.CORRUPT",
     "tests": ["tests/engine/cache/test_quarantine.py"]},
    {"name": "freeing that ignores leases",
     "file": "engine/cache/catalog/tables.py",
     "old": "AND NOT EXISTS (SELECT 1 FROM claims WHERE block=?) RETURNING bytes",
     "new": "AND NOT EXISTS (SELECT 1 FROM claims WHERE block=? AND write_id > 0) RETURNING bytes",
     "tests": ["tests/engine/cache/test_contention.py"]},
    {"name": "post-commit work without the fence",
     "file": "engine/cache/catalog/tables.py",
     "old": 'return {n for n in names if db.execute("SELECT 1 FROM freeing f',
     "new": 'return set(names) or {n for n in names if db.execute("SELECT 1 FROM freeing f',
     "tests": ["tests/engine/cache/test_fencing.py"]},
    {"name": "an I/O error on the confirming read taken for corruption",
     "file": "engine/cache/ssd/blocks.py",
     "old": "    except OSError:\n        return UNREADABLE",
     "new": "    except OSError:\n        return CORRUPT",
     "tests": ["tests/engine/cache/test_quarantine.py"]},
    {"name": "own freeing marks left behind when unfree fails",
     "file": "engine/cache/ssd/removal.py",
     "old": "        store.catalog.later(retry)",
     "new": "        raise",
     "tests": ["tests/engine/cache/test_fencing.py"]},
    {"name": "directories inside the cache opened through symbolic links",
     "file": "engine/host/safe_dirs.py",
     "old": "NOFOLLOW = os.O_NOFOLLOW | os.O_DIRECTORY",
     "new": "NOFOLLOW = os.O_DIRECTORY",
     "tests": ["tests/engine/cache/test_links.py"]},
    {"name": "a sweep that unlinks by path, not in the directory it listed",
     "file": "engine/cache/ssd/upkeep.py",
     "old": "                    d.unlink(name)\n",
     "new": "                    os.unlink(d.path / name)\n",
     "tests": ["tests/engine/cache/test_links.py"]},
]


def copy_package(dest: Path) -> Path:
    """The package as the editable install maps it (mlxcache_kernel/, engine/ as .engine,
    widgets/ as .widgets), under dest/pkg: put that first on PYTHONPATH."""
    pkg = dest / "pkg" / "mlxcache_kernel"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "labextension", "node_modules")
    shutil.copytree(ROOT / "mlxcache_kernel", pkg, ignore=ignore)
    shutil.copytree(ROOT / "engine", pkg / "engine", ignore=ignore)
    shutil.copytree(ROOT / "widgets", pkg / "widgets", ignore=ignore)
    return dest / "pkg"


def run_tests(pkg: Path, tests: list[str]) -> tuple[bool, list[str], float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(pkg), os.environ.get("PYTHONPATH")) if p),
           "PYTHONDONTWRITEBYTECODE": "1"}
    probe = subprocess.run([sys.executable, "-c", "import mlxcache_kernel.engine.cache.ssd.store as m; "
                            "print(m.__file__)"], env=env, capture_output=True, text=True, cwd=pkg)
    if not probe.stdout.strip().startswith(str(pkg)):
        raise SystemExit(f"the copy is not what gets imported: {probe.stdout or probe.stderr}")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", f"--rootdir={ROOT}",
                        *(str(ROOT / t) for t in tests)], env=env, capture_output=True, text=True,
                       cwd=pkg)  # not ROOT: its mlxcache_kernel/ would come first on sys.path
    failed = [os.path.relpath(pkg / f, ROOT) for f in re.findall(r"^FAILED (\S+)", r.stdout, re.M)]
    return r.returncode == 0, failed, round(time.monotonic() - t0, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="run the mutations whose name contains this")
    ap.add_argument("--no-baseline", action="store_true")
    args = ap.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or args.only in m["name"]]
    out: dict = {"mutations": []}
    with tempfile.TemporaryDirectory(prefix="mlxcache-mutations-") as tmp:
        pkg = copy_package(Path(tmp))
        if not args.no_baseline:
            files = sorted({t for m in chosen for t in m["tests"]})
            passed, failed, seconds = run_tests(pkg, files)
            out["baseline"] = {"tests": files, "passed": passed, "failed": failed, "seconds": seconds}
            if not passed:
                print(json.dumps(out, indent=1))
                return 2
        for m in chosen:
            inside = m["file"] if m["file"].startswith("mlxcache_kernel/") else "mlxcache_kernel/" + m["file"]
            target = pkg / inside
            original = target.read_text()
            if original.count(m["old"]) != 1:
                raise SystemExit(f"{m['name']}: the code to mutate is not found once in {m['file']}")
            target.write_text(original.replace(m["old"], m["new"]))
            try:
                passed, failed, seconds = run_tests(pkg, m["tests"])
            finally:
                target.write_text(original)
            out["mutations"].append({"name": m["name"], "file": m["file"], "tests": m["tests"], "killed": not passed,
                                     "failed": failed, "seconds": seconds})
    out["all_killed"] = all(m["killed"] for m in out["mutations"])
    print(json.dumps(out, indent=1))
    return 0 if out["all_killed"] else 1


if __name__ == "__main__":
    sys.exit(main())
