"""One codec per mlx-lm cache class: the only module that names those classes.

A codec answers every question the cache asks about one layer: how to capture a live cache into a
`LayerState` (evaluated arrays cut to the tokens they encode, plus JSON-able scalars), how to lend a
fresh cache over views of that state, whether the state can serve a shorter prefix of itself, from
which offset on it is valid, and what its arrays are called. Everything else (checkpoint, RAM tier,
SSD format, inspection) asks the codec named by the layer's `LayerState.kind`.

A layer's arrays are `Segment`s along the token axis (borrowed.py): one for every kind but plain and
quantized KV, whose borrowers keep the lender's segments and add their own, so a branch of a cached
document holds the document once. RAM accounting counts a segment's `Buffer` once.

Immutability: mlx-lm caches update by slice assignment, which rebinds the array object it is applied
to; two owners of one array object would see each other's writes, so capture and lend always hand
out new array objects (views: no copy until someone writes).
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models import cache as lm_cache

from .borrowed import BorrowedKVCache, BorrowedQuantizedKVCache, cut_segments, to_merge
from .layers import LayerState, fresh as _fresh, own as _own, seq as _seq
from ..errors import UnsupportedCache  # noqa: F401 (raised here; defined in errors.py)


class Codec:
    kind = ""
    roles: tuple = ()  # names of the arrays, for inspection
    always_cuttable = False  # any live state can be cut back to any shorter prefix
    hit = "a copy of the cached state"  # what a borrower of this kind holds after a hit (%model info)
    shares_prefix = False  # batch rows over one lent prefix of this kind attend to it once (kv/cascade.py)
    segmented = False  # its state is segments along the token axis, lent ones kept shared (Checkpoint.sharing)
    grows_in_place = False  # restored with room (layers.growth_room): the borrower taking it over appends there
    unmovable = "its cache kind"  # why its keys cannot be rotated to other positions (passages); "": they can

    def capture(self, c: Any, copy: bool = False) -> LayerState:
        """The state of live cache `c`: views, or (copy) copies of what it may still write."""
        raise NotImplementedError

    def lend(self, layer: LayerState, n: int) -> Any:
        raise NotImplementedError

    def trimmable(self, meta: dict) -> bool:
        """Whether a state with these scalars can serve a shorter prefix of itself."""
        return False

    def min_reusable_offset(self, meta: dict) -> int:
        """The shortest prefix this state can serve (an irreversible transition sets it)."""
        return 0

    def linear(self, meta: dict) -> bool:
        """Whether every array holds positions [0, offset) along axis -2 (token spans: SSD blocks)."""
        return False

    def linear_arrays(self, layer: LayerState) -> tuple:
        """Per array: whether it is a token span (see `linear`); inline state otherwise."""
        return (self.linear(layer.meta),) * len(layer.slots())

    def meta_at(self, meta: dict, n: int) -> dict:
        """The scalars of a linear state cut to its first n positions (a remote prefix)."""
        if not self.linear(meta):
            raise ValueError(f"{self.kind} state is not a token span")
        return dict(meta, offset=n)

    def cut(self, layer: LayerState, n: int) -> LayerState:
        """The first n positions of a trimmable state, sharing its buffers."""
        return LayerState(self.kind, cut_segments(layer.segments, n), self.meta_at(layer.meta, n))

    def can_hand_over(self, layer: LayerState) -> bool:
        return False

    def rebuilt(self, arrays: tuple, meta: dict, parents: tuple = ()) -> LayerState:
        """A layer from arrays read back from storage (the first positions of `parents`, if given)."""
        return LayerState.whole(self.kind, arrays, meta, parents)

    def hand_over(self, layer: LayerState, n: int, in_place: bool, keep: int = 0) -> Any:
        raise ValueError(f"{self.kind} cannot hand over its buffers")

    # --- questions about live caches (kv/caches.py asks them for a model's list) ---

    def inner(self, c: Any) -> list:
        """The live caches nested in `c` (a CacheList's parts)."""
        return []

    def batch_blockers(self, c: Any) -> list[str]:
        """Why mlx-lm's BatchGenerator cannot merge `c` ([] when it can)."""
        return [self.kind]

    def quantized(self, c: Any, bits: int, group_size: int) -> Any:
        """`c` as an empty cache whose KV is quantized from the first token (or `c` itself)."""
        return c

    def empty_like(self, c: Any) -> Any:
        """An empty mlx-lm cache configured as `c` (maybe mlx-vlm's class of that name), or `c`."""
        return c

    def published(self, lent: list, own: tuple, n: int, meta: dict | None = None) -> LayerState:
        """The state of n positions: `lent` segments (shared) and then `own` arrays (a batch row's)."""
        return LayerState(self.kind, tuple(lent) + (_own(own, (), False) if own else ()), {"offset": n, **(meta or {})})


class PlainKV(Codec):
    """`KVCache`: keys/values grow by slice assignment into a padded buffer. Borrowers get a
    `BorrowedKVCache` over the layer's segments: a loan copies nothing; the first append copies
    the prefix into the borrower's own buffer; what it publishes shares the lent segments."""

    kind, roles = "KVCache", ("keys", "values")
    always_cuttable = segmented = grows_in_place = True
    hit = ("the cached prefix shared, copied once into a buffer of its own at its first append (none when it takes "
           "the entry's place: a rerun, a restore); then mlx-lm's KVCache and the model's own attention")
    shares_prefix = True
    unmovable = ""

    def capture(self, c, copy=False):
        if isinstance(c, BorrowedKVCache):
            shared, own, parents = borrowed_parts(c)
        else:
            shared, own, parents = [], (), ()
            if c.keys is not None and c.offset:
                own, parents = (_seq(c.keys, c.offset), _seq(c.values, c.offset)), (c.keys, c.values)
        segments = tuple(shared) + (_own(own, parents, copy) if own else ())
        return LayerState(self.kind, segments, {"offset": int(c.offset) if segments else 0})

    def lend(self, layer, n):
        return BorrowedKVCache(cut_segments(layer.segments, n), merge=lm_cache.BatchKVCache.merge)

    def trimmable(self, meta):
        return True

    linear = can_hand_over = trimmable

    def batch_blockers(self, c):
        return []

    def quantized(self, c, bits, group_size):
        return lm_cache.QuantizedKVCache(group_size=group_size, bits=bits)

    def empty_like(self, c):
        return lm_cache.KVCache()

    def hand_over(self, layer, n, in_place, keep=0):
        """For a borrower that takes this state's place at n positions. in_place (nothing else holds
        the buffers, and positions past n may go): with the first n positions in the first segment,
        the borrower appends into its whole buffers from position n on, never below `keep`."""
        merge, first = lm_cache.BatchKVCache.merge, layer.segments[0] if layer.segments else None
        if in_place and first is not None and first.parents and n <= first.length:
            return BorrowedKVCache(hand_over=first, offset=n, merge=merge, keep=keep)
        return BorrowedKVCache(cut_segments(layer.segments, n), merge=merge)


class QuantizedKV(Codec):
    """`QuantizedKVCache`: (packed, scales, biases) for keys and for values; borrowers as plain KV's."""

    kind, roles = "QuantizedKVCache", ("keys", "keys_scales", "keys_biases", "values", "values_scales", "values_biases")
    unmovable = "quantized KV (kv_bits)"
    always_cuttable = segmented = True
    hit = "the cached prefix shared, copied once into a buffer of its own at its first append; then QuantizedKVCache"

    def capture(self, c, copy=False):
        n = int(c.offset)
        since = int(getattr(c, "quantized_from", 0))  # converted at that length (kv/quantize_start.py)
        meta = {"offset": n, "group_size": int(c.group_size), "bits": int(c.bits), **({"from": since} if since else {})}
        if isinstance(c, BorrowedQuantizedKVCache):
            shared, own, parents = borrowed_parts(c)
            segments = tuple(shared) + (_own(own, parents, copy) if own else ())
        elif c.keys is None:
            segments = ()
        else:
            whole = (*c.keys, *c.values)
            segments = _own(tuple(_seq(a, n) for a in whole), whole, copy)
        return LayerState(self.kind, segments, meta if segments else dict(meta, offset=0))

    def lend(self, layer, n):
        m = layer.meta
        return BorrowedQuantizedKVCache(cut_segments(layer.segments, n), group_size=m["group_size"], bits=m["bits"],
                                        quantized_from=m.get("from", 0))

    def min_reusable_offset(self, meta):
        return int(meta.get("from", 0))  # shorter prefixes were full precision in the run that made it

    def trimmable(self, meta):
        return True

    def linear(self, meta):
        return True


class RotatingKV(Codec):
    """`RotatingKVCache`: a sliding-window ring; linear in time until it wraps.

    Once wrapped, the ring (with its write index) is the exact state of one
    offset only: not trimmable.
    """

    kind, roles, unmovable = "RotatingKVCache", ("keys", "values"), "sliding-window attention"
    hit = "views of the cached window, copied by its first append (exact boundaries once it wrapped)"

    def capture(self, c, copy=False):
        n = int(c.offset)
        meta = {"offset": n, "keep": int(c.keep), "max_size": int(c.max_size), "idx": int(c._idx)}
        if c.keys is None:
            return LayerState(self.kind, (), meta)
        parents = (c.keys, c.values)
        if n < c.max_size:  # not wrapped: the buffer is linear in time
            meta["idx"] = n
            return LayerState(self.kind, _own((_seq(c.keys, n), _seq(c.values, n)), parents, copy), meta)
        return LayerState(self.kind, _own((_fresh(c.keys), _fresh(c.values)), parents, copy), meta)

    def lend(self, layer, n):
        m, arrays = layer.meta, layer.arrays
        c = lm_cache.RotatingKVCache(max_size=m["max_size"], keep=m["keep"])
        if arrays:
            if m["offset"] >= m["max_size"]:  # wrapped: exact only (can_serve checked n)
                c.keys, c.values, c._idx = _fresh(arrays[0]), _fresh(arrays[1]), m["idx"]
            else:
                c.keys, c.values, c._idx = _seq(arrays[0], n), _seq(arrays[1], n), n
            c.offset = n
        return c

    def trimmable(self, meta):
        return meta.get("offset", 0) < meta.get("max_size", 0)

    def batch_blockers(self, c):
        return [f"{self.kind}(keep={c.keep})"] if c.keep else []

    def empty_like(self, c):
        return lm_cache.RotatingKVCache(max_size=c.max_size, keep=c.keep)

    def linear(self, meta):  # until the ring wraps
        return self.trimmable(meta)

    def meta_at(self, meta, n):
        return dict(super().meta_at(meta, n), idx=n)


class ChunkedKV(Codec):
    """`ChunkedKVCache`: keeps the current attention chunk; drops the front as chunks fill.

    Trimmable only while nothing was dropped (start_position 0): a cut
    further back would lack keys a cold run at that length still has.
    """

    kind, roles, unmovable = "ChunkedKVCache", ("keys", "values"), "chunked attention"
    hit = "views of the cached chunk, copied by its first append"

    def capture(self, c, copy=False):
        n, start = int(c.offset), int(c.start_position)
        meta = {"offset": n, "chunk_size": int(c.chunk_size), "start_position": start}
        if c.keys is None:
            return LayerState(self.kind, (), meta)
        own = (_seq(c.keys, n - start), _seq(c.values, n - start))
        return LayerState(self.kind, _own(own, (c.keys, c.values), copy), meta)

    def lend(self, layer, n):
        m, arrays = layer.meta, layer.arrays
        c = lm_cache.ChunkedKVCache(m["chunk_size"])
        c.start_position = m["start_position"]
        if arrays:
            c.keys, c.values = _seq(arrays[0], n - c.start_position), _seq(arrays[1], n - c.start_position)
        c.offset = n if arrays else 0
        return c

    def trimmable(self, meta):
        return meta.get("start_position", 0) == 0

    def linear(self, meta):  # until the front is dropped
        return self.trimmable(meta)


class Recurrent(Codec):
    """`ArraysCache` / `MambaCache`: recurrent or convolution state, exact boundaries only.

    Models replace these arrays (`cache[0] = ...`) rather than writing into
    them, so sharing them between owners is safe.
    """

    hit, unmovable = "the recurrent state as stored (exact boundaries only)", "recurrent layers"

    def __init__(self, kind: str, batchable: bool = False):
        self.kind, self.batchable = kind, batchable

    def batch_blockers(self, c):
        return [] if self.batchable else [self.kind]

    def capture(self, c, copy=False):
        present = [i for i, a in enumerate(c.cache) if a is not None]
        arrays = tuple(_fresh(c.cache[i]) for i in present)
        meta = {"size": len(c.cache), "present": present}
        return LayerState(self.kind, _own(arrays, (), copy) if arrays else (), meta)

    def lend(self, layer, n):
        c = getattr(lm_cache, self.kind)(layer.meta["size"])
        for i, a in zip(layer.meta["present"], layer.arrays):
            c.cache[i] = _fresh(a)
        return c


class Composite(Codec):
    """`CacheList`: several caches in one layer (e.g. attention beside a recurrent mixer)."""

    kind = "CacheList"

    def capture(self, c, copy=False):
        parts = tuple(capture_layer(x, copy) for x in c.caches)
        offsets = [p.meta["offset"] for p in parts if "offset" in p.meta]
        meta = {"parts": [p.to_json() for p in parts]}
        if offsets:
            meta["offset"] = max(offsets)
        return LayerState(self.kind, (), meta, parts)

    def inner(self, c):
        return list(c.caches)

    def batch_blockers(self, c):
        return [b for x in c.caches for b in (CODECS[kind_of(x)].batch_blockers(x) if kind_of(x) in CODECS
                                              else [kind_of(x)])]

    def rebuilt(self, arrays, meta, parents=()):
        parts, i = [], 0
        for spec in meta["parts"]:
            k = int(spec["arrays"])
            parts.append(codec(spec["kind"]).rebuilt(tuple(arrays[i : i + k]), dict(spec["meta"])))
            i += k
        return LayerState(self.kind, (), meta, tuple(parts))

    def cut(self, layer, n):
        parts = tuple(codec(p.kind).cut(p, n) for p in layer.parts)
        return LayerState(self.kind, (), self.meta_at(layer.meta, n), parts)

    def lend(self, layer, n):
        return lm_cache.CacheList(*(codec(p.kind).lend(p, n) for p in layer.parts))

    def trimmable(self, meta):
        return all(codec(p["kind"]).trimmable(p["meta"]) for p in meta["parts"])

    def linear_arrays(self, layer):
        return tuple(flag for p in layer.parts for flag in codec(p.kind).linear_arrays(p))

    def linear(self, meta):
        return all(codec(p["kind"]).linear(p["meta"]) for p in meta["parts"])

    def meta_at(self, meta, n):
        parts = [dict(p, meta=codec(p["kind"]).meta_at(p["meta"], n)) for p in meta["parts"]]
        return dict(meta, parts=parts, offset=n)

    def min_reusable_offset(self, meta):
        return max((codec(p["kind"]).min_reusable_offset(p["meta"]) for p in meta["parts"]), default=0)


CODECS = {c.kind: c for c in (PlainKV(), QuantizedKV(), RotatingKV(), ChunkedKV(), Recurrent("ArraysCache", batchable=True),
                              Recurrent("MambaCache"), Composite())}
# a borrower's live caches: captured as the kinds they borrowed from
CODECS["BorrowedKVCache"], CODECS["BorrowedQuantizedKVCache"] = CODECS["KVCache"], CODECS["QuantizedKVCache"]


def borrowed_parts(c: BorrowedKVCache) -> tuple:
    """What a borrower publishes: (the lent segments it shares, views of its own positions after
    them, the buffers those views cut). Short trailing lent segments are folded into its own
    positions (borrowed.to_merge), which the live buffer holds too."""
    lent = c.lent_segments()
    if not c.buffers:  # never appended: the loan as it was
        return lent, (), ()
    held = sum(s.length for s in lent)
    shared = lent[: len(lent) - to_merge(lent, c.offset - held)]
    return shared, c.own_views(sum(s.length for s in shared)), c.buffers


def codec(kind: str) -> Codec:
    try:
        return CODECS[kind]
    except KeyError:
        raise UnsupportedCache(f"cache class {kind} is not supported by the prompt cache") from None


def kind_of(c: Any) -> str:
    return type(c).__name__


def capture_layer(c: Any, copy: bool = False) -> LayerState:
    """The exact state of one live cache (new array objects; copy: of what it may still write)."""
    return codec(kind_of(c)).capture(c, copy)


def layout_at(layout: list[dict], n: int) -> list[dict]:
    """A checkpoint layout (Checkpoint.layout()) of linear layers, cut to n positions."""
    return [dict(spec, meta=codec(spec["kind"]).meta_at(spec["meta"], n)) for spec in layout]


def make_caches(model) -> list:
    """Empty live caches for a model, as mlx-lm makes them."""
    return lm_cache.make_prompt_cache(model)


def plain_caches(n: int) -> list:
    """n empty plain KV caches (a model without a cache maker of its own)."""
    return [lm_cache.KVCache() for _ in range(n)]
