"""The window guard (issue 49): a prompt past the model's window, or one leaving no room for
max_tokens, is refused before any work with one line naming both numbers; truncate="left" or
"middle" goes on knowingly, dropping exactly the tokens it says. The same for batch rows,
score() contexts and chat sessions that outgrow the window. And text a tokenizer cannot
encode (a lone surrogate) is one line naming the character and where it is."""

from __future__ import annotations

import json
import shutil

import pytest

from mlxcache_kernel.engine import Engine, GenerationError
from mlxcache_kernel.engine.generate.window import MAX_CHARS_PER_TOKEN, cut, window_of

WINDOW = 256


@pytest.fixture(scope="module")
def small_window_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model (byte-level tokenizer: a character of ASCII is a token) with a window of 256."""
    d = tmp_path_factory.mktemp("models") / "window"
    shutil.copytree(tiny_model_dir, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "max_position_embeddings": WINDOW}))
    return d


@pytest.fixture
def eng(small_window_dir, tmp_path):
    with Engine(cache_dir=tmp_path / "cache", ram_budget_bytes=256 << 20) as e:
        e.load_model(small_window_dir)
        yield e


def nothing_ran(eng) -> bool:
    s = eng.stats()
    return s["engine_generations"] == 0 and s["engine_prefilled_tokens"] == 0 and s["ram_entries"] == 0


def text(n: int) -> str:
    return "".join(chr(97 + i % 26) for i in range(n))


def test_the_window_is_what_the_config_says():
    assert window_of({"max_position_embeddings": 4096}) == 4096
    assert window_of({"n_positions": 1024}) == 1024 and window_of({"n_ctx": 2048}) == 2048
    assert window_of({"text_config": {"max_position_embeddings": 131072}}) == 131072  # a VLM's language model
    yarn = {"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                "original_max_position_embeddings": 32768}}
    assert window_of(yarn) == 131072
    assert window_of({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "max_position_embeddings": 131072}) \
        == 131072  # (llama3 scaling: the config's number is the window already)
    assert window_of({"vocab_size": 10}) is None
    assert cut(list(range(10)), 4, "left") == [6, 7, 8, 9] and cut(list(range(10)), 4, "middle") == [0, 1, 8, 9]
    assert cut("abcdefgh", 3, "middle") == "agh" and cut("abc", 5, "left") == "abc"


def test_a_100k_token_prompt_is_refused_before_any_work(eng):
    with pytest.raises(GenerationError) as e:  # (past 16 characters a token: before it is even tokenized)
        eng.generate(text(100_000), raw=True, max_tokens=4)
    msg = str(e.value)
    assert "\n" not in msg and "100,000 characters" in msg and f"window of {WINDOW} tokens" in msg and "truncate" in msg
    with pytest.raises(GenerationError) as e:  # tokenized, then refused
        eng.generate(text(3000), raw=True, max_tokens=4)
    assert f"prompt of 3,000 tokens + max_tokens 4 does not fit the window of model 'default' ({WINDOW} tokens)" \
        in str(e.value)
    assert nothing_ran(eng)


def test_no_room_for_max_tokens_is_refused_and_says_how_much_fits(eng):
    with pytest.raises(GenerationError, match=rf"200 tokens \+ max_tokens 100 does not fit the window of model "
                                              rf"'default' \({WINDOW} tokens\): lower max_tokens to 56"):
        eng.generate(text(200), raw=True, max_tokens=100)
    with pytest.raises(GenerationError, match="max_tokens 300 leave no room"):
        eng.generate("hi", raw=True, max_tokens=300)
    with pytest.raises(GenerationError, match="truncate must be 'left' or 'middle'"):
        eng.generate("hi", raw=True, max_tokens=4, truncate="right")
    assert nothing_ran(eng)
    r = eng.generate(text(200), raw=True, max_tokens=56)  # exactly fills the window: allowed
    assert len(r.prompt_tokens) == 200 and r.stats["truncated_tokens"] == 0


@pytest.mark.parametrize("how", ["left", "middle"])
def test_truncate_drops_exactly_what_it_says(eng, how):
    prompt = text(1000)
    ids = eng.encode_prompt(prompt, raw=True)
    r = eng.generate(prompt, raw=True, max_tokens=6, truncate=how)
    keep = WINDOW - 6
    want = ids[-keep:] if how == "left" else ids[: keep // 2] + ids[len(ids) - (keep - keep // 2):]
    assert r.prompt_tokens == want and r.stats["truncated_tokens"] == len(ids) - keep
    assert r.stats["prompt_tokens"] == keep
    again = eng.generate_tokens(ids, max_tokens=6, truncate=how)  # generate_tokens takes it too
    assert again.tokens == r.tokens and again.prompt_tokens == want


def test_a_session_that_outgrows_the_window_says_the_oldest_turns_must_go(eng):
    eng.generate(text(150), session="chat", max_tokens=4)
    with pytest.raises(GenerationError) as e:
        eng.generate(text(80), session="chat", max_tokens=4)
    msg = str(e.value)
    assert "session 'chat' has grown to" in msg and "oldest turns must go" in msg and "%session reset chat" in msg
    assert eng.sessions.get("chat").turns == 1  # the refused turn is not recorded
    r = eng.generate(text(80), session="chat", max_tokens=4, truncate="left")
    assert r.stats["truncated_tokens"] > 0 and eng.sessions.get("chat").turns == 2


def test_batch_rows_past_the_window_are_refused_by_index_or_cut(eng):
    with pytest.raises(GenerationError, match=r"^prompt 1: prompt of 300 tokens \+ max_tokens 4 does not fit"):
        eng.generate_batch(["short", text(300), "also short"], raw=True, max_tokens=4)
    assert nothing_ran(eng)
    rows = eng.generate_batch(["short", text(300)], raw=True, max_tokens=4, truncate="left")
    assert rows[1].stats["truncated_tokens"] == 300 - (WINDOW - 4) and len(rows[1].prompt_tokens) == WINDOW - 4
    assert rows[0].stats["truncated_tokens"] == 0


def test_a_score_context_past_the_window_is_refused_or_cut(eng):
    ctx, conts = eng.encode_prompt(text(400), raw=True), [[5, 6, 7], [8, 9]]
    with pytest.raises(GenerationError, match=f"past the model's context window of {WINDOW}.*truncate"):
        eng.score(ctx, conts)
    got = eng.score(ctx, conts, truncate="left")
    want = eng.score(ctx[-(WINDOW + 1 - 3):], conts)  # cut for the longest continuation: 3 tokens, 2 forwarded
    assert [r.logprob for r in got] == [r.logprob for r in want]
    assert got[0].stats["context_tokens"] == WINDOW - 2


def test_a_lone_surrogate_is_one_line_naming_it(eng):
    with pytest.raises(GenerationError) as e:
        eng.generate("first line\nab\ud800cd", max_tokens=4)
    msg = str(e.value)
    assert "U+D800" in msg and "position 13" in msg and "line 2, column 3" in msg and "\n" not in msg
    with pytest.raises(GenerationError, match="the system prompt cannot be encoded: character U\\+DC00"):
        eng.generate("fine", system="\udc00", max_tokens=4)
    with pytest.raises(GenerationError, match="^prompt 1: the prompt cannot be encoded"):
        eng.generate_batch(["fine", "x\ud83d"], max_tokens=4)
    with pytest.raises(GenerationError, match="score: continuation 1 cannot be encoded: character U\\+D83D"):
        eng.score("a context", [" yes", " \ud83d"])
    assert nothing_ran(eng)


def test_text_longer_than_any_prompt_could_hold_is_refused_before_tokenizing(eng):
    """A prompt of more characters than 16 a token of the window: no tokenizer time spent on it."""
    limit = WINDOW * MAX_CHARS_PER_TOKEN
    with pytest.raises(GenerationError, match=f"prompt of {limit + 1:,} characters cannot fit a window of {WINDOW} "
                                              "tokens .*refused before tokenizing"):
        eng.generate("a" * (limit + 1), max_tokens=4)
    with pytest.raises(GenerationError, match="^score: the context of"):
        eng.score("b" * (limit + 1), [" c"])
    assert nothing_ran(eng)
    r = eng.generate("c" * 10 * limit, raw=True, max_tokens=4, truncate="middle")  # cut as characters, then tokens
    assert len(r.prompt_tokens) == WINDOW - 4 and r.stats["truncated_tokens"] == limit - (WINDOW - 4)
