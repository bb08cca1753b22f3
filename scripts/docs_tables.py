"""Write the tables in docs/ that are generated from the code, so they cannot drift from it.

    python scripts/docs_tables.py            # rewrite them in place
    python scripts/docs_tables.py --check    # exit 1 if one differs from the code

- docs/configuration.md, between `<!-- options: -->` markers: every option, from engine/config.py's
  `option_table()` (and the kernel's own settings, mlxcache_kernel/settings.py).
- docs/architecture.md, between `<!-- layout: -->` markers: every folder and module of engine/,
  mlxcache_kernel/, widgets/ and tests/support/ with what it holds: the first sentence of its docstring
  (a folder's is its __init__.py's). A module without one is an error naming it.

tests/test_docs.py and tests/engine/test_config.py run the check.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LAYOUT_ROOTS = ["engine", "mlxcache_kernel", "widgets", "tests/support"]
SKIPPED = {"__pycache__", "labextension"}
# what a folder without an __init__.py holds (a folder with one: its docstring)
FOLDER_NOTES = {"tests/support": "What the tests share: tiny models of every architecture, real servers, worker "
                                 "processes, and where the repository is."}


def summary(path: Path) -> str:
    """The first sentence of a module's docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    if not doc:
        raise ValueError(f"{path.relative_to(ROOT)} has no docstring: its first sentence is its row in the layout")
    paragraph = " ".join(doc.split("\n\n", 1)[0].split())
    # a sentence ends at a full stop and a space (not after e.g. or i.e.)
    first = re.split(r"(?<!e\.g\.)(?<!i\.e\.)(?<=[.!?])\s+", paragraph, maxsplit=1)[0]
    return first.rstrip(":").replace("|", "\\|")


def _folder_rows(folder: Path) -> list[str]:
    rel = folder.relative_to(ROOT).as_posix()
    init = folder / "__init__.py"
    rows = [f"| **`{rel}/`** | {summary(init) if init.exists() else FOLDER_NOTES[rel]} |"]
    modules = sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")
    rows += [f"| `{p.name}` | {summary(p)} |" for p in modules]
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and p.name not in SKIPPED):
        if any(sub.rglob("*.py")):
            rows += _folder_rows(sub)
    return rows


def layout_table() -> str:
    """The Markdown table of every folder (bold, from the repository root) and module (by its name, under
    the folder above it) with what it holds."""
    rows = ["| folder or module | what it holds |", "|---|---|"]
    for top in LAYOUT_ROOTS:
        rows += _folder_rows(ROOT / top)
    return "\n".join(rows)


def option_table() -> str:
    sys.path.insert(0, str(ROOT))
    from mlxcache_kernel.engine.config import option_table as table
    from mlxcache_kernel.settings import KERNEL_OPTIONS

    return table(KERNEL_OPTIONS)


# page -> (marker, generator): the text between "<!-- marker: ... -->" and "<!-- /marker -->"
TABLES = {"configuration.md": ("options", option_table), "architecture.md": ("layout", layout_table)}


def between(text: str, marker: str) -> tuple[int, int]:
    """Where the generated part of a page starts and ends (the lines between the two markers)."""
    start = text.index(f"<!-- {marker}:")
    start = text.index("\n", start) + 1
    return start, text.index(f"<!-- /{marker} -->", start)


def generated(page: str) -> str:
    """What a page says between its markers now, as the generator would write it."""
    text = (DOCS / page).read_text(encoding="utf-8")
    start, end = between(text, TABLES[page][0])
    return text[start:end].strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the tables are up to date")
    args = parser.parse_args(argv)
    stale = []
    for page, (marker, make) in TABLES.items():
        path = DOCS / page
        text = path.read_text(encoding="utf-8")
        start, end = between(text, marker)
        table = make()
        if text[start:end].strip() == table:
            continue
        if args.check:
            stale.append(page)
        else:
            path.write_text(text[:start] + table + "\n" + text[end:], encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"out of date (run python scripts/docs_tables.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
