import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/tiny_model.py

import pytest


@pytest.fixture(scope="session")
def default_model_dir():
    """The converted SmolLM2-135M-Instruct (float32) directory; converts it once if absent."""
    from mlxcache_kernel.engine.convert import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random llama model (mlx-lm loadable) for tests that need a model but not good text."""
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")
