"""Vision-language models through mlx-vlm: images in the prompt, their encoder
outputs as cached objects, media prefix identity, positions, restart from SSD.

Tiny random-weight Qwen2-VL (multimodal rotary positions, a token count that
follows the image size) and Gemma 3 (fixed tokens per image, bidirectional
image attention, a sliding-window layer) from mlx-vlm's own classes
(support/tiny_vlm.py), built once per session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tiny_vlm import build_vlm, make_image  # noqa: E402

from mlxcache_kernel.engine import Engine  # noqa: E402
from mlxcache_kernel.engine.generate.sampling import GenerationError  # noqa: E402
from mlxcache_kernel.engine.models.registry import ModelError  # noqa: E402
from repo_paths import SUPPORT

ARCHS = ("qwen2_vl", "gemma3")
SIZES = {"qwen2_vl": (112, 84), "gemma3": (64, 48)}  # Qwen: 8x6 patches -> 12 image tokens; Gemma: 16
DOC = "A short note about the picture. It was taken on a rainy day near the harbour. "
WORKER = SUPPORT / "vision_worker.py"


@pytest.fixture(scope="session")
def vlm_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlms")
    return {arch: build_vlm(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def pictures(tmp_path_factory):
    """PNG files per arch: two different images of the same size, and a third."""
    root = tmp_path_factory.mktemp("pictures")
    out = {}
    for arch, size in SIZES.items():
        paths = []
        for seed in (1, 2, 3):
            p = root / f"{arch}-{seed}.png"
            make_image(seed, size).save(p)
            paths.append(str(p))
        out[arch] = paths
    return out


def run_worker(cache_dir, model_dir, requests, policy=None) -> list:
    cmd = [sys.executable, str(WORKER), str(cache_dir), str(model_dir)] + ([policy] if policy else [])
    proc = subprocess.run(cmd, input=json.dumps(requests), capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def first_image_at(eng: Engine, prompt: str, images) -> tuple[int, int]:
    """(start, end) of the first image span of this prompt."""
    from mlxcache_kernel.engine.media.prompt import prompt_for

    m = eng.models.get()
    p = prompt_for(eng, m, prompt, images, system=None, raw=False, session=None)
    return p.spans[0][0], p.spans[-1][1]


SAMPLING = ({"temperature": 0.0, "seed": 0}, {"temperature": 0.9, "seed": 7})


@pytest.mark.parametrize("arch", ARCHS)
def test_followup_about_the_same_image_cold_ram_ssd(arch, vlm_dirs, pictures, tmp_path):
    """A different question about the same image and text: the RAM hit and the SSD
    restore in a new process skip the encoder and the image's prefill, and continue
    exactly as the cold run (greedy and seeded)."""
    img = pictures[arch][0]
    q1, q2 = DOC + "What is in it?", DOC + "Which colours stand out?"
    with Engine(cache_dir=tmp_path / "warm") as eng:
        eng.load_model(vlm_dirs[arch])
        _, image_end = first_image_at(eng, q2, [img])
        first = eng.generate(q1, images=[img], max_tokens=12)
        assert first.stats["image_sources"] == ["encoder"]
        runs = eng.stats()["vision_encoder_runs"]
        ram = [eng.generate(q2, images=[img], max_tokens=12, **s) for s in SAMPLING]
        assert eng.stats()["vision_encoder_runs"] == runs  # no encoder run for the follow-ups
        for r in ram:
            assert r.stats["cache_source"] == "ram" and r.stats["cached_tokens"] > image_end
            assert r.stats["image_sources"] == ["prefix:ram"]
            assert r.stats["prefilled_tokens"] == r.stats["prompt_tokens"] - r.stats["cached_tokens"]
    with Engine(cache_dir=tmp_path / "cold") as eng:
        eng.load_model(vlm_dirs[arch])
        cold = [eng.generate(q2, images=[img], max_tokens=12, use_cache=False, **s) for s in SAMPLING]
        assert eng.stats()["vision_encoder_runs"] == 2  # cache off: the encoder runs every time
    ssd = run_worker(tmp_path / "warm", vlm_dirs[arch], [{"prompt": q2, "images": [img], **s} for s in SAMPLING])
    for c, r, s in zip(cold, ram, ssd):
        assert len(set(c.tokens)) > 2, c.tokens  # the tiny model moves between tokens (hides nothing)
        assert r.tokens == c.tokens
        assert s["tokens"] == c.tokens
    assert ssd[0]["cache_source"] == "ssd" and ssd[0]["cached_tokens"] > image_end
    assert ssd[0]["image_sources"] == ["prefix:ssd"]
    assert ssd[-1]["encoder_runs"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_another_image_of_the_same_size_is_a_miss(arch, vlm_dirs, pictures, tmp_path):
    a, b = pictures[arch][:2]
    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(vlm_dirs[arch])
        start, _ = first_image_at(eng, DOC, [a])
        eng.generate(DOC, images=[a], max_tokens=8)
        other = eng.generate(DOC, images=[b], max_tokens=8)
        assert other.stats["cached_tokens"] <= start  # at most the text before the image is shared
        assert other.stats["image_sources"] == ["encoder"]
        assert eng.stats()["vision_encoder_runs"] == 2
        cold = eng.generate(DOC, images=[b], max_tokens=8, use_cache=False)
        assert other.tokens == cold.tokens
        assert eng.generate(DOC, images=[a], max_tokens=8).tokens != other.tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_same_image_in_a_new_conversation_reuses_the_encoder_output(arch, vlm_dirs, pictures, tmp_path):
    """Another system prompt: no KV prefix through the image, but its encoder output is an
    object (RAM now, SSD after a restart) and the result is the cold one."""
    img = pictures[arch][0]
    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(vlm_dirs[arch])
        eng.generate("Describe it.", images=[img], max_tokens=8)
        r = eng.generate("Describe it.", images=[img], max_tokens=8, system="You are terse.")
        assert r.stats["image_sources"] == ["ram"]
        s = eng.stats()
        assert s["vision_encoder_runs"] == 1 and s["vision_encoder_reused"] == 1
        cold = eng.generate("Describe it.", images=[img], max_tokens=8, system="You are terse.", use_cache=False)
        assert r.tokens == cold.tokens
    later = run_worker(tmp_path / "c", vlm_dirs[arch], [
        {"prompt": "Describe it.", "images": [img], "system": "Be exact.", "max_tokens": 8}])
    assert later[0]["image_sources"] == ["ssd"] and later[0]["encoder_runs"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_two_images_in_both_orders_never_collide(arch, vlm_dirs, pictures, tmp_path):
    a, b = pictures[arch][:2]
    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(vlm_dirs[arch])
        start, _ = first_image_at(eng, "Compare them.", [a, b])
        ab = eng.generate("Compare them.", images=[a, b], max_tokens=8)
        ba = eng.generate("Compare them.", images=[b, a], max_tokens=8)
        assert ba.stats["cached_tokens"] <= start
        assert ba.stats["image_sources"] == ["ram", "ram"]  # both encoder outputs reused
        assert ba.prompt_tokens != ab.prompt_tokens and sorted(ba.prompt_tokens) == sorted(ab.prompt_tokens)
        assert ba.tokens == eng.generate("Compare them.", images=[b, a], max_tokens=8, use_cache=False).tokens
        assert ab.tokens == eng.generate("Compare them.", images=[a, b], max_tokens=8, use_cache=False).tokens
        assert eng.stats()["vision_encoder_runs"] == 2 + 4  # the two cold runs encode both images


@pytest.mark.parametrize("arch,policy", [("qwen2_vl", None), ("gemma3", "causal")])
def test_cold_generation_is_mlx_vlm_s_own(arch, policy, vlm_dirs, pictures, tmp_path):
    """The engine's forward (explicit positions, merged features, chunks) gives the tokens
    mlx-vlm's own generate gives for the same prompt and image."""
    import mlx_vlm

    img = pictures[arch][2]
    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(vlm_dirs[arch], image_attention=policy)
        r = eng.generate(DOC * 3, images=[img], max_tokens=10, use_cache=False)
    model, processor = mlx_vlm.load(str(vlm_dirs[arch]))
    tok = processor.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": DOC * 3}]}],
                                   add_generation_prompt=True, tokenize=False)
    ref = mlx_vlm.generate(model, processor, text, image=[img], max_tokens=10, temperature=0.0, verbose=False)
    assert r.tokens == list(ref.token_ids)[: len(r.tokens)]


def test_gemma_attention_policies_never_share_a_prefix(vlm_dirs, pictures, tmp_path):
    img = pictures["gemma3"][0]
    with Engine(cache_dir=tmp_path / "c") as eng:
        bi = eng.load_model(vlm_dirs["gemma3"], name="bi")
        causal = eng.load_model(vlm_dirs["gemma3"], name="causal", image_attention="causal")
        assert bi["vision"]["image_attention"] == "bidirectional" and bi["namespace"] != causal["namespace"]
        r_bi = eng.generate(DOC, images=[img], max_tokens=10, model="bi")
        r_causal = eng.generate(DOC, images=[img], max_tokens=10, model="causal")
        assert r_causal.stats["cached_tokens"] == 0
        assert r_bi.tokens != r_causal.tokens  # the policy changes the numbers
        assert r_bi.tokens == eng.generate(DOC, images=[img], max_tokens=10, model="bi").tokens


def test_gemma_sliding_window_wraps_over_an_image(pictures, tmp_path):
    """A window of 32 wraps inside the prompt: the image chunk's bidirectional masks follow
    the ring; an identical rerun is served from the exact prompt boundary."""
    path = build_vlm("gemma3", tmp_path / "gemma-w32", window=32)
    img = pictures["gemma3"][0]
    with Engine(cache_dir=tmp_path / "c", prefill_chunk=24) as eng:
        eng.load_model(path)
        prompt = DOC * 2
        cold = eng.generate(prompt, images=[img], max_tokens=10, use_cache=False)
        eng.generate(prompt, images=[img], max_tokens=10)
        again = eng.generate(prompt, images=[img], max_tokens=10)
        assert again.stats["cached_tokens"] == again.stats["prompt_tokens"] - 1
        assert again.stats["image_sources"] == ["prefix:ram"] and again.tokens == cold.tokens


def test_session_follow_up_keeps_the_image(vlm_dirs, pictures, tmp_path):
    """A chat turn without --image still sees the earlier turn's image, from the cached prefix."""
    img = pictures["qwen2_vl"][0]
    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(vlm_dirs["qwen2_vl"])
        eng.generate("What is this?", images=[img], max_tokens=6, session="chat")
        r = eng.generate("And the colours?", max_tokens=6, session="chat")
        assert r.stats["image_sources"] == ["prefix:ram"] and eng.stats()["vision_encoder_runs"] == 1
        assert len(eng.sessions.get("chat").images) == 1
        from mlxcache_kernel.engine.chat.sessions import shown

        assert shown(eng.sessions.get("chat").messages[0]["content"]) == "[image] What is this?"


def test_image_kinds_and_errors(vlm_dirs, tiny_model_dir, pictures, tmp_path):
    from PIL import Image

    path = pictures["qwen2_vl"][0]
    with Image.open(path) as im:
        pil = im.convert("RGB")
    arr = np.asarray(pil)
    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(vlm_dirs["qwen2_vl"])
        texts = {eng.generate("Hi", images=[x], max_tokens=6).text for x in (path, pil, arr, arr / 255.0)}
        assert len(texts) == 1 and eng.stats()["vision_encoder_runs"] == 1  # one image, one identity
        for bad, words in [(str(tmp_path / "none.png"), "no such image file"), (np.zeros((4, 4, 7)), "(H, W, 3)"),
                           (42, "expected a path"), (np.full((8, 8, 3), 2.0), "[0, 1]")]:
            with pytest.raises(GenerationError, match=words.replace("(", r"\(").replace(")", r"\)")
                               .replace("[", r"\[").replace("]", r"\]")):
                eng.generate("Hi", images=[bad], max_tokens=2)
        assert eng.generate("Just text.", max_tokens=4).stats["images"] == 0
        eng.load_model(tiny_model_dir, name="text")
        with pytest.raises(GenerationError, match="not a vision-language model"):
            eng.generate("Hi", images=[path], model="text")
        with pytest.raises(ModelError, match="vision-language models only"):
            eng.load_model(tiny_model_dir, name="t2", image_attention="causal")
        with pytest.raises(ModelError, match="image_attention"):
            eng.load_model(vlm_dirs["qwen2_vl"], name="q2", image_attention="bidirectional")


def test_a_vlm_without_mlx_vlm_is_a_clear_error(vlm_dirs, tiny_model_dir, tmp_path):
    code = (
        "import sys; sys.modules['mlx_vlm'] = None\n"
        "from mlxcache_kernel.engine import Engine\n"
        "from mlxcache_kernel.engine.models.registry import ModelError\n"
        f"eng = Engine(cache_dir={str(tmp_path / 'c')!r})\n"
        f"eng.load_model({str(tiny_model_dir)!r})\n"
        "print(eng.generate('hi', max_tokens=2).tokens)\n"
        f"try:\n    eng.load_model({str(vlm_dirs['qwen2_vl'])!r}, name='v')\n"
        "except ModelError as e:\n    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ERR" in out.stdout and "mlxcache-kernel[vision]" in out.stdout


def test_generate_magic_with_images_in_a_real_kernel(spec_prefix, vlm_dirs, pictures, tmp_path):
    """%%generate --image PATH, then --image {var} holding an array of the same picture: the
    second is a prefix hit, and the footer says where the image came from."""
    from kernel_client import Kernel, footer

    env = {**os.environ, "MLXCACHE_CACHE_DIR": str(tmp_path / "cache"), "MLXCACHE_DEFAULT_MODEL": str(vlm_dirs["qwen2_vl"]),
           "MLXCACHE_RAM_BUDGET": "256MiB", "JUPYTER_PLATFORM_DIRS": "1", "HF_HUB_OFFLINE": "1"}
    path = pictures["qwen2_vl"][0]
    k = Kernel(spec_prefix, env, tmp_path / "kernel.log")
    try:
        first = k.execute(f"%%generate --image {path} -n 6\nWhat is in the picture?")
        assert first["error"] is None, first
        assert "1 image: encoded" in footer(first)
        k.execute(f"from PIL import Image\nimport numpy as np\npic = np.asarray(Image.open({path!r}))")
        again = k.execute("%%generate --image {pic} -n 6 --out r\nWhat is in the picture?")
        assert "1 image: in the cached prefix (RAM)" in footer(again)
        assert k.execute("print(r.stats['image_sources'], r.stats['cached_tokens'] > 0)")["stream"].strip() \
            == "['prefix:ram'] True"
        k.execute("n = 3")  # other options still expand {name} as IPython does
        assert k.execute("%%generate --image {pic} -n {n} --out r3\nHi")["error"] is None
        assert k.execute("print(len(r3.tokens))")["stream"].strip() == "3"
        bad = k.execute("%%generate --image {nothing} -n 2\nHi")
        assert bad["error"] is not None and "'nothing' is not defined" in bad["text"]
    finally:
        k.shutdown()


def test_a_follow_up_on_another_machine_comes_from_the_remote_tier(vlm_dirs, pictures, tmp_path):
    """Two cache directories sharing a real redis-server: the media-keyed prefix is
    published and fetched like text, and continues as the cold run."""
    from redis_servers import RedisServer, missing

    if missing():
        pytest.skip(missing())
    img, question = pictures["qwen2_vl"][0], DOC * 3 + "Which colours stand out?"
    server = RedisServer(tmp_path / "redis", password="vision-pw-1234").start()
    try:
        kw = dict(remote_url=server.url(password="vision-pw-1234"), remote_secret="vision-team-secret-0123")
        with Engine(cache_dir=tmp_path / "a", **kw) as a:
            a.load_model(vlm_dirs["qwen2_vl"])
            a.generate(DOC * 3 + "What is in it?", images=[img], max_tokens=8)
            assert a.flush()["remote_failed"] == []
        with Engine(cache_dir=tmp_path / "b", **kw) as b:
            b.load_model(vlm_dirs["qwen2_vl"])
            _, image_end = first_image_at(b, question, [img])
            hit = b.generate(question, images=[img], max_tokens=8)
            assert hit.stats["cache_source"] == "remote" and hit.stats["cached_tokens"] > image_end
            assert hit.stats["image_sources"] == ["prefix:remote"]
            assert hit.tokens == b.generate(question, images=[img], max_tokens=8, use_cache=False).tokens
    finally:
        server.stop()


def test_an_interrupted_state_is_never_published_inside_an_image(vlm_dirs, pictures, tmp_path):
    from mlxcache_kernel.engine.media.prompt import prompt_for

    with Engine(cache_dir=tmp_path / "c") as eng:
        eng.load_model(vlm_dirs["qwen2_vl"])
        p = prompt_for(eng, eng.models.get(), "Hi", [pictures["qwen2_vl"][0]], system=None, raw=False, session=None)
        (start, end, _), = p.spans
        assert [p.cut(n) for n in (start - 1, start, start + 1, end - 1, end, end + 3)] == \
            [start - 1, start, start, start, end, end + 3]
        assert p.keys[:start] == p.ids[:start] and p.keys[end:] == p.ids[end:]
        assert min(p.keys[start:end]) >= eng.models.get().vision.vocab and max(p.keys) < 2 ** 31
