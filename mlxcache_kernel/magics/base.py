"""What every mlxcache magic shares: the lazily created Engine and its lifecycle,
option parsing, and the rule that a bad request ends in one UsageError line.

`EngineMagics` owns the Engine (created on first use from the ``MLXCache``
settings), loading the default model, and poll/flush/close for the extension.
`combined_magics` registers a class made of several Magics mixins.
"""

from __future__ import annotations

import functools
import sys
import time

from IPython.core.error import UsageError
from IPython.core.magic import Magics, magics_class

from IPython.core.magic_arguments import argument

from ..settings import MLXCache, resolve_model_spec


def usage_errors(func):
    """Turn the engine's one-line ValueErrors (and friends) into a UsageError."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except UsageError:
            raise
        except (ValueError, LookupError, OSError) as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UsageError(msg) from None
        except RuntimeError as e:
            if "closed" in str(e):
                raise UsageError(str(e)) from None
            raise

    # keep magic_arguments' parser (and the help text) reachable on the wrapper
    return wrapper


def parse_args(magic, line: str):
    """Like magic_arguments.parse_argstring, but quotes group words and are removed (POSIX rules)."""
    from IPython.utils._process_common import arg_split

    try:
        argv = arg_split(line, posix=True, strict=True)
    except ValueError as e:
        raise UsageError(f"cannot parse the options: {e}") from None
    return magic.parser.parse_args(argv)


def no_target(target, action: str) -> None:
    """A listing action takes no name."""
    if target:
        raise UsageError(f"%{action} takes no name, got {target!r}")


def only_for(args, magic: str, action: str, *options: str) -> None:
    """Options (argparse dests) that only ``%magic action`` takes."""
    if args.action != action and any(getattr(args, o) is not None for o in options):
        names = "/".join("--" + o for o in options)
        raise UsageError(f"{names} only apply to %{magic} {action}, not %{magic} {args.action}")


def combined_magics(cls):
    """``magics_class`` for a class whose magics all come from its bases.

    IPython records a class's magics while its body runs; a class that only
    combines mixins (each decorated with ``magics_class``) gets their union.
    """
    cls = magics_class(cls)
    for base in reversed(cls.__mro__[1:]):
        for kind, table in (base.__dict__.get("magics") or {}).items():
            cls.magics[kind].update(table)
    return cls


class EngineMagics(Magics):
    """One Engine, created on first use from the ``MLXCache`` settings."""

    def __init__(self, shell=None, settings: MLXCache | None = None, **kwargs):
        super().__init__(shell, **kwargs)
        self.settings = settings if settings is not None else MLXCache(parent=shell)
        self._engine = None
        self._report = None  # what this kernel holds, for the JupyterLab panel (engine/admin/reports.py)
        self._widgets: list = []
        self._alerts_shown = 0  # the verifier's alerts printed so far

    @property
    def engine_started(self) -> bool:
        return self._engine is not None

    @property
    def engine(self):
        if self._engine is None:
            try:
                config = self.settings.engine_config()
            except ValueError as e:
                raise UsageError(f"bad mlxcache setting: {e}") from None
            from mlxcache_kernel.engine import Engine

            self._engine = Engine(config=config)
            v = self._verifier()
            if v is not None:  # the cells that used a remote state are named as the notebook numbers them
                v.cell = lambda: f"In [{getattr(self.shell, 'execution_count', '?')}]"
        return self._engine

    def _verifier(self):
        """The engine's verifier of fetched remote states (engine/cache/remote/verify.py), if any."""
        remote = self._engine.cache.remote if self._engine is not None and not self._engine.closed else None
        return None if remote is None else remote.verifier

    def verify_step(self) -> bool:
        """One short step of verifying a fetched remote state (idle time); True while more is left.
        A mismatch's alert is printed (between cells: under the last cell's output)."""
        v = self._verifier()
        if v is None:
            return False
        try:
            v.step()
        except Exception:  # noqa: BLE001 - idle work never breaks the kernel
            return False
        while len(v.alerts) > self._alerts_shown:
            print(f"[mlxcache] {v.alerts[self._alerts_shown]}", file=sys.stderr, flush=True)
            self._alerts_shown += 1
        return v.busy

    def _ensure_model(self, name: str | None) -> None:
        """Load the configured default model on first use when nothing is loaded."""
        eng = self.engine
        if name is not None or eng.models.default is not None:
            return
        spec = self.settings.default_model_spec()
        if spec is None:
            raise UsageError("no model is loaded: use %model load PATH (or set MLXCACHE_DEFAULT_MODEL)")
        print(f"[mlxcache] loading the default model ({spec}) ...", flush=True)
        self._load(spec, "default")

    def _load(self, spec: str, name: str, **kv) -> dict:
        t0 = time.perf_counter()
        info = self.engine.load_model(resolve_model_spec(spec), name=name, **kv)
        info["load_s"] = time.perf_counter() - t0
        return info

    def _show_widget(self, widget) -> None:
        """Display a widget and close it with the extension."""
        from IPython.display import display

        self._widgets.append(widget)
        display(widget)

    def poll(self) -> None:
        """Apply finished background writes and refresh this kernel's report (called between
        cells, main thread)."""
        if self._engine is not None and not self._engine.closed:
            try:
                self._engine.poll()
                if self._report is None:
                    from mlxcache_kernel.engine.admin.reports import ProcessReport

                    self._report = ProcessReport(self._engine)
                self._report.maybe_write()
            except Exception:
                pass

    def flush(self, timeout: float | None = None) -> dict | None:
        if self._engine is None or self._engine.closed:
            return None
        return self._engine.flush(timeout=timeout)

    def close(self, timeout: float | None = None) -> dict | None:
        """Close widgets, flush, close the engine (extension unload, interpreter exit)."""
        for w in self._widgets:
            try:
                w.close()
            except Exception:
                pass
        self._widgets.clear()
        if self._engine is None or self._engine.closed:
            return None
        report = self._engine.flush(timeout=timeout)
        if not report.get("pending"):
            self._engine.close()  # nothing left to wait for: returns at once
            if self._report is not None:
                self._report.remove()  # this kernel left the directory
        return report


def sampling_arguments(func):
    """The sampling options of ``%%generate`` (and its ``--batch``), as the engine defines them
    (`SamplingParams`'s fields: flags, defaults, help)."""
    from dataclasses import fields

    from mlxcache_kernel.engine.generate.sampling import SamplingParams

    for f in reversed(fields(SamplingParams)):
        meta = f.metadata
        if meta["repeat"]:
            func = argument(*meta["flags"], action="append", default=[], help=meta["help"])(func)
        else:
            func = argument(*meta["flags"], type=meta["type"], default=f.default, help=meta["help"])(func)
    return func


def sampling_options(args, **overrides) -> dict:
    """The parsed sampling options as `generate`'s keywords."""
    from mlxcache_kernel.engine.generate.sampling import SamplingParams

    return {**{name: getattr(args, name) for name in SamplingParams.names()}, **overrides}
