"""Videos in the prompt of a tiny random-weight Qwen2-VL (mlx-vlm's own classes,
support/tiny_vlm.py): frames sampled as mlx-vlm samples them, encoder outputs as cached
objects, prefix identity through the last media span, restart from SSD, errors.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")
pytest.importorskip("cv2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_vision import DOC, SAMPLING, run_worker  # noqa: E402
from tiny_vlm import build_vlm, make_clip, make_image, write_mp4  # noqa: E402

from mlxcache_kernel.engine import Engine  # noqa: E402
from mlxcache_kernel.engine.media.prompt import prompt_for  # noqa: E402
from mlxcache_kernel.engine.generate.sampling import GenerationError  # noqa: E402

Q1, Q2 = DOC + "What happens in the clip?", DOC + "Which colours move?"
BOTH = {  # raw prompts with an image and a video in either order (the tiny template's placeholders)
    "image-video": "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>",
    "video-image": "<|vision_start|><|video_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>",
}


def raw(media: str) -> str:
    return f"<|im_start|>user\n{media}Compare them.<|im_end|>\n<|im_start|>assistant\n"


ARCHS = ("qwen2_vl", "qwen2_5_vl")


@pytest.fixture(scope="module")
def qwens(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    return {arch: build_vlm(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def qwen(qwens):
    return qwens["qwen2_vl"]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """Two different 8-frame clips (arrays and .mp4 files at 4 fps: 2 s each) and an image."""
    root = tmp_path_factory.mktemp("clips")
    arrays = [make_clip(seed) for seed in (1, 2)]
    files = [str(write_mp4(root / f"clip{i}.mp4", a)) for i, a in enumerate(arrays)]
    image = root / "pic.png"
    make_image(5).save(image)
    return {"arrays": arrays, "files": files, "image": str(image), "root": root}


def media_span(eng: Engine, prompt: str, **kw) -> tuple[int, int]:
    """(start of the first media span, end of the last) of this prompt."""
    p = prompt_for(eng, eng.models.get(), prompt, kw.pop("images", None), system=None, raw=kw.pop("raw", False),
                   session=None, **kw)
    return p.spans[0][0], p.spans[-1][1]


def test_followup_about_the_same_clip_cold_ram_ssd(qwen, clips, tmp_path):
    """A follow-up question about the same clip: the RAM hit and the SSD restore in a new
    process skip the encoder and the clip's prefill, and continue exactly as the cold run."""
    clip = clips["files"][0]
    with Engine(cache_dir=tmp_path / "warm") as eng:
        eng.load_model(qwen)
        _, end = media_span(eng, Q2, videos=[clip])
        first = eng.generate(Q1, videos=[clip], max_tokens=12)
        assert first.stats["video_sources"] == ["encoder"] and first.stats["videos"] == 1
        runs = eng.stats()["vision_encoder_runs"]
        assert runs == 1
        ram = [eng.generate(Q2, videos=[clip], max_tokens=12, **s) for s in SAMPLING]
        assert eng.stats()["vision_encoder_runs"] == runs  # no encoder run on a follow-up
        for r in ram:
            assert r.stats["cache_source"] == "ram" and r.stats["cached_tokens"] > end
            assert r.stats["video_sources"] == ["prefix:ram"]
            assert r.stats["prefilled_tokens"] == r.stats["prompt_tokens"] - r.stats["cached_tokens"]
        assert eng.stats()["vision_videos_in_prefix"] == 2
    with Engine(cache_dir=tmp_path / "cold") as eng:
        eng.load_model(qwen)
        cold = [eng.generate(Q2, videos=[clip], max_tokens=12, use_cache=False, **s) for s in SAMPLING]
    ssd = run_worker(tmp_path / "warm", qwen, [{"prompt": Q2, "videos": [clip], **s} for s in SAMPLING])
    for c, r, s in zip(cold, ram, ssd):
        assert len(set(c.tokens)) > 2, c.tokens
        assert r.tokens == c.tokens and s["tokens"] == c.tokens
    assert ssd[0]["cache_source"] == "ssd" and ssd[0]["cached_tokens"] > end
    assert ssd[0]["video_sources"] == ["prefix:ssd"] and ssd[-1]["encoder_runs"] == 0


@pytest.mark.parametrize("arch,fps", [("qwen2_vl", None), ("qwen2_vl", 4.0), ("qwen2_5_vl", 4.0)])
def test_cold_video_generation_is_mlx_vlm_s_own(arch, fps, qwens, clips, tmp_path):
    """From a file (sampled by mlx-vlm's reader at the default or a given fps) and from an
    array: the tokens of mlx-vlm's own generate on the same inputs (its own positions: for
    Qwen2.5-VL, video time positions unscaled, as mlx-vlm runs them); a follow-up from RAM
    continues as the cold run."""
    import mlx_vlm

    kw = {} if fps is None else {"fps": fps}
    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(qwens[arch])
        from_file = eng.generate(DOC * 2, videos=[clips["files"][1]], max_tokens=10, use_cache=False, **kw)
        from_array = eng.generate(DOC * 2, videos=[clips["arrays"][1]], max_tokens=10, use_cache=False)
        eng.generate(DOC * 2 + "?", videos=[clips["files"][1]], max_tokens=2, **kw)
        hit = eng.generate(DOC * 2, videos=[clips["files"][1]], max_tokens=10, **kw)
        assert hit.stats["video_sources"] == ["prefix:ram"] and hit.tokens == from_file.tokens
    model, processor = mlx_vlm.load(str(qwens[arch]))
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": DOC * 2}]}],
        add_generation_prompt=True, tokenize=False)
    ref = mlx_vlm.generate(model, processor, text, video=[clips["files"][1]], max_tokens=10, temperature=0.0,
                           verbose=False, **kw)
    assert from_file.tokens == list(ref.token_ids)[: len(from_file.tokens)] and len(set(from_file.tokens)) > 2
    ref = mlx_vlm.generate(model, processor, text, video=[clips["arrays"][1]], max_tokens=10, temperature=0.0,
                           verbose=False)
    assert from_array.tokens == list(ref.token_ids)[: len(from_array.tokens)]


def test_another_clip_or_another_fps_is_a_miss(qwen, clips, tmp_path):
    """Another clip of the same size, or the same frames at another fps: at most the text
    before the video is shared, and the encoder runs again; each result is its cold one."""
    a, b = clips["arrays"]
    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(qwen)
        start, _ = media_span(eng, Q1, videos=[a])
        eng.generate(Q1, videos=[a], max_tokens=8)
        for other in ({"videos": [b]}, {"videos": [a], "fps": 3.0}, {"videos": [a], "max_frames": 4}):
            runs = eng.stats()["vision_encoder_runs"]
            r = eng.generate(Q1, max_tokens=8, **other)
            assert r.stats["cached_tokens"] <= start and r.stats["video_sources"] == ["encoder"], other
            assert eng.stats()["vision_encoder_runs"] == runs + 1
            assert r.tokens == eng.generate(Q1, max_tokens=8, use_cache=False, **other).tokens
        again = eng.generate(Q1, videos=[a], fps=3.0, max_tokens=8)  # the same clip at the same fps: a hit
        assert again.stats["video_sources"] == ["prefix:ram"]


def test_image_and_video_in_both_orders_never_collide(qwen, clips, tmp_path):
    img, vid = clips["image"], clips["arrays"][0]
    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(qwen)
        results = {}
        for order, media in BOTH.items():
            start, end = media_span(eng, raw(media), images=[img], videos=[vid], raw=True)
            r = eng.generate(raw(media), images=[img], videos=[vid], raw=True, max_tokens=8)
            cold = eng.generate(raw(media), images=[img], videos=[vid], raw=True, max_tokens=8, use_cache=False)
            assert r.tokens == cold.tokens
            results[order] = (r, start, end)
        (iv, _, iv_end), (vi, vi_start, _) = results["image-video"], results["video-image"]
        assert vi.stats["cached_tokens"] <= vi_start  # nothing past the first difference
        assert vi.stats["image_sources"] == ["ram"] and vi.stats["video_sources"] == ["ram"]  # encoder outputs reused
        assert sorted(iv.prompt_tokens) == sorted(vi.prompt_tokens) and iv.prompt_tokens != vi.prompt_tokens
        again = eng.generate(raw(BOTH["image-video"]), images=[img], videos=[vid], raw=True, max_tokens=8)
        assert again.stats["cached_tokens"] > iv_end and again.tokens == iv.tokens
        assert again.stats["image_sources"] == again.stats["video_sources"] == ["prefix:ram"]


def test_same_clip_in_a_new_conversation_reuses_the_encoder_output(qwen, clips, tmp_path):
    clip = clips["files"][0]
    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(qwen)
        eng.generate("Describe it.", videos=[clip], max_tokens=6)
        r = eng.generate("Describe it.", videos=[clip], max_tokens=6, system="You are terse.")
        assert r.stats["video_sources"] == ["ram"] and r.stats["cached_tokens"] < 10
        s = eng.stats()
        assert s["vision_encoder_runs"] == 1 and s["vision_encoder_reused"] == 1
        assert r.tokens == eng.generate("Describe it.", videos=[clip], max_tokens=6, system="You are terse.",
                                        use_cache=False).tokens
    later = run_worker(tmp_path / "c", qwen, [{"prompt": "Describe it.", "videos": [clip], "system": "Be exact.",
                                               "max_tokens": 6}])
    assert later[0]["video_sources"] == ["ssd"] and later[0]["encoder_runs"] == 0


def test_session_follow_up_keeps_the_clip(qwen, clips, tmp_path):
    from mlxcache_kernel.engine.chat.sessions import shown

    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(qwen)
        eng.generate("What happens?", videos=[clips["arrays"][0]], images=[clips["image"]], max_tokens=6,
                     session="chat")
        r = eng.generate("And then?", max_tokens=6, session="chat")
        assert r.stats["video_sources"] == ["prefix:ram"] and r.stats["image_sources"] == ["prefix:ram"]
        assert eng.stats()["vision_encoder_runs"] == 2
        assert shown(eng.sessions.get("chat").messages[0]["content"]) == "[image] [video] What happens?"


def test_video_kinds_and_errors(qwen, clips, tiny_model_dir, tmp_path):
    """An array, an mx array, a .npy file and a directory of frame PNGs of the same frames are
    one clip; bad input is an error that names the file or the limit."""
    import mlx.core as mx

    arr = clips["arrays"][0]
    np.save(tmp_path / "clip.npy", arr)
    (tmp_path / "frames").mkdir()
    from PIL import Image

    for i, frame in enumerate(arr):
        Image.fromarray(frame.transpose(1, 2, 0)).save(tmp_path / "frames" / f"{i:03d}.png")
    (tmp_path / "notavideo.mp4").write_text("hello")
    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(qwen)
        kinds = (arr, mx.array(arr), str(tmp_path / "clip.npy"), str(tmp_path / "frames"), arr / 255.0)
        texts = {eng.generate("Hi", videos=[x], max_tokens=6).text for x in kinds}
        assert len(texts) == 1 and eng.stats()["vision_encoder_runs"] == 1  # one clip, one identity
        for bad, kw, words in [
                (str(tmp_path / "none.mp4"), {}, "no such video file"),
                (str(tmp_path / "notavideo.mp4"), {}, "notavideo.mp4 is not a video OpenCV can read"),
                (np.zeros((4, 56, 56, 3), np.uint8), {}, r"\(T, C, H, W\)"),
                (arr, {"fps": -1}, "fps must be a positive number"),
                (arr, {"max_frames": 1}, "max_frames must be an integer >= 2"),
                (42, {}, "expected a video path")]:
            with pytest.raises(GenerationError, match=words):
                eng.generate("Hi", videos=[bad], max_tokens=2, **kw)
        with pytest.raises(GenerationError, match="fps and max_frames apply to videos"):
            eng.generate("Hi", fps=2.0, max_tokens=2)
        eng.load_model(build_vlm("gemma3", tmp_path / "gemma"), name="gemma")
        with pytest.raises(GenerationError, match="'gemma' .*takes no video"):
            eng.generate("Hi", videos=[arr], model="gemma", max_tokens=2)
        eng.load_model(tiny_model_dir, name="text")
        with pytest.raises(GenerationError, match="'text' is not a vision-language model: it takes no images, videos or audio"):
            eng.generate("Hi", videos=[arr], model="text", max_tokens=2)


def test_too_many_frames_for_the_context(clips, tmp_path):
    """A clip whose tokens overflow the context: the error names the video, its tokens and the
    limit; max_frames brings it under."""
    path = build_vlm("qwen2_vl", tmp_path / "short", context=40)
    long = make_clip(3, frames=48)  # 24 frame pairs; the processor shrinks them to 1 token each
    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(path)
        with pytest.raises(GenerationError, match=r"47 tokens, more than the model's context of 40 \(video 1 "
                                                  r"\(array\): 24 tokens for 24 frame pair\(s\)\).*max_frames"):
            eng.generate("Hi", videos=[long], max_tokens=2)
        r = eng.generate("Hi", videos=[long], max_frames=8, max_tokens=2)
        assert r.stats["videos"] == 1 and r.stats["prompt_tokens"] <= 40


def test_a_follow_up_on_another_machine_comes_from_the_remote_tier(qwen, clips, tmp_path):
    from redis_servers import RedisServer, missing

    if missing():
        pytest.skip(missing())
    clip, q1, q2 = clips["files"][0], DOC * 4 + "What happens?", DOC * 4 + "Which colours move?"  # >= 256 shared
    server = RedisServer(tmp_path / "redis", password="video-pw-12345").start()
    try:
        kw = dict(remote_url=server.url(password="video-pw-12345"), remote_secret="video-team-secret-0123")
        with Engine(cache_dir=tmp_path / "a", **kw) as a:
            a.load_model(qwen)
            a.generate(q1, videos=[clip], max_tokens=8)
            assert a.flush()["remote_failed"] == []
        with Engine(cache_dir=tmp_path / "b", **kw) as b:
            b.load_model(qwen)
            _, end = media_span(b, q2, videos=[clip])
            hit = b.generate(q2, videos=[clip], max_tokens=8)
            assert hit.stats["cache_source"] == "remote" and hit.stats["cached_tokens"] > end
            assert hit.stats["video_sources"] == ["prefix:remote"] and b.stats()["vision_encoder_runs"] == 0
            assert hit.tokens == b.generate(q2, videos=[clip], max_tokens=8, use_cache=False).tokens
    finally:
        server.stop()


def test_generate_magic_with_a_video_in_a_real_kernel(spec_prefix, qwen, clips, tmp_path):
    """%%generate --video DIR (frame images), then --video {var} holding the same frames as an
    array: a prefix hit; the footer says where the clip came from; bad input is one clear error."""
    from PIL import Image

    from kernel_client import Kernel, footer

    frames = tmp_path / "frames"
    frames.mkdir()
    for i, frame in enumerate(clips["arrays"][0]):
        Image.fromarray(frame.transpose(1, 2, 0)).save(frames / f"{i:03d}.png")
    np.save(tmp_path / "clip.npy", clips["arrays"][0])
    env = {**os.environ, "MLXCACHE_CACHE_DIR": str(tmp_path / "cache"), "MLXCACHE_DEFAULT_MODEL": str(qwen),
           "MLXCACHE_RAM_BUDGET": "256MiB", "JUPYTER_PLATFORM_DIRS": "1", "HF_HUB_OFFLINE": "1"}
    k = Kernel(spec_prefix, env, tmp_path / "kernel.log")
    try:
        first = k.execute(f"%%generate --video {frames} -n 6\nWhat happens in the clip?")
        assert first["error"] is None, first
        assert "1 video: encoded" in footer(first)
        k.execute(f"import numpy as np\nclip = np.load({str(tmp_path / 'clip.npy')!r})")
        again = k.execute("%%generate --video {clip} -n 6 --out r\nWhat happens in the clip?")
        assert "1 video: in the cached prefix (RAM)" in footer(again)
        assert k.execute("print(r.stats['video_sources'])")["stream"].strip() == "['prefix:ram']"
        other = k.execute("%%generate --video {clip} --fps 1 --max-frames 4 -n 6 --image "
                          f"{clips['image']}\nWhat happens in the clip?")
        assert "1 image: encoded" in footer(other) and "1 video: encoded" in footer(other)
        missing = k.execute(f"%%generate --video {tmp_path / 'none.mp4'} -n 2\nHi")
        assert missing["error"] is not None and "no such video file" in missing["text"] \
            and "none.mp4" in missing["text"]
        alone = k.execute("%%generate --fps 2 -n 2\nHi")
        assert alone["error"] is not None and "--fps and --max-frames go with --video" in alone["text"]
    finally:
        k.shutdown()
