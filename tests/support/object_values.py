"""Object values with every kind of leaf and container, and exact comparisons of them."""

import mlx.core as mx
import numpy as np

from mlxcache_kernel.engine.cache.objects.values import digest


def every_kind():
    """One value with every kind of leaf and container."""
    rng = np.random.default_rng(0)
    return {
        "f32": mx.array(rng.standard_normal((3, 5)).astype(np.float32)),
        "bf16": mx.array(rng.standard_normal(7).astype(np.float32)).astype(mx.bfloat16),
        "f16": mx.array(rng.standard_normal((2, 2)).astype(np.float16)),
        "i64": mx.array(np.arange(-3, 3, dtype=np.int64)),
        "u8": mx.array(np.arange(9, dtype=np.uint8).reshape(3, 3)),
        "bool": mx.array([True, False, True]),
        "c64": mx.array(np.array([1 + 2j, -3j], np.complex64)),
        "scalar": mx.array(2.5),
        "empty": mx.zeros((0, 4)),
        "strided": mx.arange(12, dtype=mx.float32).reshape(3, 4).T,
        "np_f64": rng.standard_normal((4, 3)),
        "np_big_endian": np.arange(5, dtype=">i4"),
        "np_bool": np.array([[True], [False]]),
        "np_c128": np.array([1 + 1j], np.complex128),
        "np_str": np.array(["a", "bcd"]),
        "np_0d": np.array(7, np.int16),
        "np_empty": np.zeros((2, 0), np.float32),
        "np_scalar": np.float32(1.25),
        "nested": [(mx.ones((2,)), np.zeros(3)), {"deep": [mx.array([1, 2], dtype=mx.int32)]}],
        "plain": (None, True, 3, 2**70, -0.0, float("inf"), "text ✓"),
        7: "an int key",
    }


def assert_same(a, b, where="value"):
    """Same kind, dtype, shape, bytes and structure (dict order included)."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, mx.array):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert np.array_equal(np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a),
                              np.asarray(b.view(mx.uint16) if b.dtype == mx.bfloat16 else b)), where
    elif isinstance(a, (np.ndarray, np.generic)):
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b), where
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert a.hex() == b.hex(), where  # -0.0 stays -0.0
    else:
        assert a == b, where


def fingerprint(value) -> str:
    """A digest of a value's exact contents and kinds (values.digest keys by kind, dtype, shape, bytes)."""
    return digest(value)
