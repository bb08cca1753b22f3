"""What both generation magics do to a cell before it is a prompt: ``{name}`` interpolation
(only names the namespace binds; ``{{name}}`` for a literal brace), and the warning for
fields left as written."""

from __future__ import annotations

import re
import sys
import types

_FIELD = re.compile(r"\{\{([A-Za-z_][A-Za-z0-9_]*)\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")
_NOT_VALUES = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)


def interpolate(text: str, namespace: dict, hidden: set | frozenset = frozenset(),
                undefined: list | None = None) -> str:
    """Substitute ``{name}`` for values bound in ``namespace``; ``{{name}}`` -> ``{name}``.

    Names left as written because nothing binds them are appended to ``undefined``.
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
        return str(value)

    return _FIELD.sub(sub, text)


def warn_undefined(names: list[str]) -> None:
    """One stderr line: these ``{name}`` fields were sent as written."""
    fields = ", ".join("{" + n + "}" for n in names)
    verb = "is" if len(names) == 1 else "are"
    print(f"[mlxcache] warning: {fields} {verb} not defined and sent as written; define the variable, or write "
          f"{{{{{names[0]}}}}} for a literal {{{names[0]}}} (--literal: no interpolation)", file=sys.stderr)
