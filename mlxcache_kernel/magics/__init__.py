"""IPython magics over one lazily created Engine.

``%model``, ``%%generate``, ``%session``, ``%checkpoint``, ``%cache``, ``%kv``
and ``%dashboard``. Arguments are parsed with IPython's magic_arguments, so
``%%generate?`` shows the help. Every bad option, unknown name, missing
model or empty cell ends in one UsageError line; the engine keeps working.

``generate.py`` owns ``%%generate`` (interpolation, streaming, the footer),
``admin.py`` the other magics, ``tables.py`` how they show rows, ``base.py``
the Engine they share. ``MLXCacheMagics`` is all of them on one Engine.
"""

from __future__ import annotations

from .admin import AdminMagics
from .base import combined_magics
from .generate import Generation, GenerateMagics, interpolate

__all__ = ["MLXCacheMagics", "Generation", "interpolate"]


@combined_magics
class MLXCacheMagics(GenerateMagics, AdminMagics):
    """Every mlxcache magic over one Engine, created on first use from the ``MLXCache`` settings."""
