import pytest


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
