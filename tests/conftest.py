import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))  # helpers: support/tiny_model.py, ...

import pytest


@pytest.fixture(scope="session")
def default_model_dir():
    """The converted SmolLM2-135M-Instruct (float32) directory; converts it once if absent."""
    from mlxcache_kernel.engine.models.convert import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random llama model (mlx-lm loadable) for tests that need a model but not good text."""
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def endless_model_dir(tmp_path_factory):
    """A tiny model whose end-of-sequence token never wins under greedy decoding (long runs to interrupt)."""
    from endless_model import build_endless_model

    return build_endless_model(tmp_path_factory.mktemp("models") / "endless")


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory):
    """chat_model(family) -> a tiny model directory of that chat family (tests/support/chat_models.py), built once."""
    from chat_models import build_chat_model

    built: dict = {}

    def get(family: str):
        if family not in built:
            built[family] = build_chat_model(tmp_path_factory.mktemp("chat") / family, family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def spec_prefix(tmp_path_factory):
    """The mlxcache kernelspec installed under a private prefix."""
    from mlxcache_kernel import kernelspec

    prefix = tmp_path_factory.mktemp("prefix")
    kernelspec.install(prefix=str(prefix))
    return prefix
