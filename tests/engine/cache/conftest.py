"""Fixtures the SSD-tier tests share: a directory of the fault harness's checkpoints, built once per
module (`template`), and a private copy of it for each test (`root`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fault_worker import build_template


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("template") / "c"
    build_template(root)
    return root


@pytest.fixture
def root(template, tmp_path) -> Path:
    shutil.copytree(template, tmp_path / "c")
    return tmp_path / "c"
