"""User-chosen names (sessions, named checkpoints, models) end up in file
names and JSON records: one rule for all of them, so none can escape its
directory or hide as a dotfile."""

from __future__ import annotations

import re

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


def check_user_name(value, what: str, error: type[ValueError] = ValueError) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise error(f"invalid {what} {value!r}: use 1-64 letters, digits, '_', '.' or '-', not starting with '.' or '-'")
    return value
