"""Object values and keys, without the cache: what `ObjectCache` (cache.py) stores and finds.

A **value** is an `mx.array`, a numpy array, or a dict / list / tuple of them,
nested; numbers, strings, None, bools and numpy scalars may sit beside the
arrays. `flatten(value)` returns a JSON tree (structure, each leaf's kind,
dtype and shape) and the leaves as evaluated MLX arrays; `unflatten(tree,
leaves)` gives the value back with the same kinds, dtypes (bfloat16 too),
shapes, containers and dict order. MLX leaves are kept as they are (MLX
arrays are immutable values: the cache holds its own array object over the
same buffer); numpy leaves are copied once into an MLX uint8 buffer of their
bytes, so the caller may change its array afterwards, and any numeric numpy
dtype round-trips (float64 and big-endian included).

A **key** is any value `digest(key)` can encode: str, bytes, int, float,
bool, None, arrays (by dtype, shape and bytes), numpy scalars, and tuples /
lists / dicts of them (dicts by their items, whatever their order). Types
are part of the encoding (1, 1.0, True, "1" and b"1" are five keys; a list
is not a tuple, an mx.array is not a numpy array). The key is hashed with
BLAKE3 into 64 hex digits; nothing of it is used as a path. Anything else
raises `Unkeyable`, which names where in the key it sits.

Plain code on the MLX owner thread; no cache, no I/O.
"""

from __future__ import annotations

import struct
from typing import Any

import blake3
import mlx.core as mx
import numpy as np
from ...errors import Unkeyable, Unstorable  # noqa: F401 (raised here; defined in errors.py)

NUMPY_KINDS = "biufcSUmM"  # numpy dtype kinds stored (not object or void: their bytes are not the value)
_CONTAINERS = {list: "list", tuple: "tuple"}



# --- values ------------------------------------------------------------------


def mx_dtype_name(dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _mx_dtype(name: str):
    dt = getattr(mx, "bool_" if name == "bool" else name, None)
    if not isinstance(dt, mx.Dtype):
        raise ValueError(f"unknown MLX dtype {name!r}")
    return dt


def flatten(value) -> tuple[dict, list]:
    """(tree, leaves): the JSON-able structure of `value` and its arrays as evaluated MLX arrays.

    Raises Unstorable for anything else (the message says what and where).
    """
    leaves: list = []
    tree = _node(value, leaves, "value")
    mx.eval(leaves)
    return tree, leaves


def _node(v, leaves: list, where: str) -> dict:
    if isinstance(v, mx.array):
        leaves.append(v.reshape(v.shape))  # our own array object: a caller's `a[i] = x` rebinds only theirs
        return {"mx": len(leaves) - 1, "dtype": mx_dtype_name(v.dtype), "shape": list(v.shape)}
    if isinstance(v, (np.ndarray, np.generic)):
        a = np.asarray(v)
        if a.dtype.kind not in NUMPY_KINDS:
            raise Unstorable(f"{where} is a numpy array of dtype {a.dtype}, which cannot be stored exactly")
        leaves.append(mx.array(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))  # a copy of its bytes
        kind = "np" if isinstance(v, np.ndarray) else "npscalar"
        return {kind: len(leaves) - 1, "dtype": a.dtype.str, "shape": list(a.shape)}
    if v is None or isinstance(v, (bool, int, str)):
        return {"py": v}
    if isinstance(v, float):
        return {"float": v.hex()}
    if type(v) in _CONTAINERS:
        return {_CONTAINERS[type(v)]: [_node(x, leaves, f"{where}[{i}]") for i, x in enumerate(v)]}
    if type(v) is dict:
        items = []
        for k, x in v.items():
            if not (k is None or isinstance(k, (bool, int, float, str))):
                raise Unstorable(f"{where} has a key of type {type(k).__qualname__}: dict keys must be str, int, "
                                 "float, bool or None")
            items.append([_node(k, [], where), _node(x, leaves, f"{where}[{k!r}]")])
        return {"dict": items}
    raise Unstorable(f"{where} is a {type(v).__qualname__}: an object holds mx/numpy arrays, numbers, strings, "
                     "None and dicts/lists/tuples of them")


def leaf_specs(tree: dict) -> list[tuple[str, str, tuple]]:
    """(kind, dtype, shape) of every leaf in index order; ValueError for a malformed tree."""
    found: dict = {}
    _walk(tree, found, 0)
    if sorted(found) != list(range(len(found))):
        raise ValueError("object tree: leaf indexes are not 0..n-1")
    return [found[i] for i in range(len(found))]


def _walk(node, found: dict, depth: int) -> None:
    if not isinstance(node, dict) or not node or depth > 200:
        raise ValueError("object tree: malformed node")
    kind = next(iter(node))
    if kind in ("mx", "np", "npscalar"):
        i, dtype, shape = node[kind], node.get("dtype"), node.get("shape")
        ok = (len(node) == 3 and isinstance(i, int) and i not in found and isinstance(dtype, str)
              and isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape))
        if not ok:
            raise ValueError("object tree: malformed leaf")
        _mx_dtype(dtype) if kind == "mx" else _np_dtype(dtype)
        found[i] = (kind, dtype, tuple(shape))
        return
    value = node[kind]
    if len(node) != 1:
        raise ValueError("object tree: malformed node")
    if kind in ("list", "tuple") and isinstance(value, list):
        for x in value:
            _walk(x, found, depth + 1)
    elif kind == "dict" and isinstance(value, list):
        for item in value:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], dict)
                    and next(iter(item[0]), None) in ("py", "float")):
                raise ValueError("object tree: malformed dict item")
            _walk(item[0], found, depth + 1)
            _walk(item[1], found, depth + 1)
    elif kind == "py" and not (value is None or isinstance(value, (bool, int, str))):
        raise ValueError("object tree: malformed scalar")
    elif kind == "float":
        try:
            float.fromhex(value)
        except (TypeError, ValueError):
            raise ValueError("object tree: malformed float") from None
    elif kind not in ("py", "float"):
        raise ValueError(f"object tree: unknown node {kind!r}")


def _np_dtype(s: str) -> np.dtype:
    try:
        dt = np.dtype(s)
    except TypeError:
        raise ValueError(f"object tree: bad numpy dtype {s!r}") from None
    if dt.kind not in NUMPY_KINDS:
        raise ValueError(f"object tree: numpy dtype {s!r} is not stored")
    return dt


def leaf_nbytes(kind: str, dtype: str, shape: tuple) -> int:
    itemsize = _mx_dtype(dtype).size if kind == "mx" else _np_dtype(dtype).itemsize
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def stored_leaf(kind: str, dtype: str, shape: tuple, buf: mx.array) -> mx.array:
    """The leaf to hold in RAM from the uint8 buffer of its bytes (read back from SSD)."""
    return buf.view(_mx_dtype(dtype)).reshape(shape) if kind == "mx" else buf


def unflatten(tree: dict, leaves: list):
    """The value of `tree` over `leaves` (from flatten, or rebuilt from storage): fresh objects.

    MLX leaves come back as new array objects over the same (immutable)
    buffers; numpy leaves as read-only views of the cache's buffers (they
    cannot be made writable: `np.array(x)` gives a writable copy).
    """
    kind = next(iter(tree))
    if kind == "mx":
        a = leaves[tree["mx"]]
        return a.reshape(a.shape)
    if kind in ("np", "npscalar"):
        a = _numpy_view(leaves[tree[kind]], np.dtype(tree["dtype"]), tuple(tree["shape"]))
        return a[()] if kind == "npscalar" else a
    if kind == "py":
        return tree["py"]
    if kind == "float":
        return float.fromhex(tree["float"])
    if kind == "list":
        return [unflatten(x, leaves) for x in tree["list"]]
    if kind == "tuple":
        return tuple(unflatten(x, leaves) for x in tree["tuple"])
    return {unflatten(k, leaves): unflatten(x, leaves) for k, x in tree["dict"]}


def _numpy_view(buf: mx.array, dtype: np.dtype, shape: tuple) -> np.ndarray:
    if buf.size == 0:
        a = np.empty(shape, dtype)
    else:  # the memoryview keeps the MLX buffer alive after the cache lets it go
        a = np.frombuffer(memoryview(buf).toreadonly(), dtype=dtype).reshape(shape)
    a.flags.writeable = False
    return a


def describe(tree: dict, limit: int = 60) -> str:
    """A short summary for listings: `float32[1000x256]`, `tuple(2 arrays)`, ..."""
    specs = leaf_specs(tree)
    kind = next(iter(tree))
    if kind in ("mx", "np", "npscalar"):
        _, dtype, shape = specs[0]
        text = f"{'np.' if kind != 'mx' else ''}{np.dtype(dtype).name if kind != 'mx' else dtype}"
        text += f"[{'x'.join(map(str, shape))}]" if kind != "npscalar" else ""
    else:
        text = f"{kind}({len(specs)} array{'s' if len(specs) != 1 else ''})"
    return text[:limit]


# --- keys --------------------------------------------------------------------


def digest(key, where: str = "key") -> str:
    """The 64-hex BLAKE3 name of an exact key (see the module docstring); Unkeyable otherwise
    (its message starts with `where`, the name of the key in the caller's words)."""
    h = blake3.blake3(b"mlxcache object key v1\0")
    _feed(h, key, where)
    return h.hexdigest()


def _field(h, tag: bytes, data: bytes) -> None:
    h.update(tag + struct.pack("<Q", len(data)))
    h.update(data)


def _feed(h, v, where: str) -> None:
    if v is None:
        h.update(b"N")
    elif isinstance(v, bool):
        h.update(b"T" if v else b"F")
    elif isinstance(v, int):
        _field(h, b"i", str(int(v)).encode())
    elif isinstance(v, float):
        h.update(b"f" + struct.pack("<d", v))
    elif isinstance(v, str):
        _field(h, b"s", v.encode("utf-8", "surrogatepass"))
    elif isinstance(v, (bytes, bytearray, memoryview)):
        _field(h, b"b", bytes(v))
    elif isinstance(v, mx.array):
        a = v.view(mx.uint16) if v.dtype == mx.bfloat16 else v
        mx.eval(a)
        _array(h, b"M", mx_dtype_name(v.dtype), v.shape, np.asarray(a))
    elif isinstance(v, (np.ndarray, np.generic)):
        a = np.asarray(v)
        if a.dtype.kind not in NUMPY_KINDS:
            raise Unkeyable(where, v)
        _array(h, b"A" if isinstance(v, np.ndarray) else b"a", a.dtype.str, a.shape, a)
    elif type(v) in _CONTAINERS:
        h.update((b"[" if type(v) is list else b"(") + struct.pack("<Q", len(v)))
        for i, x in enumerate(v):
            _feed(h, x, f"{where}[{i}]")
    elif type(v) is dict:
        items = []
        for k, x in v.items():
            kh = blake3.blake3()
            _feed(kh, k, f"{where} key {k!r:.40}")
            items.append((kh.digest(), k, x))
        h.update(b"{" + struct.pack("<Q", len(items)))
        for kd, k, x in sorted(items, key=lambda t: t[0]):
            h.update(kd)
            _feed(h, x, f"{where}[{k!r:.40}]")
    else:
        raise Unkeyable(where, v)


def _array(h, tag: bytes, dtype: str, shape, a: np.ndarray) -> None:
    _field(h, tag, dtype.encode())
    h.update(struct.pack(f"<Q{len(shape)}Q", len(shape), *shape))
    a = np.ascontiguousarray(a)
    _field(h, b"", memoryview(a.reshape(-1).view(np.uint8)) if a.size else b"")
