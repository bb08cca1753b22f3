"""``@memo``: a function's array results, cached on the engine's RAM and SSD tiers.

    from mlxcache_kernel import memo

    @memo
    def embed(texts, dim=256): ...            # returns arrays (mx or numpy), or dicts/lists/tuples of them

    @memo(version=2)                          # bump it when what the result depends on changed
    def features(x): ...                      # somewhere the source does not show (a helper, a file)

    @memo(key=lambda model, x: (model.name, x))
    def encode(model, x): ...                 # arguments memo cannot key by value: say what identifies them

A call's key is the function's module and qualified name, its source, the
version and its arguments bound to its parameters (defaults applied, so
``f(1)`` and ``f(x=1)`` are one call): arrays by kind, dtype, shape and bytes;
numbers, strings, bytes, None, bools and tuples/lists/dicts of them by value
(engine/cache/objects/values.py). Anything else is a TypeError that names the
argument and says to pass ``key=``. Not in the key: globals and helpers the
function reads, and library versions (bump ``version`` for those).

A hit returns what the first call returned, from RAM or, after a restart,
from SSD (verified), without running the function: MLX arrays as new array
objects, numpy arrays read-only (``np.array(x)`` copies). A result memo
cannot store (a DataFrame, say) is returned uncached, with a warning.

The engine: inside IPython, the mlxcache magics' engine (the MLX Cache
kernel's; ``%load_ext mlxcache_kernel`` happens on the first call otherwise);
elsewhere one default Engine on ``$MLXCACHE_CACHE_DIR`` (the ``MLXCACHE_*``
settings the kernel reads), made on the first call and flushed at exit.
No model is needed. ``f.clear()`` (or ``%memo clear NAME``) forgets a
function's results; ``%memo ls`` lists them.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import marshal
import sys
import warnings

REVISION = 1  # of the key layout: a change makes every memoized call a miss, never a wrong hit
_MISSING = object()
_default = None  # the Engine outside IPython


def memo(func=None, *, version: int | str | None = None, key=None, engine=None):
    """Cache `func`'s results by its code and arguments (see the module docstring).

    version: part of the key (an int or str). key: a function of the same
    arguments whose return value (str, bytes, numbers, arrays, tuples...)
    replaces the arguments in the key. engine: an Engine to use instead of
    the kernel's or the default one.
    """
    if version is not None and (isinstance(version, bool) or not isinstance(version, (int, str))):
        raise TypeError(f"@memo(version=...) takes an int or a str, not {version!r}")
    if key is not None and not callable(key):
        raise TypeError("@memo(key=...) takes a function of the same arguments that returns the key")
    if func is None:
        return lambda f: memo(f, version=version, key=key, engine=engine)
    if not callable(func):
        raise TypeError(f"@memo decorates a function, not a {type(func).__qualname__}")
    return Memoized(func, version, key, engine)


def label_of(func) -> str:
    """How listings name a memoized function: `name` in a notebook, `module.name` otherwise."""
    module = getattr(func, "__module__", None) or "?"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", "?")
    return "memo:" + (name if module == "__main__" else f"{module}.{name}")


class Memoized:
    def __init__(self, func, version, key, engine):
        functools.update_wrapper(self, func)
        self.func, self.version, self.key_fn, self._engine = func, version, key, engine
        self.label = label_of(func)
        self._signature = inspect.signature(func)
        self._code = _code_digest(func)
        self._warned = False

    def __call__(self, *args, **kwargs):
        key = self.key(*args, **kwargs)
        objects = self.engine().objects
        value = objects.get(key, _MISSING)
        if value is not _MISSING:
            return value
        result = self.func(*args, **kwargs)
        from mlxcache_kernel.engine.cache.objects.values import Unstorable

        try:
            objects.put(key, result, label=self.label)
        except Unstorable as e:
            if not self._warned:
                self._warned = True
                warnings.warn(f"@memo: {self.label[5:]}'s result is not cached: {e}", stacklevel=2)
        return result

    def __get__(self, instance, owner=None):
        return self if instance is None else functools.partial(self, instance)

    def key(self, *args, **kwargs) -> tuple:
        """The object key of this call (what `Engine.objects` stores its result under)."""
        from mlxcache_kernel.engine.cache.objects.values import Unkeyable, digest

        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.__qualname__}(): {e}") from None
        bound.apply_defaults()
        if self.key_fn is not None:
            items = [("key=", self.key_fn(*args, **kwargs))]
        else:
            items = list(bound.arguments.items())
        parts = []
        for name, value in items:
            try:
                parts.append((name, digest(value, where=f"argument {name!r}" if name != "key=" else "key=")))
            except Unkeyable as e:
                raise TypeError(self._unkeyable(e)) from None
        module, name = getattr(self.func, "__module__", None), getattr(self.func, "__qualname__", None)
        return ("memo", REVISION, module, name, self._code, self.version, tuple(parts))

    def _unkeyable(self, e) -> str:
        name = self.func.__name__
        if self.key_fn is not None:
            return (f"@memo(key=...) of {name} returned a key ({e.where}) of type {e.type_name}: return str, bytes, "
                    "numbers, None, arrays or tuples/lists/dicts of them")
        return (f"@memo cannot key {name}(): {e.where} is of type {e.type_name}; arguments are keyed by value "
                f"(arrays, numbers, strings, bytes, None, tuples/lists/dicts of them). Pass key= to say what "
                f"identifies a call, e.g. @memo(key=lambda {str(self._signature)[1:-1]}: (...))")

    def engine(self):
        return self._engine if self._engine is not None else current_engine()

    def clear(self) -> int:
        """Forget this function's cached results (RAM and SSD, every version); how many."""
        return self.engine().objects.clear(label=self.label)

    def __repr__(self) -> str:
        return f"<memoized {self.label[5:]}>"


def _code_digest(func) -> str:
    """SHA-256 of the function's source (or, without source, its code object and this Python)."""
    try:
        data = inspect.getsource(func).encode()
    except (OSError, TypeError):
        code = getattr(func, "__code__", None)
        if code is None:
            raise TypeError(f"@memo needs a Python function (with source or code), not {func!r}") from None
        data = sys.version.encode() + marshal.dumps(code)
    return hashlib.sha256(data).hexdigest()


def current_engine():
    """The kernel's Engine inside IPython, else the default one (made on first use)."""
    ip = None
    if "IPython" in sys.modules:
        from IPython import get_ipython

        ip = get_ipython()
    if ip is not None:
        from .extension import get_engine

        return get_engine(ip)
    global _default
    if _default is None or _default.closed:
        import atexit

        from mlxcache_kernel.engine import Engine
        from mlxcache_kernel.settings import MLXCache

        _default = Engine(config=MLXCache().engine_config())
        atexit.register(_default.close)
    return _default
