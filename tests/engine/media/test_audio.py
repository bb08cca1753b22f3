"""Audio in the prompt of a tiny random-weight Gemma 4 (mlx-vlm's own classes:
a conformer audio tower, per-layer input embeddings; support/tiny_vlm.py): recordings
read as mlx-vlm reads them, encoder outputs as cached objects, prefix identity,
restart from SSD, errors.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_vision import SAMPLING, run_worker  # noqa: E402
from tiny_vlm import build_vlm, write_wav  # noqa: E402

from mlxcache_kernel.engine import Engine  # noqa: E402
from mlxcache_kernel.engine.media.prompt import prompt_for  # noqa: E402
from mlxcache_kernel.engine.generate.sampling import GenerationError  # noqa: E402

DOC = "A recording made near the harbour on a rainy morning, with gulls and engines. "
Q1, Q2 = DOC + "What do you hear?", DOC + "Is anyone speaking?"


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    return build_vlm("gemma4", tmp_path_factory.mktemp("vlm") / "gemma4")


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    root = tmp_path_factory.mktemp("wavs")
    return [str(write_wav(root / f"rec{seed}.wav", seed)) for seed in (1, 2)]


def audio_span(eng: Engine, prompt: str, audios) -> tuple[int, int]:
    p = prompt_for(eng, eng.models.get(), prompt, None, system=None, raw=False, session=None, audios=audios)
    return p.spans[0][0], p.spans[-1][1]


def test_followup_about_the_same_recording_cold_ram_ssd(gemma4, wavs, tmp_path):
    rec = wavs[0]
    with Engine(cache_dir=tmp_path / "warm") as eng:
        eng.load_model(gemma4)
        start, end = audio_span(eng, Q2, [rec])
        first = eng.generate(Q1, audios=[rec], max_tokens=12)
        assert first.stats["audio_sources"] == ["encoder"] and first.stats["recordings"] == 1
        ram = [eng.generate(Q2, audios=[rec], max_tokens=12, **s) for s in SAMPLING]
        assert eng.stats()["vision_encoder_runs"] == 1  # no encoder run on a follow-up
        for r in ram:
            assert r.stats["cache_source"] == "ram" and r.stats["cached_tokens"] > end
            assert r.stats["audio_sources"] == ["prefix:ram"]
        assert eng.stats()["vision_recordings_in_prefix"] == 2
    with Engine(cache_dir=tmp_path / "cold") as eng:
        eng.load_model(gemma4)
        cold = [eng.generate(Q2, audios=[rec], max_tokens=12, use_cache=False, **s) for s in SAMPLING]
    ssd = run_worker(tmp_path / "warm", gemma4, [{"prompt": Q2, "audios": [rec], **s} for s in SAMPLING])
    for c, r, s in zip(cold, ram, ssd):
        assert len(set(c.tokens)) > 2, c.tokens
        assert r.tokens == c.tokens and s["tokens"] == c.tokens
    assert ssd[0]["cache_source"] == "ssd" and ssd[0]["cached_tokens"] > end
    assert ssd[0]["audio_sources"] == ["prefix:ssd"] and ssd[-1]["encoder_runs"] == 0


@pytest.mark.parametrize("seconds", [1.0, 31.0])
def test_cold_audio_generation_is_mlx_vlm_s_own(seconds, gemma4, wavs, tmp_path):
    """The engine's forward (merged features, per-layer inputs, chunks) gives the tokens
    mlx-vlm's own generate gives for the same prompt and recording; past the processor's
    750-token cap (30 s) too (the first 750 features, as mlx-vlm takes them)."""
    import mlx_vlm

    rec = wavs[1] if seconds == 1.0 else str(write_wav(tmp_path / "long.wav", 3, seconds))
    with Engine(cache_dir=tmp_path / "c", prefill_chunk=32) as eng:
        eng.load_model(gemma4)
        r = eng.generate(DOC * 2, audios=[rec], max_tokens=10, use_cache=False)
    model, processor = mlx_vlm.load(str(gemma4))
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": DOC * 2}]}],
        add_generation_prompt=True, tokenize=False)
    ref = mlx_vlm.generate(model, processor, text, audio=[rec], max_tokens=10, temperature=0.0, verbose=False)
    assert r.tokens == list(ref.token_ids)[: len(r.tokens)] and len(set(r.tokens)) > 2
    assert r.stats["prompt_tokens"] > 750 * (seconds > 30)


def test_another_recording_is_a_miss_and_the_same_one_reuses_its_encoder_output(gemma4, wavs, tmp_path):
    a, b = wavs
    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(gemma4)
        start, _ = audio_span(eng, Q1, [a])
        eng.generate(Q1, audios=[a], max_tokens=8)
        other = eng.generate(Q1, audios=[b], max_tokens=8)
        assert other.stats["cached_tokens"] <= start and other.stats["audio_sources"] == ["encoder"]
        assert other.tokens == eng.generate(Q1, audios=[b], max_tokens=8, use_cache=False).tokens
        puts, hits = eng.stats()["object_puts"], eng.stats()["object_ram_hits"]
        again = eng.generate(Q1, audios=[a], max_tokens=8, system="Answer briefly.")  # another conversation
        assert again.stats["audio_sources"] == ["ram"] and eng.stats()["vision_encoder_reused"] == 1
        # its features and its encoder output both read back (no feature extractor, no encoder), nothing stored
        assert eng.stats()["object_ram_hits"] == hits + 2 and eng.stats()["object_puts"] == puts
        from mlx_vlm.utils import load_audio

        wave = load_audio(a, sr=16000)  # the same waveform as an array: the same recording
        assert eng.generate(Q1, audios=[wave], max_tokens=8).stats["audio_sources"] == ["prefix:ram"]
    later = run_worker(tmp_path / "c", gemma4, [{"prompt": Q1, "audios": [a], "system": "Be exact.",
                                                  "max_tokens": 6}])
    assert later[0]["audio_sources"] == ["ssd"] and later[0]["encoder_runs"] == 0


def test_audio_errors(gemma4, wavs, tmp_path):
    (tmp_path / "noise.wav").write_bytes(b"RIFF not really a wave file")
    qwen = build_vlm("qwen2_vl", tmp_path / "qwen")
    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(gemma4)
        for bad, words in [(str(tmp_path / "none.wav"), "no such audio file"),
                           (str(tmp_path / "noise.wav"), "noise.wav is not audio the processor can read"),
                           (np.zeros((2, 100), np.float32), "1-D float waveform at 16000 Hz"),
                           (np.full(100, 3.0, np.float32), r"\[-1, 1\]"),
                           (7, "expected an audio file path")]:
            with pytest.raises(GenerationError, match=words):
                eng.generate("Hi", audios=[bad], max_tokens=2)
        with pytest.raises(GenerationError, match="images for Gemma 4 are not supported yet"):
            eng.generate("Hi", images=[np.zeros((32, 32, 3), np.uint8)], max_tokens=2)
        eng.load_model(qwen, name="qwen")
        with pytest.raises(GenerationError, match="'qwen' .*takes no audio"):
            eng.generate("Hi", audios=[wavs[0]], model="qwen", max_tokens=2)


def test_session_and_magic_with_a_recording(spec_prefix, gemma4, wavs, tmp_path):
    """%%generate --audio PATH in a real kernel, then a session turn without it: the
    recording comes with the cached prefix, and the footer says so."""
    from kernel_client import Kernel, footer

    env = {**os.environ, "MLXCACHE_CACHE_DIR": str(tmp_path / "cache"), "MLXCACHE_DEFAULT_MODEL": str(gemma4),
           "MLXCACHE_RAM_BUDGET": "256MiB", "JUPYTER_PLATFORM_DIRS": "1", "HF_HUB_OFFLINE": "1"}
    k = Kernel(spec_prefix, env, tmp_path / "kernel.log")
    try:
        first = k.execute(f"%%generate --audio {wavs[0]} --session s -n 6\nWhat do you hear?")
        assert first["error"] is None, first
        assert "1 recording: encoded" in footer(first)
        later = k.execute("%%generate --session s -n 6 --out r\nAnd then?")
        assert "1 recording: in the cached prefix (RAM)" in footer(later)
        assert k.execute("print(r.stats['audio_sources'])")["stream"].strip() == "['prefix:ram']"
        bad = k.execute(f"%%generate --audio {tmp_path / 'none.wav'} -n 2\nHi")
        assert bad["error"] is not None and "no such audio file" in bad["text"]
    finally:
        k.shutdown()
