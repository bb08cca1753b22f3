"""What both generation magics do to a cell before it is a prompt: ``{name}`` interpolation
(only names the namespace binds; ``{{name}}`` for a literal brace), and the warning for
fields left as written. A value whose ``str()`` raises, or whose text is longer than a prompt
for the model could hold (engine/generate/window.py), is one UsageError line naming it
(``--truncate left|middle`` cuts the text instead)."""

from __future__ import annotations

import re
import sys
import types

from IPython.core.error import UsageError

from mlxcache_kernel.engine.generate.window import MAX_CHARS_PER_TOKEN, cut

_FIELD = re.compile(r"\{\{([A-Za-z_][A-Za-z0-9_]*)\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")
_NOT_VALUES = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)


def interpolate(text: str, namespace: dict, hidden: set | frozenset = frozenset(),
                undefined: list | None = None, *, limit: int | None = None, truncate: str | None = None) -> str:
    """Substitute ``{name}`` for values bound in ``namespace``; ``{{name}}`` -> ``{name}``.

    Names left as written because nothing binds them are appended to ``undefined``. A value's
    text longer than ``limit`` characters is refused, or cut as ``truncate`` says ("left", "middle").
    """

    def sub(m: re.Match) -> str:
        if m.group(1) is not None:
            return "{" + m.group(1) + "}"
        name = m.group(2)
        if name.startswith("_") or name in hidden or name not in namespace:
            if undefined is not None and name not in namespace and name not in undefined:
                undefined.append(name)
            return m.group(0)
        value = namespace[name]
        if isinstance(value, _NOT_VALUES):
            return m.group(0)
        try:
            value = str(value)
        except Exception as e:  # a broken __str__: one line naming it, not its traceback
            raise UsageError(f"{{{name}}}: str({name}) raised {type(e).__name__}: {_first_line(e)}") from None
        if limit is not None and len(value) > limit:
            if truncate is None:
                raise UsageError(f"{{{name}}} is {len(value):,} characters, more than a prompt for this model can hold "
                                 f"({limit:,}: {MAX_CHARS_PER_TOKEN} for each token of its window of "
                                 f"{limit // MAX_CHARS_PER_TOKEN:,}); pass less, or --truncate left|middle to cut it")
            value = cut(value, limit, truncate)
        return value

    return _FIELD.sub(sub, text)


def _first_line(e: Exception) -> str:
    try:
        text = str(e).strip()
    except Exception:  # (an exception whose own __str__ fails)
        text = ""
    return text.splitlines()[0] if text else "no message"


def warn_undefined(names: list[str]) -> None:
    """One stderr line: these ``{name}`` fields were sent as written."""
    fields = ", ".join("{" + n + "}" for n in names)
    verb = "is" if len(names) == 1 else "are"
    print(f"[mlxcache] warning: {fields} {verb} not defined and sent as written; define the variable, or write "
          f"{{{{{names[0]}}}}} for a literal {{{names[0]}}} (--literal: no interpolation)", file=sys.stderr)
