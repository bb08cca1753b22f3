"""Tiny random-weight vision-language models that mlx-vlm loads, for tests.

``build_vlm(arch, path)`` writes a model directory for ``arch``: config.json,
model.safetensors (the parameters of mlx-vlm's own ``Model`` class), a
byte-level tokenizer with the architecture's special tokens, the processor
configuration and a chat template that places images. Two architectures with
different image handling:

- ``qwen2_vl``: image tokens take multimodal rotary positions (t, h, w), so
  text after an image continues at ``offset + rope_delta``; the number of
  image tokens follows the image's size (patch grid); videos too (``make_clip``,
  ``write_mp4``). ``qwen2_5_vl``: the same text side with Qwen2.5-VL's windowed
  vision tower.
- ``gemma3``: a fixed number of image tokens per image, positions from the
  cache offset alone, bidirectional attention inside an image span (or causal,
  as mlx-vlm's own generate runs it), a sliding-window layer beside a global one.

Weights ~0.08 normal (Gemma 3 collapses to one token from ~0.2); the config's
vocab equals ``len(tokenizer)`` exactly (a padded vocab samples an id the
detokenizer cannot map).
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny_model import save_byte_level_tokenizer

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                  "<end_of_image>", "<image_soft_token>"]

# Newlines as {{ '\n' }}: a literal newline inside a JSON-held Jinja template is easy to lose.
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}{{ '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}{{ '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<start_of_image>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model{{ '\\n' }}{% endif %}"
)

GEMMA4_SPECIALS = GEMMA_SPECIALS + ["<start_of_audio>", "<end_of_audio>", "<audio_soft_token>"]
GEMMA4_TEMPLATE = GEMMA_TEMPLATE.replace(
    "{% if c['type'] == 'image' %}<start_of_image>",
    "{% if c['type'] == 'image' %}<image_soft_token>{% elif c['type'] == 'audio' %}<audio_soft_token>")

GEMMA_IMAGE_TOKENS = 16  # tokens per image (mm_tokens_per_image)
GEMMA_WINDOW = 2048  # sliding window of the local layer (build_vlm(window=32) makes one that wraps)
IMAGE_SIZE = 56  # Gemma's processor resizes every image to 56x56 (4x4 patches of 14 -> 16 tokens)
SCALES = {"qwen2_vl": 0.3, "qwen2_5_vl": 0.3, "gemma3": 0.08, "gemma4": 0.08}  # weight spread at which greedy decoding moves between tokens


def _tokenizer(path: Path, specials: list[str], config: dict, template: str) -> dict:
    """A byte-level BPE tokenizer with `specials` first; returns {special: id}."""
    vocab = save_byte_level_tokenizer(path, specials)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 32768, "chat_template": template,
        **config}))
    (path / "chat_template.jinja").write_text(template)
    return {s: i for i, s in enumerate(specials)} | {"__len__": vocab}


def _qwen2_vl(path: Path, window: int | None = None) -> dict:
    ids = _tokenizer(path, QWEN_SPECIALS, {"bos_token": None, "eos_token": "<|im_end|>",
                                           "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>"},
                     QWEN_TEMPLATE)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
        "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
        "min_pixels": 28 * 28, "max_pixels": 112 * 112,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "rescale_factor": 1 / 255, "resample": 3}))
    vocab = ids["__len__"]
    return {
        "model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"],
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": vocab, "rope_theta": 10000.0,
        "max_position_embeddings": 32768, "tie_word_embeddings": True,
        # 64 / 4 heads = head_dim 16: the (t, h, w) sections of its 8 frequencies
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids["<|im_end|>"], "bos_token_id": None, "torch_dtype": "float32",
        "vision_config": {"model_type": "qwen2_vl", "depth": 2, "embed_dim": 32, "hidden_size": 64,
                          "num_heads": 4, "mlp_ratio": 2, "patch_size": 14, "spatial_patch_size": 14,
                          "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3},
    }


def _qwen2_5_vl(path: Path, window: int | None = None) -> dict:
    """Qwen2.5-VL: Qwen2-VL's text model and processor; a windowed vision tower with a merger to out_hidden_size."""
    config = _qwen2_vl(path)
    pre = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps({**pre, "processor_class": "Qwen2_5_VLProcessor"}))
    return {**config, "model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "vision_config": {"model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 64,
                              "out_hidden_size": 64, "num_heads": 4, "patch_size": 14, "spatial_patch_size": 14,
                              "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                              "fullatt_block_indexes": [1], "tokens_per_second": 2, "in_channels": 3}}


def _gemma3(path: Path, window: int = GEMMA_WINDOW) -> dict:
    ids = _tokenizer(path, GEMMA_SPECIALS, {
        "bos_token": "<bos>", "eos_token": "<end_of_turn>", "pad_token": "<pad>", "unk_token": "<pad>",
        "extra_special_tokens": {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                                 "eoi_token": "<end_of_image>"}}, GEMMA_TEMPLATE)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "do_resize": True, "do_rescale": True, "do_normalize": True,
        "do_convert_rgb": True, "rescale_factor": 1 / 255, "resample": 2, "do_pan_and_scan": False}))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma3Processor",
                                                            "image_seq_length": GEMMA_IMAGE_TOKENS}))
    vocab = ids["__len__"]
    text = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": vocab,
            "query_pre_attn_scalar": 16, "sliding_window": window, "sliding_window_pattern": 2,
            "mm_tokens_per_image": GEMMA_IMAGE_TOKENS, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6}
    return {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "hidden_size": 64,
        "vocab_size": vocab, "image_token_index": ids["<image_soft_token>"], "pad_token_id": ids["<pad>"],
        "boi_token_index": ids["<start_of_image>"], "eoi_token_index": ids["<end_of_image>"],
        "eos_token_id": [ids["<end_of_turn>"], ids["<eos>"]], "mm_tokens_per_image": GEMMA_IMAGE_TOKENS,
        "torch_dtype": "float32", "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 2, "hidden_size": 32,
                          "intermediate_size": 64, "num_attention_heads": 2, "patch_size": 14,
                          "image_size": IMAGE_SIZE},
    }


def _gemma4(path: Path, window: int = GEMMA_WINDOW) -> dict:
    """Gemma 4 with an audio tower (a conformer), per-layer input embeddings and, as in E2B/E4B, KV-shared
    layers (the last two of four reuse the first two's KV: two caches); the processor's numpy audio feature
    extractor (USM log-mel, 40 ms per audio token)."""
    ids = _tokenizer(path, GEMMA4_SPECIALS, {
        "bos_token": "<bos>", "eos_token": "<end_of_turn>", "pad_token": "<pad>", "unk_token": "<pad>",
        "extra_special_tokens": {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                                 "eoi_token": "<end_of_image>", "audio_token": "<audio_soft_token>",
                                 "boa_token": "<start_of_audio>", "eoa_token": "<end_of_audio>"}}, GEMMA4_TEMPLATE)
    (path / "processor_config.json").write_text(json.dumps({
        "processor_class": "Gemma4Processor", "audio_seq_length": 750, "audio_ms_per_token": 40,
        "image_processor": {"patch_size": 16, "max_soft_tokens": GEMMA_IMAGE_TOKENS, "pooling_kernel_size": 3}}))
    vocab = ids["__len__"]
    text = {"model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
            "num_attention_heads": 4, "head_dim": 16, "global_head_dim": 16, "num_key_value_heads": 2,
            "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 8, "vocab_size": vocab,
            "vocab_size_per_layer_input": vocab, "sliding_window": window, "sliding_window_pattern": 2,
            "layer_types": ["sliding_attention", "full_attention"] * 2, "use_double_wide_mlp": False,
            "max_position_embeddings": 32768}
    return {
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "hidden_size": 64,
        "vocab_size": vocab, "image_token_id": ids["<image_soft_token>"], "audio_token_id": ids["<audio_soft_token>"],
        "boi_token_id": ids["<start_of_image>"], "eoi_token_id": ids["<end_of_image>"],
        "boa_token_id": ids["<start_of_audio>"], "eoa_token_id": ids["<end_of_audio>"], "pad_token_id": ids["<pad>"],
        "eos_token_id": [ids["<end_of_turn>"], ids["<eos>"]], "torch_dtype": "float32", "text_config": text,
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
                          "global_head_dim": 16, "patch_size": 16, "position_embedding_size": 1024,
                          "pooling_kernel_size": 3},
        "audio_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                         "subsampling_conv_channels": [8, 4], "output_proj_dims": 32},
    }


BUILDERS = {"qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_5_vl, "gemma3": _gemma3, "gemma4": _gemma4}


def build_vlm(arch: str, path: Path, *, seed: int = 0, scale: float | None = None, window: int | None = None,
              context: int | None = None) -> Path:
    """A loadable model directory of `arch` (see BUILDERS) with seeded random weights.
    window: Gemma 3's sliding window (default GEMMA_WINDOW, wider than the tests' prompts);
    context: Qwen2-VL's max_position_embeddings (default 32768)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, load_config, update_module_configs

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    scale = SCALES[arch] if scale is None else scale
    config = BUILDERS[arch](path) if window is None else BUILDERS[arch](path, window)
    if context is not None:
        config["max_position_embeddings"] = context
    (path / "config.json").write_text(json.dumps(config, indent=1))
    config = load_config(path)  # as mlx_vlm.load reads it
    module, _ = get_model_and_args(config)
    config.setdefault("text_config", {})
    config.setdefault("vision_config", {})
    towers = ["text", "vision"] + (["audio"] if "audio_config" in config else [])
    model_config = update_module_configs(module.ModelConfig.from_dict(config), module, config, towers)
    mx.random.seed(seed)  # before construction: some biases are random
    model = module.Model(model_config)
    weights = {}
    for i, (k, v) in enumerate(tree_flatten(model.parameters())):
        key = mx.random.key(seed * 1000 + i)
        weights[k] = (mx.random.normal(v.shape, key=key) * scale).astype(mx.float32) if v.ndim >= 2 else \
            (v + mx.random.normal(v.shape, key=key) * scale * 0.1).astype(mx.float32)
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


def make_image(seed: int, size: tuple[int, int] = (IMAGE_SIZE, IMAGE_SIZE)):
    """A deterministic RGB test picture (PIL) of `size` (width, height)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def make_clip(seed: int, frames: int = 8, size: tuple[int, int] = (IMAGE_SIZE, IMAGE_SIZE)):
    """A deterministic (T, C, H, W) uint8 test clip: a random first frame drifting a few pixels per frame
    (neighbouring frames alike, as in a real video)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (size[1] + frames, size[0] + frames, 3), dtype=np.uint8)
    return np.stack([base[t: t + size[1], t: t + size[0]].transpose(2, 0, 1) for t in range(frames)])


def write_mp4(path: Path, clip, fps: float = 4.0) -> Path:
    """`clip` (T, C, H, W) as an MPEG-4 file OpenCV (mlx-vlm's reader) decodes."""
    import cv2

    t, _, h, w = clip.shape
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
    assert writer.isOpened(), "OpenCV cannot write mp4v"
    for frame in clip:
        writer.write(cv2.cvtColor(frame.transpose(1, 2, 0), cv2.COLOR_RGB2BGR))
    writer.release()
    return Path(path)


def write_wav(path: Path, seed: int, seconds: float = 1.0, rate: int = 16000) -> Path:
    """A deterministic 16-bit mono WAV: a few random tones and noise (mlx-vlm's reader decodes it)."""
    import wave

    import numpy as np

    rng = np.random.default_rng(seed)
    t = np.arange(int(rate * seconds)) / rate
    sig = sum(a * np.sin(2 * np.pi * f * t) for a, f in zip(rng.uniform(0.1, 0.3, 3), rng.uniform(100, 3000, 3)))
    sig = np.clip(sig + rng.normal(0, 0.02, t.shape), -1, 1)
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes((sig * 32767).astype("<i2").tobytes())
    return Path(path)
