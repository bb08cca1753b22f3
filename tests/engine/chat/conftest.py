import pytest


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory):
    """chat_model(family) -> a tiny model directory of that family (tests/support/chat_models.py), built once."""
    from chat_models import build_chat_model

    built: dict = {}

    def get(family: str):
        if family not in built:
            built[family] = build_chat_model(tmp_path_factory.mktemp("chat") / family, family)
        return built[family]

    return get


@pytest.fixture
def tokenizer_of(chat_model):
    """tokenizer_of(family, template=None) -> the family's mlx-lm tokenizer (with another template if given)."""
    from mlx_lm.tokenizer_utils import load

    def get(family: str, template: str | None = None):
        tok = load(chat_model(family))
        if template is not None:
            tok.chat_template = template
        return tok

    return get
