"""The mutation check (scripts/mutations.py, docs/faults.md) as a test: each defence of the
shared cache directory, removed from a copy of the package, makes at least one test fail.
Marked `mutations` and `slow` (1.5-3 minutes: the fencing, quarantine and contention tests run
once per mutation); `make test-fast` leaves it out, `make test` runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from repo_paths import ROOT


@pytest.mark.mutations
@pytest.mark.slow
def test_every_mutation_is_killed():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "mutations.py")], capture_output=True, text=True,
                       timeout=1200)
    out = json.loads(r.stdout)
    assert out["baseline"]["passed"], out["baseline"]
    survivors = [m["name"] for m in out["mutations"] if not m["killed"]]
    assert not survivors and r.returncode == 0, f"mutations no test noticed: {survivors}"
    assert len(out["mutations"]) >= 8
