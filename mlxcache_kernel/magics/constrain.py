"""``%%generate --json / --regex / --choice / --grammar``: the answer's shape, as the engine's constraint
keywords (``response_format``, ``regex``, ``choices``, ``grammar``: docs/constrained.md), with names
resolved in the notebook namespace; and how a constrained answer shows in the footer and the batch table.
"""

from __future__ import annotations

import json

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument

__all__ = ["constraint_arguments", "constraint_options", "constraint_phrase", "field_columns"]

FLAGS = ("json", "regex", "choice", "grammar")


def constraint_arguments(func):
    """The four options, on ``%%generate`` (single cells and ``--batch``)."""
    for flag, metavar, text in reversed((
        ("--json", "MODEL", "the answer is JSON following MODEL: a variable holding a Pydantic model class or a "
                            "JSON Schema dict (or the schema's JSON text); .parsed holds it parsed"),
        ("--regex", "PATTERN", "the answer matches PATTERN, whole (quote it)"),
        ("--choice", "A|B|C", "the answer is one of these strings, split at '|' (or a variable holding a list)"),
        ("--grammar", "VAR", "the answer follows the Lark or GBNF grammar held by variable VAR"),
    )):
        func = argument(flag, default=None, metavar=metavar, help=text)(func)
    return func


def constraint_options(args, namespace: dict) -> dict:
    """The engine's constraint keyword the options ask for ({} without one); a bad one is a UsageError."""
    given = [f for f in FLAGS if getattr(args, f) is not None]
    if len(given) > 1:
        raise UsageError(f"{' and '.join('--' + f for f in given)}: one constraint at a time")
    if not given:
        return {}
    flag = given[0]
    spec = getattr(args, flag).strip()
    bound = spec.isidentifier() and spec in namespace
    if flag == "json":
        value = namespace[spec] if bound else spec
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise UsageError(f"--json {spec}: not a defined variable (a Pydantic model class or a JSON Schema "
                                 "dict), nor a JSON Schema's text") from None
        return {"response_format": value}
    if flag == "regex":
        return {"regex": spec}
    if flag == "choice":
        if bound and isinstance(namespace[spec], (list, tuple)):
            return {"choices": list(namespace[spec])}
        return {"choices": spec.split("|")}
    if not bound or not isinstance(namespace[spec], str):
        raise UsageError(f"--grammar {spec}: needs a variable holding a Lark or GBNF grammar (a string)")
    return {"grammar": namespace[spec]}


def constraint_phrase(stats: dict) -> str | None:
    """The footer's part: "JSON complete", or why the answer is not: "incomplete JSON (max tokens)"."""
    if not stats.get("constraint"):
        return None
    what = {"json": "JSON", "regex": "regex match", "choice": "choice", "grammar": "grammar match"}
    return stats.get("constraint_incomplete") or f"{what.get(stats['constraint'], stats['constraint'])} complete"


def field_columns(results: list, taken: set) -> list[dict]:
    """Per row, the parsed answer's fields as table columns (a Pydantic object's or a JSON object's top-level
    keys; any other JSON value as "parsed"); a field named like a provenance column gets "json." before it."""
    out = []
    for r in results:
        value = r.parsed
        if hasattr(value, "model_dump"):
            value = value.model_dump()
        if value is None or (r.stats.get("constraint") != "json"):
            out.append({})
        elif isinstance(value, dict):
            out.append({(f"json.{k}" if k in taken else k): v for k, v in value.items()})
        else:
            out.append({"parsed": value})
    return out
