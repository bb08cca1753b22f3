"""Resident models: loading through mlx-lm, registry by name, artifact identity.

A checkpoint is only valid for the exact weights, config, tokenizer and KV scheme that produced it,
on the same mlx and mlx-lm versions. Those fingerprints form the model identity; its hash is the namespace.
"""

from __future__ import annotations

import blake3
import json
import os
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

from ..chat.preview import Previews
from ..kv.caches import hit_summary, kv_scheme, new_caches, unsupported
from ..kv.quantize_start import QuantizeFrom, check_quantizable
from ..named.names import check_user_name
from ..chat.templates import read_template
from ..host.safe_dirs import make_private_dir, write_json_atomic
from ..errors import ModelError  # noqa: F401 (raised here; defined in errors.py)
from ..generate.window import window_of

WEIGHT_SUFFIXES = (".safetensors", ".npz", ".gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja")


def _hash_file(path: Path, chunk: int = 8 << 20) -> str:
    h = blake3.blake3()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _stat_key(path: Path) -> str:
    st = os.stat(path)
    # "blake3|": digests of another hash (an older build's SHA-256) never match
    return f"blake3|{os.path.realpath(path)}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"


class IdentityMemo:
    """BLAKE3 of weight files memoized on disk by (path, inode, size, mtime, ctime).

    Re-hashing a large model on every load is slow; the stat key changes on
    any rewrite, so a memo hit is as good as hashing again. A missing or
    unwritable memo file only costs the hash.
    """

    def __init__(self, path: Path | None):
        self.path = path
        self._lock = threading.Lock()

    def _load(self) -> dict:
        if self.path is None:
            return {}
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def digest(self, file: Path) -> str:
        key = _stat_key(file)
        with self._lock:
            memo = self._load()
            if key in memo:
                return memo[key]
        digest = _hash_file(file)
        if key != _stat_key(file):  # changed while we read it: do not memoize
            return digest
        with self._lock:
            memo = self._load()
            memo[key] = digest
            self._save(memo)
        return digest

    def _save(self, memo: dict) -> None:
        if self.path is None:
            return
        try:
            make_private_dir(self.path.parent)  # (the cache directory itself)
            write_json_atomic(self.path, memo, durable=False)  # a lost memo only costs a re-hash
        except OSError:
            pass


def _fingerprint_json(obj: Any) -> str:
    return blake3.blake3(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def model_identity(path: Path, memo: IdentityMemo, scheme: str) -> dict:
    weights = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    artifact = blake3.blake3()
    for w in weights:
        artifact.update(f"{w.name}:{memo.digest(w)}\n".encode())
    config = json.loads((path / "config.json").read_text())
    tokenizer = blake3.blake3()
    for name in TOKENIZER_FILES:
        if (path / name).is_file():
            tokenizer.update(f"{name}:{_hash_file(path / name)}\n".encode())
    return {
        "artifact": artifact.hexdigest(),
        "config": _fingerprint_json(config),
        "tokenizer": tokenizer.hexdigest(),
        "kv_scheme": scheme,
        "runtime": _runtime(),  # another backend, or an mlx or mlx-lm upgrade, is a miss
    }


def _runtime() -> str:
    import mlx.core as mx
    import mlx_lm

    return f"mlx {mx.__version__} ({backend()}), mlx-lm {mlx_lm.__version__}"


def backend() -> str:
    """What MLX computes on by default: CPU, Metal or CUDA (their numerics differ)."""
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.cpu:
        return "CPU"
    if mx.metal.is_available():
        return "Metal"
    cuda = getattr(mx, "cuda", None)
    return "CUDA" if cuda is not None and cuda.is_available() else "GPU"


def namespace_of(identity: dict) -> str:
    return _fingerprint_json(identity)[:24]


@dataclass
class LoadedModel:
    name: str
    path: Path
    model: Any
    tokenizer: Any  # mlx-lm TokenizerWrapper
    config: dict
    identity: dict
    namespace: str
    info: dict = field(default_factory=dict)
    kv_bits: int | None = None
    kv_group_size: int = 64
    kv_start: int = 0  # with kv_bits: KV in full precision for the first kv_start tokens
    cache_notice: str | None = None  # why this model runs uncached (an unknown cache class), else None
    vision: Any = None  # a vision-language model's image adapter (vlm.Family), else None

    def new_caches(self) -> list:
        """Empty live caches in this model's KV scheme (full precision until kv_start)."""
        return new_caches(self.model, self.kv_bits if not self.kv_start else None, self.kv_group_size)

    @cached_property
    def forward(self):
        """The model as generations call it: with quantized KV, converting the caches at exactly
        kv_start and attending long forwards over it dequantized (kv/quantize_start.py)."""
        if self.kv_bits is None or self.vision is not None:
            return self.model
        return QuantizeFrom(self.model, self.kv_start, self.kv_bits, self.kv_group_size)

    @property
    def eos_token_ids(self) -> set:
        return set(getattr(self.tokenizer, "eos_token_ids", None) or [self.tokenizer.eos_token_id])

    @property
    def context_window(self) -> int | None:
        """Tokens the model was trained to attend over, if its config says (generate/window.py)."""
        return window_of(self.config)


def resolve_model_path(path_or_id: str | os.PathLike) -> Path:
    """A local model directory, or a hub id fetched (or found in the hub cache)."""
    text = str(path_or_id)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelError(f"model path is not a directory: {path}")
        if not os.access(path, os.R_OK | os.X_OK):
            raise ModelError(f"model directory is not readable: {path}")
        if not (path / "config.json").is_file():
            raise ModelError(f"not a model directory (no config.json): {path}")
        if not any(p.suffix in WEIGHT_SUFFIXES for p in path.iterdir()):
            raise ModelError(f"not a model directory (no weight files): {path}")
        return path.resolve()
    looks_like_hub_id = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise ModelError(f"model path does not exist: {path}")
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            text,
            allow_patterns=["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"],
        )
    except Exception as e:  # offline, unknown repo, ...
        raise ModelError(
            f"model {text!r} is not a local directory and could not be fetched from the hub: {e}"
        ) from None
    return resolve_model_path(local)


KV_BITS, KV_GROUP_SIZES = (None, 4, 8), (32, 64, 128)
KV_START_DEFAULT = 5000  # mlx-lm's --quantized-kv-start default


def check_kv_scheme(kv_bits, kv_group_size, kv_start=None) -> int:
    """Checks the KV quantization options; returns the token KV quantization starts at (kv_start,
    mlx-lm's default with kv_bits, 0 without)."""
    if kv_bits not in KV_BITS:
        raise ModelError(f"kv_bits must be one of 4, 8 or None (float KV), got {kv_bits!r}")
    if kv_group_size not in KV_GROUP_SIZES:
        raise ModelError(f"kv_group_size must be one of {', '.join(map(str, KV_GROUP_SIZES))}, got {kv_group_size!r}")
    if kv_start is None:
        return KV_START_DEFAULT if kv_bits is not None else 0
    if kv_bits is None:
        raise ModelError(f"kv_start={kv_start!r} needs kv_bits (4 or 8): without it the KV stays in full precision")
    if isinstance(kv_start, bool) or not isinstance(kv_start, int) or kv_start < 0:
        raise ModelError(f"kv_start must be a whole number of tokens >= 0, got {kv_start!r}")
    return kv_start


ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")  # mlx-lm's LoRA adapter format


def resolve_adapter_path(adapter_path) -> Path:
    """A local mlx-lm adapter directory (adapter_config.json + adapters.safetensors)."""
    path = Path(str(adapter_path)).expanduser()
    if not path.is_dir():
        raise ModelError(f"adapter path is not a directory: {path}")
    missing = [f for f in ADAPTER_FILES if not (path / f).is_file()]
    if missing:
        raise ModelError(f"not an mlx-lm adapter directory (no {' or '.join(missing)}): {path}")
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"adapter config {path / 'adapter_config.json'} is not readable JSON: {e}") from None
    if not isinstance(config, dict):
        raise ModelError(f"adapter config {path / 'adapter_config.json'} is not a JSON object")
    return path.resolve()


def adapter_identity(path: Path, memo: IdentityMemo) -> dict:
    """The adapter's weights and whole configuration: KV computed under it is its own namespace."""
    config = json.loads((path / "adapter_config.json").read_text())
    return {"weights": memo.digest(path / "adapters.safetensors"), "config": _fingerprint_json(config)}


def load_model(path_or_id, name: str, memo: IdentityMemo, kv_bits: int | None = None,
               kv_group_size: int = 64, adapter_path=None, image_attention: str | None = None,
               kv_start: int | None = None, chat_template=None) -> LoadedModel:
    """adapter_path: an mlx-lm LoRA adapter directory (text models); image_attention: how a
    vision-language model's image tokens attend (vlm.py); None: its default. kv_start: with kv_bits,
    the KV stays in full precision for this many tokens (default mlx-lm's 5000; 0: none).
    chat_template: a template (file or text) used instead of the tokenizer's own (the identity stays)."""
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_adapters

    from .vlm import VisionUnavailable, is_vlm_config, load_vlm

    kv_start = check_kv_scheme(kv_bits, kv_group_size, kv_start)
    path = resolve_model_path(path_or_id)
    adapter = resolve_adapter_path(adapter_path) if adapter_path is not None else None
    config = json.loads((path / "config.json").read_text())
    vision, extras = None, {}
    if not is_vlm_config(config) and image_attention is not None:
        raise ModelError("image_attention applies to vision-language models only")
    if is_vlm_config(config) and kv_start:
        raise ModelError("a delayed KV quantization (kv_start > 0) applies to text models; use kv_start=0 here")
    if is_vlm_config(config) and (adapter is not None or chat_template is not None):
        raise ModelError("adapters in mlx-lm's format and chat_template apply to text models, not to vision-language "
                         "models")
    template = read_template(chat_template) if chat_template is not None else None
    try:
        if is_vlm_config(config):  # mlx-vlm: the model's own processor and chat template
            model, tokenizer, vision, extras = load_vlm(path, config, image_attention)
        else:
            model, tokenizer = mlx_lm.load(str(path))
    except VisionUnavailable as e:
        raise ModelError(str(e)) from None
    except Exception as e:
        raise ModelError(f"could not load a model from {path}: {type(e).__name__}: {e}") from None
    if template is not None:
        tokenizer.chat_template = template
    if adapter is not None:
        try:
            load_adapters(model, str(adapter))  # safetensors and JSON only
            model.eval()
        except Exception as e:
            raise ModelError(f"could not apply the adapter {adapter} to {path}: {type(e).__name__}: {e}") from None
    dtype = str(model.parameters_dtype()) if hasattr(model, "parameters_dtype") else _weight_dtype(model)
    caches = new_caches(model, kv_bits if not kv_start else None, kv_group_size)
    scheme = kv_scheme(caches, dtype.removeprefix("mlx.core."), kv_bits, kv_group_size, kv_start)
    identity = {**model_identity(path, memo, scheme), **extras}
    if adapter is not None:  # base models keep the identity (and the cache) they had
        identity["adapter"] = adapter_identity(adapter, memo)
    unknown = unsupported(caches)
    notice = (f"the prompt cache does not support {', '.join(unknown)}: this model generates uncached"
              if unknown else None)
    info = {
        "path": str(path), "adapter": str(adapter) if adapter is not None else None, "layers": len(caches),
        "kv_scheme": scheme, "kv_start": kv_start if kv_bits is not None else None,
        "parameters_bytes": sum(int(v.nbytes) for _, v in tree_flatten(model.parameters())),
        "cache_notice": notice, "cache_hit": hit_summary(caches),
        "chat_template": None if chat_template is None else "given" if template == chat_template else str(chat_template),
        **({"vision": {"family": type(vision).__name__, "image_attention": vision.policy}} if vision else {}),
    }
    mx.eval(model.parameters())
    if kv_bits is not None and (why := check_quantizable(model, new_caches(model), kv_bits, kv_group_size)):
        raise ModelError(why)
    _warm_up(model, caches)
    return LoadedModel(name, path, model, tokenizer, config, identity, namespace_of(identity), info,
                       kv_bits, kv_group_size, kv_start, notice, vision)


def _warm_up(model, caches: list) -> None:
    """One token through the model, thrown away: the first generation after a load (a restart's first
    rerun, often a prefetched RAM hit) then does not pay the first call's setup (~10 ms of 90 ms)."""
    import mlx.core as mx

    try:
        mx.eval(model(mx.array([[0]]), cache=caches))
    except Exception:  # a model that cannot run one token fails its first generation, with a real error
        pass


def _weight_dtype(model) -> str:
    from mlx.utils import tree_flatten

    return next((str(v.dtype) for _, v in tree_flatten(model.parameters())), "unknown")


class ModelRegistry:
    """The resident models by name (`eng.models`; load through Engine.load_model); the first is the default."""

    def __init__(self, memo: IdentityMemo, emit: Callable[..., object] = lambda *a, **k: None):
        self.memo, self.emit = memo, emit
        self._models: dict[str, LoadedModel] = {}
        self.previews = Previews(lambda ns: getattr(self.by_namespace(ns), "tokenizer", None))
        self.default: str | None = None

    def load(self, path_or_id, name: str | None = None, *, check=None, **kv) -> LoadedModel:
        """check(loaded): may refuse the model (raise) before it replaces one of the same name."""
        name = check_user_name(name or "default", "model name", ModelError)
        loaded = load_model(path_or_id, name, self.memo, **kv)
        if check is not None:
            check(loaded)
        self._models[name] = loaded
        if self.default is None or self.default not in self._models:
            self.default = name
        return loaded

    def get(self, name: str | None = None) -> LoadedModel:
        name = name or self.default
        if name is None:
            raise ModelError("no model is loaded: load one first (Engine.load_model / %model load PATH)")
        if name not in self._models:
            raise ModelError(f"unknown model {name!r}; loaded: {', '.join(sorted(self._models)) or 'none'}")
        return self._models[name]

    def info(self, name: str | None = None) -> dict:
        """Its name, namespace, identity and what loading found (kv scheme, dtype, adapter, draft ...)."""
        m = self.get(name)
        return {"name": m.name, "namespace": m.namespace, "identity": dict(m.identity), **m.info}

    def use(self, name: str) -> LoadedModel:
        loaded = self.get(name)
        self.default = name
        return loaded

    def unload(self, name: str) -> LoadedModel:
        """Forget a model; its cached states stay (for when it loads again)."""
        loaded = self.get(name)
        del self._models[name]
        if self.default == name:
            self.default = next(iter(self._models), None)
        self.emit("model_unloaded", name=name)
        return loaded

    def names(self) -> list[str]:
        return list(self._models)

    def by_namespace(self, ns: str) -> LoadedModel | None:
        return next((m for m in self._models.values() if m.namespace == ns), None)

    def preview(self, ns: str, tokens: tuple, parts_at: int = 0) -> str:
        """A cached prefix as text a person recognizes (chat/preview.py): its start, and with parts_at
        (where it parts from the entries most like it) what it says from there on."""
        return self.previews.of(ns, tokens, parts_at)

    def __contains__(self, name: str) -> bool:
        return name in self._models
