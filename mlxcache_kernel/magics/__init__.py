"""IPython magics over one lazily created Engine.

``%model``, ``%%generate``, ``%session``, ``%checkpoint``, ``%cache``, ``%kv``,
``%dashboard``, ``%memo``, ``%eval`` and ``%mlxcache`` (the cheat sheet). Arguments are parsed with IPython's magic_arguments, so
``%%generate?`` shows the help. Every bad option, unknown name, missing
model or empty cell ends in one UsageError line; the engine keeps working.

``generate.py`` owns ``%%generate``, ``batch.py`` its ``--batch``/``--n`` rows, ``prompt.py``
the interpolation both use, ``output.py`` their streaming and progress, ``footer.py``
its result and footer (words and bar), ``cache.py`` ``%cache``, ``admin.py`` the other magics,
``score.py`` ``%%score``, ``evaluate.py`` ``%eval``, ``memo.py`` ``%memo`` (the results of ``@memo``), ``help.py`` their examples
and the cheat sheet, ``tables.py`` how they show rows, ``base.py`` the Engine they share. ``MLXCacheMagics`` is all of them on one Engine.
"""

from __future__ import annotations

from .admin import AdminMagics
from .base import combined_magics
from .cache import CacheMagics
from .footer import CellResult
from .generate import GenerateMagics
from .prompt import interpolate
from .evaluate import EvalMagics
from .help import HelpMagics
from .memo import MemoMagics
from .score import ScoreMagics

__all__ = ["MLXCacheMagics", "CellResult", "interpolate"]


@combined_magics
class MLXCacheMagics(GenerateMagics, ScoreMagics, EvalMagics, AdminMagics, CacheMagics, MemoMagics, HelpMagics):
    """Every mlxcache magic over one Engine, created on first use from the ``MLXCache`` settings."""
