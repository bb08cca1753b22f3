"""The IPython extension: ``%load_ext mlxcache_kernel`` (and the kernel, at start) registers the magics
on one lazily created Engine; unloading flushes and closes it."""

from __future__ import annotations

_loaded: dict = {}  # id(shell) -> (shell, MLXCacheMagics, atexit callback)


def load_ipython_extension(ipython):
    """Register the magics (``%model``, ``%%generate``, ``%session``, ...) in ``ipython``."""
    key = id(ipython)
    if key in _loaded:
        return _loaded[key][1]
    import atexit

    from .magics import MLXCacheMagics
    from .settings import MLXCache, redact_env_magic

    settings = MLXCache(parent=ipython)
    if settings not in getattr(ipython, "configurables", []):
        try:
            ipython.configurables.append(settings)  # so %config MLXCache.* reaches it
        except AttributeError:
            pass
    magics = MLXCacheMagics(ipython, settings=settings)
    ipython.register_magics(magics)
    redact_env_magic(ipython)  # %env output is saved in notebooks: no remote credentials in it
    ipython.events.register("post_run_cell", _post_run_cell_for(magics))

    def at_exit():
        try:
            report = magics.close(timeout=settings.shutdown_flush_s)
        except Exception:
            return
        if report and (report.get("committed") or report.get("pending")):
            import sys

            print(
                f"[mlxcache] flushed {report.get('committed', 0)} pending writes at exit"
                + (f"; {report['pending']} not finished" if report.get("pending") else ""),
                file=sys.__stderr__,
            )

    atexit.register(at_exit)
    ipython.mlxcache = magics
    _loaded[key] = (ipython, magics, at_exit)
    return magics


def _post_run_cell_for(magics):
    def post_run_cell(result=None):
        magics.poll()

    magics._post_run_cell = post_run_cell
    return post_run_cell


def unload_ipython_extension(ipython):
    """Flush pending writes, close the engine and remove the magics' hooks."""
    entry = _loaded.pop(id(ipython), None)
    if entry is None:
        return
    import atexit

    _, magics, at_exit = entry
    atexit.unregister(at_exit)
    try:
        ipython.events.unregister("post_run_cell", magics._post_run_cell)
    except ValueError:
        pass
    report = magics.close(timeout=magics.settings.shutdown_flush_s)
    if report and report.get("committed"):
        print(f"[mlxcache] flushed {report['committed']} pending writes")
    env = ipython.magics_manager.magics["line"].get("env")
    if getattr(env, "_mlxcache", False):
        ipython.magics_manager.magics["line"]["env"] = env._original
    for kind in ("line", "cell"):
        table = ipython.magics_manager.magics[kind]
        for name in ("model", "generate", "score", "eval", "session", "checkpoint", "cache", "kv", "dashboard",
                     "memo"):
            fn = table.get(name)
            if getattr(fn, "__self__", None) is magics:
                del table[name]
    try:
        ipython.configurables.remove(magics.settings)
    except (AttributeError, ValueError):
        pass
    if getattr(ipython, "mlxcache", None) is magics:
        del ipython.mlxcache


def get_engine(ipython=None):
    """The Engine behind the magics of the running IPython (created on first use)."""
    if ipython is None:
        from IPython import get_ipython

        ipython = get_ipython()
    if ipython is None:
        raise RuntimeError("not running inside IPython; create mlxcache_kernel.engine.Engine(...) directly")
    magics = load_ipython_extension(ipython)
    return magics.engine
