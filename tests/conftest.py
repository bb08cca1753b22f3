import pytest


@pytest.fixture(scope="session")
def default_model_dir():
    """The converted SmolLM2-135M-Instruct (float32) directory; converts it once if absent."""
    from mlxcache_kernel.engine.convert import ensure_default_model

    return ensure_default_model()
