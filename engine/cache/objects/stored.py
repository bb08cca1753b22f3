"""An object as the tiers hold it: a checkpoint with no tokens and no KV layers in a namespace of its own
(its key digest), its leaves as attachments; on SSD each leaf's bytes in CHUNK_BYTES chunks, each with its
BLAKE3, read back straight into the leaf's MLX buffer (`ObjectRead`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ...kv.checkpoint import Checkpoint, HostTensor
from ...kv.tokens import token_key
from .values import leaf_nbytes, leaf_specs, stored_leaf, unflatten

REVISION = 1  # of the stored object layout; another revision's files are misses
CHUNK_BYTES = 4 << 20  # read and verified two at a time; benchmarks/bench_objects.py chose it
NO_TOKENS = _NO_TOKENS = ()
FILE_KEY = token_key(_NO_TOKENS)  # the key of every object file (an empty token sequence)
_CHUNK_RE = re.compile(r"attachments\.(\d{6})\.(\d{5})")


@dataclass(frozen=True, eq=False)
class ObjectValue(Checkpoint):
    """An object as the RAM tier holds it: no tokens, no layers, one attachment per leaf."""

    tree: dict | None = None

    @classmethod
    def of(cls, tree: dict, leaves: list) -> "ObjectValue":
        attachments = {f"{i:06d}": a for i, a in enumerate(leaves)}
        return cls(tokens=_NO_TOKENS, layers=(), nbytes=sum(int(a.nbytes) for a in leaves), attachments=attachments,
                   tree=tree)

    @property
    def trimmable(self) -> bool:
        return False

    def can_serve(self, n: int) -> bool:
        return False  # never a language-model prefix

    def layout(self) -> list[dict]:
        return [{"kind": "object", "tree": self.tree}]

    def value(self):
        return unflatten(self.tree, [self.attachments[k] for k in sorted(self.attachments)])

    def host_tensors(self) -> list[HostTensor]:
        """Each leaf's bytes in CHUNK_BYTES pieces (zero-copy uint8 views), in leaf order."""
        out = []
        for name in sorted(self.attachments):
            flat = self.attachments[name].reshape(-1)
            flat = flat if flat.dtype == mx.uint8 else flat.view(mx.uint8)
            mx.eval(flat)
            view = np.asarray(flat)
            for j, lo in enumerate(range(0, view.nbytes, CHUNK_BYTES)):
                chunk = view[lo: lo + CHUNK_BYTES]
                out.append(HostTensor(f"attachments.{name}.{j:05d}", "uint8", (chunk.nbytes,), chunk))
        return out


class ObjectRead:
    """One object read: an MLX buffer per leaf, the stored chunks read into slices of it."""

    def __init__(self, header):
        self.header = header
        self.slices: dict | None = None

    def allocate(self, name: str, dtype: str, shape) -> np.ndarray:
        if self.slices is None:
            self._plan()
        leaf, lo, n = self.slices[name]
        return self.views[leaf][lo: lo + n]

    def _plan(self) -> None:
        """Check the tree against the chunks (sizes bounded by the file) before allocating."""
        layout = self.header.layout
        if not (len(layout) == 1 and isinstance(layout[0], dict) and layout[0].get("kind") == "object"):
            raise ValueError("not an object manifest")
        self.tree = layout[0].get("tree")
        self.specs = leaf_specs(self.tree)
        sizes = [leaf_nbytes(*s) for s in self.specs]
        chunks = []
        for t in self.header.tensors:
            m = _CHUNK_RE.fullmatch(t.name)
            if m is None or t.dtype != "uint8" or t.span or len(t.shape) != 1:
                raise ValueError(f"object chunk {t.name!r} is malformed")
            chunks.append((int(m[1]), int(m[2]), t.name, t.raw_bytes))
        got, slices = [0] * len(sizes), {}
        for leaf, j, name, n in sorted(chunks):
            if leaf >= len(sizes) or j != sum(1 for s in slices.values() if s[0] == leaf):
                raise ValueError("object chunks do not match its tree")
            slices[name] = (leaf, got[leaf], n)
            got[leaf] += n
        if got != sizes:
            raise ValueError("object chunks do not cover its arrays")
        self.buffers = [mx.empty((n,), dtype=mx.uint8) for n in sizes]
        mx.eval(self.buffers)
        self.views = [np.asarray(b) for b in self.buffers]
        self.slices = slices

    def build(self, header) -> ObjectValue:
        if self.slices is None:  # no chunks at all (no arrays, or only empty ones)
            self._plan()
        leaves = [stored_leaf(*spec, buf) for spec, buf in zip(self.specs, self.buffers)]
        mx.eval(leaves)
        self.views = []
        return ObjectValue.of(self.tree, leaves)
