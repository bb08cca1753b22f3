"""What remote bytes become: checked layouts, and checkpoints rebuilt from verified values.

Two shapes of remote state (remote/records.py):

- token spans: the layout of a chain record names the span tensors and the
  layers; `parse_layout` checks it whole (types, names, bounded shapes, the
  codecs' own cut to n tokens) before anything is sized from it, and
  `build_spans` copies verified blocks straight into MLX buffers.
- an exact checkpoint: its manifest (an SSD format-2 file, sent whole, encrypted like every value),
  parsed by the SSD format's own reader from a private temporary file and
  checked again here (raw tensors only, every size recomputed in Python
  integers, tokens and namespace as asked), its inline state read and
  verified by the SSD reader, its spans from verified blocks.

Everything here runs on the owner thread, after the values were read with
their sizes bounded and their names verified (remote/tier.py). A layout or
manifest this build cannot use is None: a miss, never an exception.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tempfile
from typing import Sequence

import mlx.core as mx
import numpy as np

from ...kv.checkpoint import Checkpoint
from ...kv.codecs import CODECS, layout_at
from .records import MAX_VALUE_BYTES
from ..ssd import blocks
from ..ssd import format as fmt
from ..ssd import tensor_read as reader
from ..ssd.restore import empty_buffer

MAX_LAYERS = 4096
MAX_ARRAYS = 64  # per layer (a composite layer holds its parts' arrays)
MAX_DIM = 1 << 24
MAX_RANK = 8
_INT32_MAX = 2**31 - 1
_TENSOR_NAME = re.compile(r"layers\.([0-9]{1,4})\.([0-9]{1,2})")


@dataclasses.dataclass(frozen=True)
class SpanLayout:
    specs: tuple  # (name, dtype, shape of one full block's slice)
    layers: list  # the codecs' layer specs (kind, arrays, meta)
    data_bytes: int  # tensor bytes of one full block (its header excluded)
    block_tokens: int
    min_reusable_offset: int = 0  # the shortest length it serves (KV converted at kv_start: that start)

    def block_bytes(self, index: int) -> int:
        """The exact size of full block `index`: its header (which names its span) and data."""
        a = index * self.block_tokens
        return len(blocks.header(a, a + self.block_tokens, self.specs)) + self.data_bytes

    def layers_at(self, n: int) -> list | None:
        """The layers cut to n tokens by their codecs; None when the codecs refuse these metas."""
        try:
            return layout_at(self.layers, n)
        except Exception:  # noqa: BLE001 - codec metas from another build may be anything: a miss
            return None


def _int(v, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _plain(v, depth: int = 0) -> bool:
    """JSON of small non-negative ints, short strings, lists and dicts, nested at most 8 deep."""
    if depth > 8:
        return False
    if type(v) is int:
        return 0 <= v < 2**31
    if type(v) is bool or v is None:
        return True
    if type(v) is str:
        return len(v) <= 64
    if type(v) is list:
        return len(v) <= 256 and all(_plain(x, depth + 1) for x in v)
    if type(v) is dict:
        return len(v) <= 64 and all(type(k) is str and len(k) <= 64 and _plain(x, depth + 1) for k, x in v.items())
    return False


def _itemsize(dtype) -> int | None:
    try:
        return fmt.host_dtype(dtype).itemsize if type(dtype) is str else None
    except ValueError:
        return None


def _bytes_of(shape, itemsize: int) -> int:
    n = itemsize
    for d in shape:
        n *= d  # Python integers: a forged shape cannot wrap around to a small size
    return n


def _no_floats(text):
    raise ValueError(f"no floats or constants in a layout: {text[:20]!r}")


def parse_layout(layout, block_tokens: int) -> SpanLayout | None:
    """The span layout of a chain record (its JSON bytes, or the parsed value), or None if it is
    not one this build can rebuild."""
    if isinstance(layout, bytes):
        try:  # deep nesting (RecursionError), huge integers, bad UTF-8: a miss
            layout = json.loads(layout, parse_float=_no_floats, parse_constant=_no_floats)
        except Exception:  # noqa: BLE001 - a record verified by its MAC can still come from another build
            return None
    if type(layout) is not dict or type(layout.get("tensors")) is not list or type(layout.get("layers")) is not list:
        return None
    layers, offset = layout["layers"], layout.get("min_reusable_offset", 0)
    if not 0 < len(layers) <= MAX_LAYERS or not _int(offset, 0, _INT32_MAX):
        return None
    expected = set()
    for i, spec in enumerate(layers):
        if not (type(spec) is dict and type(spec.get("kind")) is str and spec["kind"] in CODECS
                and _int(spec.get("arrays"), 0, MAX_ARRAYS)
                and type(spec.get("meta")) is dict and _plain(spec["meta"])):
            return None
        expected.update(f"layers.{i}.{j}" for j in range(spec["arrays"]))
    specs, data = [], 0
    for t in layout["tensors"]:
        if type(t) is not list or len(t) != 3:
            return None
        name, dtype, shape = t
        size = _itemsize(dtype)
        if (type(name) is not str or not _TENSOR_NAME.fullmatch(name) or size is None or type(shape) is not list
                or not 2 <= len(shape) <= MAX_RANK or not all(_int(d, 1, MAX_DIM) for d in shape)
                or shape[-2] != block_tokens):
            return None
        specs.append((name, dtype, tuple(shape)))
        data += _bytes_of(shape, size)
        if data > MAX_VALUE_BYTES:
            return None
    if [s[0] for s in specs] and {s[0] for s in specs} == expected and len(specs) == len(expected):
        return SpanLayout(tuple(specs), layers, data, block_tokens, offset)
    return None


def build_spans(tokens: Sequence[int], layout: SpanLayout, layers: list, values: list[bytes],
                names: list[str]) -> Checkpoint:
    """A checkpoint of len(values) full blocks, copied from their (already verified) values."""
    n, bt = len(tokens), layout.block_tokens
    arrays = {name: (empty_buffer(dtype, (*shape[:-2], n, shape[-1])), dtype) for name, dtype, shape in layout.specs}
    mx.eval([a for a, _ in arrays.values()])
    views = [np.asarray(a) for a, _ in arrays.values()]
    for i, (value, name) in enumerate(zip(values, names)):
        a, b = i * bt, (i + 1) * bt
        blocks.fill_from_value(value, name, blocks.header(a, b, layout.specs), [v[..., a:b, :] for v in views])
    tensors = {k: a.view(mx.bfloat16) if d == "bfloat16" else a for k, (a, d) in arrays.items()}
    return Checkpoint.from_tensors(tokens, layers, tensors, min_reusable_offset=layout.min_reusable_offset)


class Manifest:
    """An exact checkpoint's manifest, parsed and checked; `build` rebuilds it. Close when done."""

    def __init__(self, value: bytes, namespace: str, tokens: Sequence[int]):
        """Raises ValueError (a miss) for any manifest that is not this exact state, checked in full."""
        self._file = tempfile.TemporaryFile()
        try:
            self._file.write(value)
            self._file.flush()
            try:
                h = fmt.read_header(self._file.fileno())
            except Exception as e:  # noqa: BLE001 - the SSD parser's every complaint is a miss here
                raise ValueError(f"not a checkpoint manifest ({type(e).__name__}: {str(e)[:120]})") from None
            _check_manifest(h, namespace, tuple(int(t) for t in tokens), len(value))
        except BaseException:
            self.close()
            raise
        self.header = h

    def block_items(self) -> list[tuple[str, int]]:
        return [(b.name, b.nbytes) for b in self.header.blocks]

    def build(self, values: list[bytes]) -> Checkpoint:
        """The checkpoint, from the manifest's inline tensors and the blocks' verified values."""
        h = self.header
        arrays = {t.name: (empty_buffer(t.dtype, t.shape), t.dtype) for t in h.tensors}
        mx.eval([a for a, _ in arrays.values()])
        views = {k: np.asarray(a) for k, (a, _) in arrays.items()}
        inline = dataclasses.replace(h, tensors=h.inline, blocks=())
        reader.fill(self._file.fileno(), inline, {t.name: views[t.name] for t in h.inline})
        spans = h.span_tensors
        specs = [(t.name, t.dtype, t.shape) for t in spans]
        for ref, value in zip(h.blocks, values, strict=True):
            dst = [views[t.name][..., ref.start:ref.end, :] for t in spans]
            blocks.fill_from_value(value, ref.name, blocks.header(ref.start, ref.end, specs), dst)
        tensors = {k: a.view(mx.bfloat16) if d == "bfloat16" else a for k, (a, d) in arrays.items()}
        return Checkpoint.from_tensors(h.tokens, h.layout, tensors, min_reusable_offset=h.min_reusable_offset)

    def close(self) -> None:
        self._file.close()


def _check_manifest(h: fmt.Header, namespace: str, tokens: tuple, size: int) -> None:
    if h.version != fmt.FORMAT_VERSION or h.namespace != namespace or h.tokens != tokens:
        raise ValueError("the manifest is not the state of this prompt in this namespace")
    inline = 0
    for t in h.tensors:
        itemsize = _itemsize(t.dtype)
        if (itemsize is None or not 1 <= len(t.shape) <= MAX_RANK or not all(_int(d, 0, MAX_DIM) for d in t.shape)
                or _bytes_of(t.shape, itemsize) != t.raw_bytes or (not t.span and t.codec != "raw")):
            raise ValueError(f"tensor {t.name[:40]!r} of the manifest is not a raw tensor of its stated size")
        inline += 0 if t.span else t.raw_bytes
    span = sum(t.raw_bytes for t in h.span_tensors)
    if inline > size or span > sum(b.nbytes for b in h.blocks) or any(b.nbytes > MAX_VALUE_BYTES for b in h.blocks):
        raise ValueError("the manifest's tensors do not fit in its bytes and blocks")
    if not _plain(h.layout) or len(h.layout) > MAX_LAYERS:
        raise ValueError("the manifest's layout is not one this build reads")
