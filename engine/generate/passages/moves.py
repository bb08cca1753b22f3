"""Moving keys to other positions: each layer's own rotary module, and the check that a model's can.

A plain KV cache holds keys with their rotary position applied: R(p)k. Rotations compose,
R(p + d) = R(d)R(p), so a passage's keys computed at positions p move to p + d by one more
rotation through the same module (`Mover.rotate`); its values hold no position and stay. The
model's own module is used (its base, scaling, frequencies, traditional layout), applied with
every token as a batch row of one position, so each row turns by the same angle.

Recomputing chosen tokens runs the model's own forward pass over tokens at positions that are
not consecutive; `Mover.at(positions)` swaps each layer's rotary module for one that gives
each token its own position (again the token as a batch row: mx.fast.rope takes one offset per
row) and puts the modules back afterwards.

What cannot move is refused (`PassageError`), by what the model's caches are (codecs: sliding
windows, chunked attention, recurrent layers, quantized KV), by what its layers hold (no rotary
module: ALiBi, learned or no positions), and by a check on the first layer (`_check`): its
keys for a few tokens at one position, rotated, must equal its keys computed at another, and
its values must not change. That catches what the module alone does not say: a module that
scales as it rotates (YaRN's and LongRoPE's mscale), rotary codes that depend on the length
(LongRoPE's two sets of factors), keys that hold more than the rotated part (multi-head latent
attention), positions from elsewhere (M-RoPE of vision-language models is refused before).
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx

from ...errors import PassageError
from ...kv.caches import move_blockers
from ...kv.first_layer import Capture, Stop

ROPE_NAMES = ("rope", "rotary_emb")  # what mlx-lm's attention modules call their rotary module
CHECK_TOKENS = 6  # tokens of the first-layer check
CHECK_AT, CHECK_MOVE = 5, 731  # where they are computed, and how far they move
TOLERANCE = {mx.float32: (1e-4, 1e-5), mx.float16: (2e-2, 2e-3), mx.bfloat16: (5e-2, 1e-2)}  # (rtol, atol)


class _AtPositions:
    """A rotary module that gives token i of its input (1, heads, L, dim) position positions[i]."""

    def __init__(self, rope, positions: mx.array):
        self.rope, self.positions = rope, positions

    def __call__(self, x, offset=0):
        return self.rope(x.swapaxes(0, 2), offset=self.positions).swapaxes(0, 2)


class Mover:
    """A model's rotary modules, one per layer, and the means to move keys and to forward at positions."""

    def __init__(self, model, slots: list):
        self.model = model
        self.slots = slots  # per layer: (the module holding the rotary module, its attribute name)

    def rope(self, layer: int):
        parent, name = self.slots[layer]
        return parent[name]

    def rotate(self, layer: int, keys: mx.array, d: int) -> mx.array:
        """Layer `layer`'s keys (1, heads, n, dim) moved d positions on."""
        if d == 0:
            return keys
        return self.rope(layer)(keys.swapaxes(0, 2), offset=d).swapaxes(0, 2)

    @contextmanager
    def at(self, positions):
        """The model's forward pass gives its tokens these positions (ascending ints) while inside."""
        pos = mx.array(list(positions), dtype=mx.int32)
        saved = [self.rope(i) for i in range(len(self.slots))]
        try:
            for (parent, name), rope in zip(self.slots, saved):
                parent[name] = _AtPositions(rope, pos)
            yield
        finally:
            for (parent, name), rope in zip(self.slots, saved):
                parent[name] = rope


def _refuse(m, why: str) -> PassageError:
    return PassageError(f"model {m.name!r} cannot place passages: {why}; put them in the prompt instead "
                        "(generate(\"\\n\\n\".join(passages) + \"\\n\\n\" + prompt): exact, prefix caching only)")


def mover_for(m) -> Mover:
    """The Mover of loaded model `m` (models.LoadedModel), or PassageError saying why its keys cannot
    move (a few milliseconds: two passes of six tokens through the first layer)."""
    if m.vision is not None:
        raise _refuse(m, "a vision-language model's positions (M-RoPE) are not one rotation per token")
    caches = m.new_caches()
    blockers = move_blockers(caches) + (["quantized KV (kv_bits)"] if m.kv_bits is not None else [])
    if blockers:
        raise _refuse(m, f"its keys cannot be moved to other positions ({', '.join(sorted(set(blockers)))})")
    layers = list(getattr(m.model, "layers", None) or [])
    if len(layers) != len(caches):
        raise _refuse(m, "its layers could not be matched with its caches")
    slots = []
    for layer in layers:
        found = [name for name, _ in layer.named_modules() if name.split(".")[-1] in ROPE_NAMES]
        if len(found) != 1:
            raise _refuse(m, "its attention has no rotary position module (ALiBi, learned or no positions)"
                          if not found else f"a layer has {len(found)} rotary modules")
        *path, attr = found[0].split(".")
        parent = layer
        for part in path:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        slots.append((parent, attr))
    mover = Mover(m.model, slots)
    _check(m, mover, caches)
    return mover


def _first_layer(m, tokens: list, offset: int, at: list | None, mover: Mover) -> tuple:
    cache = Capture(offset)
    try:
        if at is None:
            m.model(mx.array(tokens)[None], cache=[cache] * len(mover.slots))
        else:
            with mover.at(at):
                m.model(mx.array(tokens)[None], cache=[cache] * len(mover.slots))
    except Stop:
        pass
    if cache.got is None:
        raise _refuse(m, "its forward pass does not store keys through its caches")
    return cache.got


def _check(m, mover: Mover, caches: list) -> None:
    """Layer 0's keys of a few tokens at CHECK_AT, rotated by CHECK_MOVE, against the keys computed at
    CHECK_AT + CHECK_MOVE (given per token, as recomputation gives them); its values unchanged."""
    vocab = int(m.config.get("vocab_size") or 2)
    tokens = [(7 + 97 * i) % vocab for i in range(CHECK_TOKENS)]
    k0, v0 = _first_layer(m, tokens, CHECK_AT, None, mover)
    at = [CHECK_AT + CHECK_MOVE + i for i in range(CHECK_TOKENS)]
    k1, v1 = _first_layer(m, tokens, 0, at, mover)
    moved = mover.rotate(0, k0, CHECK_MOVE)
    rtol, atol = TOLERANCE.get(k0.dtype, (5e-2, 1e-2))
    scale = float(mx.abs(k1).max().item()) or 1.0
    if not (mx.allclose(moved, k1, rtol=rtol, atol=atol * scale).item() and mx.allclose(v0, v1, rtol=rtol,
                                                                                          atol=atol * scale).item()):
        raise _refuse(m, "its rotary position code does not move keys by a rotation (a scaled or "
                      "length-dependent rotary code, or keys beyond the rotated part)")
