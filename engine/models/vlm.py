"""Vision-language models through mlx-vlm: recognising and loading them, their
identity, and one adapter per image-handling family.

A VLM loads as a `LoadedModel` like a text model. Its `.model` is a
`TextModel`: the language model as the engine's prefill/decode see it (token
ids in, logits out, mlx-lm cache classes), so everything after the prompt is
the text path. Its `.vision` is a `Family` adapter that knows the model's
images: how to cut the processor's pixel batch per image, run the encoder,
merge features into the embeddings and forward a chunk with the model's own
positions and image attention (media/prompt.py drives it).

Families:
- `QwenVL` (qwen2_vl, qwen2_5_vl): multimodal rotary positions (t, h, w);
  images and videos (the same vision tower; a video's grid has t > 1).
  Positions come from the model's own `get_rope_index(ids, grids)` over the
  whole prompt and are passed explicitly to every forward; text after the
  last image continues at `offset + delta`. mlx-vlm's hidden
  `_rope_deltas` / `_position_ids` are never read.
- `Gemma4` (audio): the audio tower and its embedder; positions from the cache
  offset, causal attention over audio (as mlx-vlm runs it), per-layer input
  embeddings from the text ids with media tokens as 0 (as mlx-vlm computes
  them); KV-shared layers have no cache of their own (mlx-vlm's make_cache). Its
  images are not supported yet.
- `Gemma3`: positions from the cache offset; image attention is a policy:
  "bidirectional" (each image's tokens see the whole image, as the model was
  trained; the default) or "causal" (what mlx-vlm's own generate does). The
  policy is part of the model's identity, so the two never share a prefix.

mlx-vlm is imported only here and only when a VLM loads (the `[vision]` extra).
mlx-vlm's own prefix caches (PromptCacheState, APC) are never used: this
engine's cache owns the state.
"""

from __future__ import annotations

import json
from pathlib import Path

import blake3
import mlx.core as mx
import numpy as np

from ..kv.caches import mlx_lm_caches
from ..errors import VisionUnavailable  # noqa: F401 (raised here; defined in errors.py)

MEDIA_REVISION = 1  # of the encoder-output objects and media prefix keys; a change is a miss
SUPPORTED = {"qwen2_vl": "QwenVL", "qwen2_5_vl": "QwenVL", "gemma3": "Gemma3", "gemma4": "Gemma4"}
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.json", "chat_template.jinja")



def is_vlm_config(config: dict) -> bool:
    """A checkpoint with a vision tower (mlx-vlm layout or Hugging Face's)."""
    return isinstance(config.get("vision_config"), dict)


def import_mlx_vlm():
    try:
        import mlx_vlm  # noqa: F401
        from mlx_vlm import load
    except ImportError as e:
        raise VisionUnavailable(
            "this is a vision-language model; loading it needs mlx-vlm: pip install 'mlxcache-kernel[vision]' "
            f"({e})") from None
    return load


def digest(*parts) -> str:
    h = blake3.blake3()
    for p in parts:
        h.update(p if isinstance(p, (bytes, bytearray, memoryview)) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()


def weights_identity(*modules) -> str:
    """BLAKE3 of the encoder's parameters (names, dtypes, shapes, bytes): once per load."""
    from mlx.utils import tree_flatten

    h = blake3.blake3()
    for mod in modules:
        if mod is None:
            continue
        for name, a in sorted(tree_flatten(mod.parameters()), key=lambda kv: kv[0]):
            view = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
            mx.eval(view)
            h.update(f"{name}|{a.dtype}|{tuple(a.shape)}\n".encode())
            h.update(memoryview(np.ascontiguousarray(np.asarray(view))).cast("B"))
    return h.hexdigest()


def processor_identity(path: Path, processor) -> str:
    """The processor's configuration as it takes effect: its files and its resolved settings."""
    files = [f"{n}:{digest((path / n).read_bytes())}" for n in PROCESSOR_FILES if (path / n).is_file()]
    ip = getattr(processor, "image_processor", None)
    settings = json.dumps(ip.to_dict() if hasattr(ip, "to_dict") else {}, sort_keys=True, default=str)
    return digest(type(processor).__name__, type(ip).__name__, settings, *files)


class TextModel:
    """The language model as generate/generation.py sees it: `model(ids, cache=caches)` -> logits.

    `delta` shifts positions (Qwen's rope delta after an image); media/prompt.py binds
    it per request (`forward`). The caches are mlx-lm's classes (the cache
    codecs know them) mirrored from what the mlx-vlm model would make.
    """

    def __init__(self, vlm, family: "Family"):
        self.vlm, self.family = vlm, family
        self.lm = vlm.language_model
        self.layers = self.lm.layers

    def __call__(self, inputs: mx.array, cache=None, delta: int = 0) -> mx.array:
        return self.family.forward(inputs, None, cache, delta=delta)

    def parameters(self):
        return self.vlm.parameters()

    def make_cache(self) -> list:
        return mlx_lm_caches(self.lm.make_cache() if hasattr(self.lm, "make_cache") else None, len(self.layers))


class Family:
    """What differs between VLM families: pixels per image, the encoder, the forward."""

    policies = ("causal",)
    tokenizer_template = False  # render chats with the tokenizer's template, not the processor's

    def __init__(self, vlm, processor, policy: str | None):
        self.vlm, self.processor = vlm, processor
        self.config = vlm.config
        self.policy = policy or self.policies[0]
        if self.policy not in self.policies:
            raise ValueError(f"image_attention for {type(self).__name__} must be one of "
                             f"{', '.join(self.policies)}, got {policy!r}")
        self.embed = vlm.language_model.model.embed_tokens
        self.vocab = int(self.embed.weight.shape[0])  # media key ids start above it (media.key_ids)
        self.embed_scale = 1.0  # of text rows merged with media features (Gemma 4 scales them there)
        text = getattr(self.config, "text_config", None)
        self.context = int(getattr(text, "max_position_embeddings", 0) or 0)  # 0: unknown

    def video_token(self) -> int | None:
        return None  # a family without video

    def audio_token(self) -> int | None:
        return None  # a family without audio

    def encoder_modules(self) -> tuple:
        return (self.vlm.vision_tower,)

    def positions(self, ids: list, grids: list, video_grids: list = ()) -> tuple[mx.array | None, int]:
        """Per-token positions of the whole prompt (None: the cache offset) and the delta after it."""
        return None, 0

    def merge(self, ids: mx.array, rows: list) -> mx.array:
        """Token embeddings of `ids` (1, N) with `rows` [(start, features)] put in place."""
        h = self.embed(ids)[0] if self.embed_scale == 1.0 else self.embed(ids)[0] * self.embed_scale
        if not rows:
            return h[None]
        parts, at = [], 0
        for start, feats in sorted(rows, key=lambda r: r[0]):
            parts += [h[at:start], self.image_rows(feats).astype(h.dtype)]
            at = start + feats.shape[0]
        parts.append(h[at:])
        return mx.concatenate(parts, axis=0)[None]

    def image_rows(self, feats: mx.array) -> mx.array:
        return feats


class QwenVL(Family):
    def image_token(self) -> int:
        return int(self.config.image_token_id)

    def video_token(self) -> int:
        return int(self.config.video_token_id)

    def split(self, batch: dict, count: int, kind: str = "image") -> list[tuple[mx.array, tuple]]:
        """(patches, grid) per image, or per video (kind "video": the processor's video batch)."""
        grids = [tuple(int(x) for x in g) for g in np.asarray(batch[f"{kind}_grid_thw"]).tolist()]
        pixels, out, at = batch["pixel_values" if kind == "image" else f"pixel_values_{kind}s"], [], 0
        for g in grids:
            n = g[0] * g[1] * g[2]
            out.append((pixels[at: at + n], g))
            at += n
        return out

    def split_videos(self, batch: dict) -> list[tuple[mx.array, tuple]]:
        return self.split(batch, 0, "video")

    def encode(self, pixels: mx.array, grid: tuple) -> mx.array:
        dtype = self.vlm.vision_tower.patch_embed.proj.weight.dtype
        return self.vlm.vision_tower(pixels.astype(dtype), mx.array([grid]), output_hidden_states=False)

    def positions(self, ids: list, grids: list, video_grids: list = ()) -> tuple[mx.array | None, int]:
        if not grids and not video_grids:
            return None, 0
        pos, deltas = self.vlm.language_model.get_rope_index(
            mx.array([ids]), mx.array(grids) if grids else None, mx.array(video_grids) if video_grids else None)
        return pos[:, 0, :], int(np.asarray(deltas).reshape(-1)[0])

    def forward(self, ids: mx.array, embeds, caches, *, delta: int = 0, positions=None, spans=()) -> mx.array:
        """positions: (3, N) for this chunk; None: offset + delta onwards (text after the images)."""
        if positions is None:
            start = caches[0].offset + delta
            positions = mx.broadcast_to(mx.arange(start, start + ids.shape[1])[None], (3, ids.shape[1]))
        out = self.vlm.language_model(ids, inputs_embeds=embeds, cache=caches, position_ids=positions[:, None, :])
        return out.logits


class Gemma3(Family):
    policies = ("bidirectional", "causal")

    def image_token(self) -> int:
        return int(self.config.image_token_index)

    def encoder_modules(self) -> tuple:
        return (self.vlm.vision_tower, self.vlm.multi_modal_projector)

    def split(self, batch: dict, count: int) -> list[tuple[mx.array, tuple]]:
        pixels = batch["pixel_values"]
        return [(pixels[i: i + 1], tuple(pixels.shape[1:])) for i in range(pixels.shape[0])]

    def encode(self, pixels: mx.array, grid: tuple) -> mx.array:
        dtype = self.embed.weight.dtype
        hidden, _, _ = self.vlm.vision_tower(pixels.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True)
        return self.vlm.multi_modal_projector(hidden)[0]

    def image_rows(self, feats: mx.array) -> mx.array:
        return feats / (self.config.hidden_size ** 0.5)  # as mlx-vlm merges them; the model rescales all rows

    def forward(self, ids: mx.array, embeds, caches, *, delta: int = 0, positions=None, spans=()) -> mx.array:
        """spans: [(start, end)] absolute positions of image spans this chunk attends bidirectionally."""
        lm = self.vlm.language_model
        if embeds is None:
            return lm(ids, cache=caches).logits
        from mlx_lm.models.base import create_causal_mask

        model, n, offset = lm.model, ids.shape[1], caches[0].offset
        same = None
        if self.policy == "bidirectional" and spans:
            q, k = np.full(n, -1), np.full(offset + n, -2)
            for i, (a, b) in enumerate(spans):
                q[max(a - offset, 0): max(b - offset, 0)] = i
                k[a:b] = i
            same = mx.array(q[:, None] == k[None, :])
        pattern = model.sliding_window_pattern
        masks = {}
        for is_global, window in ((True, None), (False, model.window_size)):
            if same is None:  # as Gemma3Model builds them
                from mlx_vlm.models.base import create_attention_mask

                layer = caches[pattern - 1] if is_global else caches[0]
                masks[is_global] = create_attention_mask(embeds, layer, window_size=window)
            else:  # full width; each attention keeps the keys its cache returns (the last ones)
                masks[is_global] = create_causal_mask(n, offset, window_size=window) | same
        h = embeds * mx.array(model.config.hidden_size ** 0.5, mx.bfloat16).astype(embeds.dtype)
        for i, (layer, c) in enumerate(zip(model.layers, caches)):
            h = layer(h, masks[i % pattern == pattern - 1], c)
        return lm.lm_head(model.norm(h))


class Gemma4(Family):
    tokenizer_template = True  # mlx-vlm's processor re-orders the media parts of a turn

    def __init__(self, vlm, processor, policy: str | None):
        super().__init__(vlm, processor, policy)
        if getattr(vlm, "audio_tower", None) is None:
            raise ValueError("this Gemma 4 checkpoint has no audio tower; only its audio is supported yet")
        self.embed_scale = vlm.language_model.model.embed_scale

    def image_token(self) -> int:
        return int(self.config.image_token_id)

    def audio_token(self) -> int:
        return int(self.config.audio_token_id)

    def encoder_modules(self) -> tuple:
        return (self.vlm.audio_tower, self.vlm.embed_audio)

    def split(self, batch: dict, count: int) -> list:
        from ..generate.sampling import GenerationError

        raise GenerationError("images for Gemma 4 are not supported yet (its audio is)")

    def encode(self, feats: mx.array, grid: tuple) -> mx.array:
        enc, _ = self.vlm.audio_tower(feats, mx.zeros(feats.shape[:2], dtype=mx.bool_))  # no padding
        return self.vlm.embed_audio(enc)[0]

    def forward(self, ids: mx.array, embeds, caches, *, delta: int = 0, positions=None, spans=()) -> mx.array:
        lm = self.vlm.language_model
        if embeds is None:
            return lm(ids, cache=caches).logits
        per_layer = None
        if lm.model.hidden_size_per_layer_input:
            media = (ids == self.image_token()) | (ids == self.audio_token())
            per_layer = lm.model.get_per_layer_inputs(mx.where(media, mx.zeros_like(ids), ids))
        return lm(None, inputs_embeds=embeds, cache=caches, per_layer_inputs=per_layer).logits


FAMILIES = {"QwenVL": QwenVL, "Gemma3": Gemma3, "Gemma4": Gemma4}


def load_vlm(path: Path, config: dict, image_attention: str | None):
    """(TextModel, TokenizerWrapper, Family, identity extras) for the VLM in `path`."""
    load = import_mlx_vlm()
    import mlx_vlm
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"vision-language model type {model_type!r} is not supported yet "
                         f"(supported: {', '.join(sorted(SUPPORTED))})")
    vlm, processor = load(str(path))
    family = FAMILIES[SUPPORTED[model_type]](vlm, processor, image_attention)
    eos = config.get("eos_token_id", getattr(vlm.config, "eos_token_id", None))
    tokenizer = load_tokenizer(path, eos_token_ids=[eos] if isinstance(eos, int) else eos)
    family.encoder_id = weights_identity(*family.encoder_modules())
    family.processor_id = processor_identity(path, processor)
    fe = getattr(processor, "feature_extractor", None)  # its settings: in each recording's identity (media/prompt.py)
    family.audio_processor_id = digest(type(fe).__name__, json.dumps(
        {k: v for k, v in vars(fe).items() if isinstance(v, (int, float, str, bool, list, tuple, type(None)))}
        if fe is not None else {}, sort_keys=True, default=str))
    vp = getattr(processor, "video_processor", None)  # in each video's identity (media/prompt.py)
    family.video_processor_id = digest(type(vp).__name__, json.dumps(
        vp.to_dict() if hasattr(vp, "to_dict") else {}, sort_keys=True, default=str))
    extras = {"vision": {"runtime": f"mlx-vlm {mlx_vlm.__version__}", "processor": family.processor_id,
                         "encoder": family.encoder_id, "image_attention": family.policy,
                         "media_revision": MEDIA_REVISION}}
    return TextModel(vlm, family), tokenizer, family, extras
