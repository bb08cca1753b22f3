"""What cannot be placed is refused with one line naming what to do instead, and loses nothing: keys that
cannot move (sliding windows, chunked attention, recurrent layers, quantized KV, rotary codes that are not
one rotation: YaRN's scaling, multi-head latent attention), a passage longer than the window, passages in
forms that are not a list of strings, options that need an exact state, a recompute fraction out of range."""

from __future__ import annotations

import pytest
from tiny_archs import build_arch_model

from mlxcache_kernel.engine import Engine, GenerationError, PassageError

PASSAGES = ["Ships came in from the west before the storm.", "Snow stays on the mountains until June."]
QUESTION = "What came in?"
YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("refusals")


@pytest.mark.parametrize("arch,overrides,why", [
    ("gemma3_text", {}, "sliding-window attention"),
    ("llama4", {}, "chunked attention"),
    ("lfm2", {}, "recurrent layers"),
    ("falcon_h1", {}, "recurrent layers"),
    ("llama", YARN, "does not move keys by a rotation"),
    ("deepseek_v3", {}, "does not move keys by a rotation"),
])
def test_a_model_whose_keys_cannot_move_is_refused_by_name(root, tmp_path, arch, overrides, why):
    path = build_arch_model(arch, root / f"{arch}-{len(overrides)}", **overrides)
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        eng.load_model(str(path), name="m")
        with pytest.raises(PassageError, match=why) as e:
            eng.generate(QUESTION, passages=PASSAGES, max_tokens=4)
        assert "cannot place passages" in str(e.value) and "put them in the prompt instead" in str(e.value)
        assert "\n" not in str(e.value).replace("\\n", "")  # one line
        assert eng.objects.stats()["object_puts"] == 0  # nothing stored for it
        assert eng.generate(QUESTION, max_tokens=4).stats["prompt_tokens"] > 0  # and the engine goes on


def test_quantized_kv_is_refused(root, tmp_path):
    path = build_arch_model("llama", root / "q", head_dim=32)
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        for kv_start in (0, None):  # quantized from the first token, or later: either way not one rotation
            eng.load_model(str(path), name="q", kv_bits=8, kv_group_size=32, kv_start=kv_start)
            with pytest.raises(PassageError, match=r"quantized KV \(kv_bits\)"):
                eng.generate(QUESTION, passages=PASSAGES, max_tokens=4)


def test_a_passage_longer_than_the_window_is_refused_naming_it(root, tmp_path):
    path = build_arch_model("llama", root / "short", max_position_embeddings=64)
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        eng.load_model(str(path), name="m")
        long = "word " * 80
        with pytest.raises(PassageError, match=r"passages\[1\] is \d+ tokens, longer than the model's 64-token window"
                                               r".*split it into shorter passages"):
            eng.generate(QUESTION, passages=[PASSAGES[0], long], max_tokens=4)
        with pytest.raises(GenerationError, match="does not fit the window"):  # each fits, all of them do not
            eng.generate(QUESTION, passages=PASSAGES * 2, max_tokens=4)
        with pytest.raises(PassageError, match="never cut to fit the window"):
            eng.generate(QUESTION, passages=PASSAGES * 2, max_tokens=4, truncate="left")
        assert eng.objects.stats()["object_puts"] == 0  # refused before any work


@pytest.mark.parametrize("passages,message", [
    ("one string", "not one string"),
    ([], "the list is empty"),
    (["fine", 3], r"passages\[1\] is of type int"),
    (["fine", "   "], r"passages\[1\] is empty"),
    (42, "a list of strings, not int"),
])
def test_passages_that_are_not_a_list_of_strings_are_refused(tiny_model_dir, tmp_path, passages, message):
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        eng.load_model(str(tiny_model_dir), name="m")
        with pytest.raises(PassageError, match=message):
            eng.generate(QUESTION, passages=passages, max_tokens=4)


def test_options_that_need_an_exact_state_and_bad_fractions_are_refused(tiny_model_dir, tmp_path):
    with Engine(cache_dir=tmp_path / "c", prefetch_budget_bytes=0) as eng:
        eng.load_model(str(tiny_model_dir), name="m")
        with pytest.raises(PassageError, match="do not go with a session"):
            eng.generate(QUESTION, passages=PASSAGES, session="chat", max_tokens=4)
        with pytest.raises(PassageError, match="do not go with checkpoint_every"):
            eng.generate(QUESTION, passages=PASSAGES, checkpoint_every=2, max_tokens=4)
        with pytest.raises(GenerationError, match="not a vision-language model"):
            eng.generate(QUESTION, images=["x.png"], max_tokens=4)
        with pytest.raises(PassageError, match="do not go with images"):
            eng.generate(QUESTION, passages=PASSAGES, images=["x.png"], max_tokens=4)
        for bad in (-0.1, 1.5, "half", True):
            with pytest.raises(PassageError, match="fraction of placed passage tokens"):
                eng.generate(QUESTION, passages=PASSAGES, recompute=bad, max_tokens=4)
        assert eng.sessions.list() == [] and eng.objects.stats()["object_puts"] == 0
