"""Images and videos in the prompt: their identity, the prompt's cache key, the
encoder outputs as cached objects, and the prefill of a prompt that holds them.
A video (video.py reads and samples it) is one more media item: its span of
video tokens, its identity (the image parts plus its sampled fps and frame
indices, and the video processor's configuration) and its encoder output follow
the image rules below; its positions come from the same `get_rope_index`.
A recording (audio.py reads it; Gemma 4) is the third kind: its log-mel
features take the place of pixels, under the same rules.

- **Image identity** (`MediaItem.identity`): BLAKE3 of the exact preprocessed
  pixel bytes (dtype, shape), the image grid, the processor configuration, the
  encoder's weight identity (hashed once per load) and `MEDIA_REVISION`.
- **Encoder output**: an exact-key object (`Engine.objects`) under
  ("vision-encoder", identity): the same image in another prompt, another
  conversation or after a restart skips the encoder. `_features` is the one
  call site.
- **Prefix identity**: every image token id is the same for every image, so
  the prompt's cache key (`MediaPrompt.keys`) replaces each image span's
  token ids by key ids derived from that image's identity (`key_ids`). The RAM, SSD and remote tiers match prefixes on these
  keys: a follow-up question about the same image shares everything through
  the image (no encoder run, no prefill of its tokens); another image, or the
  same images in another order, diverge at the first image that differs; a
  text-only prefix before the first image is shared with any prompt. The
  image attention policy is in the model's namespace (models/vlm.py).
- **Positions** the model derives from images (Qwen's rope delta) are a
  function of the prompt's token ids and image grids, both pinned by that
  key: they are computed for the whole prompt and passed to every forward,
  so a restored prefix continues exactly where the cold run would.
- **Prefill** never splits an image span across chunks (an image's tokens
  attend to each other under bidirectional attention), and a state cut inside
  a span is never published (`cut`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import blake3
import mlx.core as mx
import numpy as np

from .audio import Recording, load_recording, prepare as prepare_audio
from ..chat.prompts import encodable
from ..generate.sampling import GenerationError
from .video import Clip, load_clip
from ..models.vlm import MEDIA_REVISION, digest

ENCODER_LABEL = "vision encoder"
COUNTERS = ("vision_images", "vision_encoder_runs", "vision_encoder_s", "vision_encoder_reused",
            "vision_images_in_prefix", "vision_videos", "vision_videos_in_prefix", "vision_recordings",
            "vision_recordings_in_prefix")
PLURAL = {"image": "images", "video": "videos", "audio": "recordings"}  # the counters' and stats' words


def new_counters() -> dict:
    return {k: 0.0 if k.endswith("_s") else 0 for k in COUNTERS}


def load_image(item: Any, index: int):
    """A PIL RGB image from a path, a PIL image, or an (H, W[, C]) numpy / mx array."""
    from PIL import Image, UnidentifiedImageError

    where = f"image {index + 1}"
    if isinstance(item, (str, os.PathLike)):
        path = Path(item).expanduser()
        if not path.is_file():
            raise GenerationError(f"{where}: no such image file: {path}")
        try:
            with Image.open(path) as im:
                return im.convert("RGB")
        except (UnidentifiedImageError, OSError) as e:
            raise GenerationError(f"{where}: {path} is not a readable image ({e})") from None
    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if isinstance(item, mx.array):
        item = np.array(item)
    if isinstance(item, np.ndarray):
        a = item
        if a.ndim == 3 and a.shape[-1] == 1:
            a = a[..., 0]
        if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[-1] not in (3, 4)) or 0 in a.shape:
            raise GenerationError(f"{where}: an image array must be (H, W), (H, W, 3) or (H, W, 4), got {a.shape}")
        if a.dtype.kind == "f":
            if not np.isfinite(a).all() or a.min() < 0 or a.max() > 1:
                raise GenerationError(f"{where}: a float image array must hold values in [0, 1]")
            a = np.round(a * 255)
        elif a.dtype.kind not in "ui" or a.min() < 0 or a.max() > 255:
            raise GenerationError(f"{where}: an integer image array must hold values in 0..255")
        return Image.fromarray(np.ascontiguousarray(a.astype(np.uint8))).convert("RGB")
    raise GenerationError(f"{where}: expected a path, a PIL image or an array, got {type(item).__name__}")


@dataclass
class MediaItem:
    identity: str
    pixels: mx.array
    grid: tuple
    kind: str = "image"  # "video", "audio"
    label: str = "image 1"  # for messages: "image 2", "video 1 (clip.mp4)"

    @property
    def object_key(self) -> tuple:
        return ("vision-encoder", self.identity)


@dataclass
class MediaPrompt:
    """One prompt with images: real token ids for the model, key ids for the cache. A generation sees it
    as it sees a text prompt (generate/prefill.py's TextPrompt): forward, prefill, cut, stats."""

    joins_first_step: ClassVar[bool] = False  # image tokens need their features merged in: prefilled apart

    family: Any  # vlm.Family
    ids: list
    keys: list
    spans: list  # [(start, end, item index)] in order
    items: list
    positions: mx.array | None  # (3, len) for Qwen, else None
    delta: int
    objects: Any  # the engine's ObjectCache (None: the cache is off for this request)
    counters: dict
    images: list = field(default_factory=list)  # this turn's PIL images, Clips, Recordings (sessions keep them)
    sources: dict = field(default_factory=dict)  # item index -> where its features came from
    _features: dict = field(default_factory=dict)

    def forward(self, inputs: mx.array, cache=None) -> mx.array:
        """The text forward for decoding after this prompt (positions shifted by its delta)."""
        return self.family.forward(inputs, None, cache, delta=self.delta)

    def cut(self, n: int) -> int:
        """The longest publishable length <= n: not inside an image span."""
        for a, b, _ in self.spans:
            if a < n < b:
                return a
        return n

    def prefill(self, caches: list, start: int, end: int, *, chunk: int,
                progress: Callable[[int, int], None] | None = None) -> None:
        """Forward prompt positions [start, end) in chunks that never split an image span."""
        total, at = end - start, start
        while at < end:
            stop = min(at + chunk, end)
            for a, b, _ in self.spans:
                if a < stop < b:
                    stop = b  # the whole image in one forward
            self._chunk(caches, at, stop)
            mx.eval([c.state for c in caches])
            at = stop
            if progress is not None:
                progress(at - start, total)

    def _chunk(self, caches: list, a: int, b: int) -> None:
        ids = mx.array(self.ids[a:b])[None]
        rows, spans = [], []
        for s, e, i in self.spans:
            if s < b and e > a:
                feats = self._features_of(i)
                rows.append((max(s, a) - a, feats[max(a - s, 0): min(e, b) - s]))
                spans.append((s, e))
        embeds = self.family.merge(ids, rows)
        positions = self.positions[:, a:b] if self.positions is not None else None
        self.family.forward(ids, embeds, caches, positions=positions, spans=spans)

    def _features_of(self, i: int) -> mx.array:
        if i not in self._features:
            self._features[i] = self._features_cached(self.items[i], i)
        return self._features[i]

    def _features_cached(self, item: MediaItem, i: int) -> mx.array:
        """The encoder output of one image: from the object cache, else the encoder (then cached)."""
        import time

        feats, source = self.objects.lookup(item.object_key) if self.objects is not None else (None, None)
        n = sum(e - s for s, e, j in self.spans if j == i)
        if isinstance(feats, mx.array) and feats.shape[0] == n:
            self.counters["vision_encoder_reused"] += 1
            self.sources[i] = source
            return feats
        t0 = time.perf_counter()
        feats = self.family.encode(item.pixels, item.grid)
        if item.kind == "audio" and feats.shape[0] > n:  # past the processor's token cap (Gemma 4: 30 s): its first
            feats = feats[:n]  # n features, as mlx-vlm scatters them
        mx.eval(feats)
        self.counters["vision_encoder_runs"] += 1
        self.counters["vision_encoder_s"] += time.perf_counter() - t0
        if feats.shape[0] != n:
            raise GenerationError(f"{item.label}: the encoder gave {feats.shape[0]} features for {n} {item.kind} tokens")
        if self.objects is not None:
            self.objects.put(item.object_key, feats, label=ENCODER_LABEL)
        self.sources[i] = "encoder"
        return feats

    def stats(self, cached: int, source: str | None) -> dict:
        """Per image and per video, where it came from: "prefix:<tier>" (its KV came with
        the cached prefix), "encoder", or the object tier its encoder output came from."""
        out = {kind: [] for kind in PLURAL}
        for s, e, i in self.spans:
            kind = self.items[i].kind
            if e <= cached:
                out[kind].append(f"prefix:{source}")
                self.counters[f"vision_{PLURAL[kind]}_in_prefix"] += 1
            else:
                out[kind].append(self.sources.get(i, "encoder"))
        stats = {"images": len(out["image"]), "image_sources": out["image"]}
        for kind, words in PLURAL.items():
            self.counters[f"vision_{words}"] += len(out[kind])
            if out[kind] and kind != "image":
                stats.update({words: len(out[kind]), f"{kind}_sources": out[kind]})
        return stats


def key_ids(identity: str, n: int, vocab: int) -> list[int]:
    """The cache key ids of an image's n tokens: from [vocab, 2**31), so never a vocabulary id and
    within int32 (the catalogue and the remote tier hold tokens as int32); each from 32 bits of the
    identity's BLAKE3 stream, so two images' spans share their keys only if all n draws do."""
    words = np.frombuffer(blake3.blake3(identity.encode()).digest(length=4 * n), dtype="<u4")
    return [vocab + int(w) % ((1 << 31) - vocab) for w in words]


def image_spans(ids: list, image_token: int) -> list[tuple[int, int]]:
    """[start, end) of each run of the image token."""
    spans, start = [], None
    for i, t in enumerate(ids + [None]):
        if t == image_token and start is None:
            start = i
        elif t != image_token and start is not None:
            spans.append((start, i))
            start = None
    return spans


def render(family, messages: list) -> str:
    """The conversation as text, through the model's own chat template (its processor's, else its tokenizer's)."""
    processor = family.processor
    use_processor = getattr(processor, "chat_template", None) and not family.tokenizer_template
    target = processor if use_processor else getattr(processor, "tokenizer", None)
    if not getattr(target, "chat_template", None):
        raise GenerationError("this model has no chat template: pass raw=True (--raw) with the model's own "
                              "image placeholders in the prompt")
    return target.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def build_prompt(family, text: str, images: list, *, objects, counters: dict, new_images: list,
                 clips: list = (), recordings: list = ()) -> MediaPrompt:
    """Tokenize `text` with `images`, `clips` and `recordings` through the model's processor; identify every item."""
    processor = family.processor
    tok = getattr(processor, "tokenizer", processor)
    bos = getattr(tok, "bos_token", None)
    extra = {"videos": [c.frames for c in clips]} if clips else {}
    text, audio = prepare_audio(family, text, recordings, objects) if recordings else (text, [])
    try:
        batch = processor(text=[text], images=images or None, add_special_tokens=not (bos and text.startswith(bos)),
                          **extra)
    except (ValueError, TypeError, IndexError) as e:
        raise GenerationError(f"the model's processor refused the prompt and its {len(images)} image(s), "
                              f"{len(clips)} video(s) and {len(recordings)} recording(s): {e}") from None
    ids = [int(t) for t in np.asarray(batch["input_ids"])[0].tolist()]
    entries = []  # (start, end, kind, pixels, grid, identity parts, label)
    for kind, given, token, pieces in (
            ("image", images, family.image_token(), family.split(batch, len(images)) if images else []),
            ("video", clips, family.video_token() if clips else None, family.split_videos(batch) if clips else []),
            ("audio", recordings, family.audio_token() if recordings else None,
             [(f, (f.shape[1],)) for f in audio])):
        found = image_spans(ids, token) if token is not None else []
        if len(found) != len(given):
            raise GenerationError(f"the prompt has {len(found)} {kind} placeholder(s) for {len(given)} {kind}(s)")
        for n, ((pixels, grid), (s, e), x) in enumerate(zip(pieces, found, given)):
            parts = {"image": (), "video": (family.video_processor_id,),
                     "audio": (family.audio_processor_id,)}[kind] + (x.parts if kind != "image" else ())
            label = f"{kind} {n + 1}" + (f" ({x.source})" if kind != "image" else "")
            entries.append((s, e, kind, pixels, grid, parts, label))
    entries.sort(key=lambda t: t[0])
    if entries and entries[-1][1] >= len(ids):
        raise GenerationError(f"the prompt ends inside an {entries[-1][2]}: add text after it")
    check_context(family, ids, entries)
    items, keys = [], list(ids)
    for s, e, kind, pixels, grid, parts, label in entries:
        mx.eval(pixels)
        host = np.asarray(pixels.view(mx.uint16) if pixels.dtype == mx.bfloat16 else pixels)
        identity = digest(MEDIA_REVISION, family.encoder_id, family.processor_id, *parts, str(pixels.dtype),
                          tuple(pixels.shape), grid, memoryview(np.ascontiguousarray(host)).cast("B"))
        items.append(MediaItem(identity, pixels, grid, kind, label))
        keys[s:e] = key_ids(identity, e - s, family.vocab)
    spans = [(s, e, i) for i, (s, e, *_) in enumerate(entries)]
    positions, delta = family.positions(ids, [it.grid for it in items if it.kind == "image"],
                                        [it.grid for it in items if it.kind == "video"])
    return MediaPrompt(family, ids, keys, spans, items, positions, delta, objects, counters, list(new_images))


def check_context(family, ids: list, entries: list) -> None:
    """A prompt longer than the model's context: an error that names each video and its tokens."""
    limit = family.context
    if not limit or len(ids) <= limit:
        return
    videos = [(label, e - s, grid) for s, e, kind, _, grid, _, label in entries if kind == "video"]
    what = "; ".join(f"{label}: {n} tokens for {grid[0]} frame pair(s)" for label, n, grid in videos)
    raise GenerationError(f"the prompt has {len(ids)} tokens, more than the model's context of {limit}"
                          + (f" ({what}): pass fewer frames (max_frames / --max-frames, or a lower fps)"
                             if videos else ""))


def prompt_for(engine, m, text: str, images, *, system: str | None, raw: bool, session: str | None,
               use_cache: bool = True, videos=None, fps: float | None = None,
               max_frames: int | None = None, audios=None) -> MediaPrompt:
    """The MediaPrompt of one `Engine.generate` call on a VLM: the session's earlier turns
    and media, then this turn's images, videos and text (raw: the text as written, with the
    model's image / video placeholders in it). use_cache=False: no encoder outputs from or to the cache."""
    if not isinstance(text, str) or not text.strip():
        raise GenerationError("empty prompt: write the prompt in the cell (or pass a non-empty string)")
    encodable(text, "the prompt")
    encodable(system, "the system prompt")
    if images is not None and not isinstance(images, (list, tuple)):
        images = [images]  # one path, picture or array
    if videos is not None and not isinstance(videos, (list, tuple)):
        videos = [videos]
    if audios is not None and not isinstance(audios, (list, tuple)):
        audios = [audios]
    if audios and m.vision.audio_token() is None:
        raise GenerationError(f"model {m.name!r} ({type(m.vision).__name__}) takes no audio; audio works with Gemma 4")
    if videos and m.vision.video_token() is None:
        raise GenerationError(f"model {m.name!r} ({type(m.vision).__name__}) takes no video; "
                              "video works with Qwen2-VL and Qwen2.5-VL")
    if (fps is not None or max_frames is not None) and not videos:
        raise GenerationError("fps and max_frames apply to videos: pass videos= (--video) with them")
    new = [load_image(x, i) for i, x in enumerate(images or ())]
    clips = [load_clip(x, i, m.vision.processor, fps, max_frames) for i, x in enumerate(videos or ())]
    recs = [load_recording(x, i, m.vision.processor) for i, x in enumerate(audios or ())]
    everything = new + clips + recs
    if raw:
        rendered = text
    else:
        s = engine.sessions.get_or_create(session, system=system, model=m.name) if session is not None else None
        if s is not None:
            messages = s.render_messages(text, system, images=len(new), videos=len(clips), audios=len(recs))
            everything = s.images + everything
        else:
            from ..chat.sessions import user_content

            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": user_content(text, len(new), len(clips), len(recs))}]
        rendered = render(m.vision, messages)
    return build_prompt(m.vision, rendered, [x for x in everything if not isinstance(x, (Clip, Recording))],
                        objects=engine.objects if use_cache else None, counters=engine.vision_counters,
                        new_images=new + clips + recs, clips=[x for x in everything if isinstance(x, Clip)],
                        recordings=[x for x in everything if isinstance(x, Recording)])
