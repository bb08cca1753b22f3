"""Docs that stay true: every file a docstring, comment or doc names exists, and the README stays short.

A path is a word that looks like one of the repository's files: a name ending in a source or doc suffix
(.py, .md, .ipynb, .sh, .ts, .toml), a path under one of the repository's top-level folders
(`docs/images/panel.png`, `engine/cache/`), or a module (`mlxcache_kernel.engine.cache.remote.writers`,
imported). It resolves when it names a file or folder relative to the repository root, to one of the
package roots (engine/, mlxcache_kernel/, widgets/, tests/), or to the folder the text is in or one
above it (`support/repo_paths.py` from tests/). So a bare name has to be in the text's own folder or
above it: a file elsewhere is named with its folder, and a file that moved or went is caught."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import io
import re
import tokenize
from pathlib import Path

import pytest

from repo_paths import ROOT

SCANNED = ["engine", "mlxcache_kernel", "widgets", "tests", "benchmarks", "scripts", "docs", "examples"]
TOP_FILES = ["README.md", "Makefile", "pyproject.toml", "setup.py"]
SKIPPED_DIRS = {"__pycache__", "labextension", "node_modules", "traces", "images"}
PACKAGE_ROOTS = ["engine", "mlxcache_kernel", "widgets", "tests"]
TOP_DIRS = ["engine", "mlxcache_kernel", "widgets", "tests", "benchmarks", "scripts", "docs", "examples",
            "panel", "jupyter-config"]
SUFFIXES = "py|md|ipynb|sh|ts|tsx|toml"
# Other projects' files, named as their projects name them; not ours to resolve.
FOREIGN_FOLDERS = ("mlx_lm/", "mlx_vlm/", "mlx/", "lm_eval/", "site-packages/")
FOREIGN_NAMES = {
    "convert_hf_to_gguf.py",    # llama.cpp's converter, whose permute engine/models/convert.py inverts
    "ipython_kernel_config.py",  # an IPython profile's settings file
    "one.ipynb", "two.ipynb",   # notebooks tests/kernel/test_panel_browser.py makes in its own lab folder
}
PLACEHOLDERS = {"NAME", "NOTEBOOK", "PATH", "FILE", "DIR", "OUT", "PAGE"}  # `examples/NAME.ipynb`: any such file

_PATH = re.compile(r"(?<![\w./~<>*{$-])((?:[\w.-]+/)*[\w-]+(?:\.[\w-]+)*\.(?:" + SUFFIXES + r")|(?:" + "|".join(
    re.escape(d) for d in TOP_DIRS) + r")/(?:[\w.-]+/)*[\w.-]*)(?![\w/<>*{(-])")
_MODULE = re.compile(r"(?<![\w./])(mlxcache_kernel(?:\.\w+)+)")
_URL = re.compile(r"\S+://\S+")


def _texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of what the file says in words: a Python file's docstrings, other string statements
    and comments; a shell script's, Makefile's or TOML's comments; a Markdown file whole; a notebook's
    markdown cells."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        out = []
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value,
                                                                                                   str):
                out.append((node.lineno, node.value.value))
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                out.append((tok.start[0], tok.string))
        return out
    if path.suffix == ".md":  # the generated layout repeats the docstrings, which are checked where they are
        lines = list(enumerate(text.splitlines(), 1))
        inside = False
        kept = []
        for i, line in lines:
            inside = (inside or line.startswith("<!-- layout:")) and not line.startswith("<!-- /layout")
            if not inside:
                kept.append((i, line))
        return kept
    if path.suffix == ".ipynb":
        import json
        cells = json.loads(text)["cells"]
        return [(i, "".join(c["source"])) for i, c in enumerate(cells, 1) if c["cell_type"] == "markdown"]
    return [(i, line[line.index("#"):]) for i, line in enumerate(text.splitlines(), 1) if "#" in line]


def scanned_files() -> list[Path]:
    files = [ROOT / name for name in TOP_FILES]
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            if SKIPPED_DIRS & set(path.relative_to(ROOT).parts) or not path.is_file():
                continue
            if path.suffix in (".py", ".md", ".ipynb", ".sh"):
                files.append(path)
    return files


def _resolves(word: str, where: Path) -> bool:
    """Whether `word`, named in a file at `where`, is a file or folder: from the repository root, the
    package roots, or the file's own folder and those above it."""
    bases = [ROOT / top for top in PACKAGE_ROOTS]
    folder = where.parent
    while folder != ROOT and ROOT in folder.parents:
        bases.append(folder)
        folder = folder.parent
    bases.append(ROOT)
    return any((base / word).exists() for base in bases)


def _module_exists(dotted: str) -> bool:
    """`mlxcache_kernel.engine.cache.remote.writers`, or a name inside a module (`...engine.Engine`):
    imported, as a reader would."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        try:
            for name in parts[n:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def stale_names(texts: list[tuple[int, str]], where: Path) -> list[str]:
    """'file:line: word' for every path or module the texts name (as written in the file `where`) that
    does not exist."""
    rel = where.relative_to(ROOT)
    found = []
    for first_line, text in texts:
        text = _URL.sub(lambda m: " " * len(m.group()), text)
        for m in _PATH.finditer(text):
            word = m.group(1).rstrip(".")  # a sentence's full stop
            line = first_line + text.count("\n", 0, m.start())
            parts = word.split("/")
            if (word.startswith(FOREIGN_FOLDERS) or parts[-1] in FOREIGN_NAMES
                    or any(part.split(".")[0] in PLACEHOLDERS for part in parts)):
                continue
            if not _resolves(word, where):
                found.append(f"{rel}:{line}: {word}")
        for m in _MODULE.finditer(text):
            if not _module_exists(m.group(1).rstrip(".")):
                found.append(f"{rel}:{first_line + text.count(chr(10), 0, m.start())}: {m.group(1)}")
    return found


def test_every_named_path_exists():
    stale = [hit for path in scanned_files() for hit in stale_names(_texts(path), path)]
    assert not stale, f"{len(stale)} names of files that do not exist:\n" + "\n".join(stale)


@pytest.mark.parametrize("text, ok", [
    ("see engine/cache/tiered.py and docs/", True),
    ("see `engine/cache/tiered_gone.py`", False),
    ("the generation (`generation.py`), its folder (`batch/`)", True),  # beside the file, or a folder of it
    ("the pins (`cache/pins.py`) and writer (`cache/ssd/writer.py`)", True),  # from engine/, from engine/cache/
    ("the pins (`pins.py`)", False),  # engine/cache/pins.py, but not in this folder or above it
    ("`batch_shared.py`.", False),
    ("tests/engine/test_gone.py", False),
    ("`python -m mlxcache_kernel.engine.cache.remote.writers` and mlxcache_kernel.engine.Engine", True),
    ("mlxcache_kernel.engine.cache.remote.writerz", False),
    ("mlx_lm/generate.py's generate_step; https://example.com/a/b.py; examples/NAME.ipynb", True),
])
def test_the_scanner_tells_a_missing_file(text, ok):
    """The scanner itself, on words as if written in engine/generate/ (line 7 of a file there)."""
    where = ROOT / "engine" / "generate" / "any_module.py"
    hits = stale_names([(7, text)], where)
    assert (hits == []) == ok, hits
    assert all(hit.startswith("engine/generate/any_module.py:7: ") for hit in hits)


def _docs_tables():
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "scripts" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_layout_table_is_generated_from_the_docstrings():
    tables = _docs_tables()
    assert tables.generated("architecture.md") == tables.layout_table(), (
        "docs/architecture.md's layout is stale: run python scripts/docs_tables.py")


def test_every_module_is_in_the_layout():
    """Each module of the layout's folders has a row under its folder's: none left out, none made up."""
    text = _docs_tables().generated("architecture.md")
    folder, listed = None, set()
    for row in text.splitlines()[2:]:
        name = row.split("`")[1]
        if row.startswith("| **"):
            folder = name.rstrip("/")
        else:
            listed.add(f"{folder}/{name}")
    on_disk = {p.relative_to(ROOT).as_posix() for top in ("engine", "mlxcache_kernel", "widgets", "tests/support")
               for p in (ROOT / top).rglob("*.py") if p.name != "__init__.py" and "labextension" not in p.parts}
    assert listed == on_disk


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_links_land_on_a_file_and_a_heading():
    """`[text](target#anchor)` in README.md and docs/: the target exists relative to the page (as a
    Markdown viewer resolves it), and has that heading."""
    bad = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s:]*)(?:#([\w-]+))?\)", page.read_text()):
            linked = (page.parent / target) if target else page
            if not linked.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} does not exist")
            elif anchor and anchor not in {_anchor(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(), re.M)}:
                bad.append(f"{page.relative_to(ROOT)}: {target}#{anchor} is no heading")
    assert not bad, bad


def test_every_page_of_the_guide_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    orphans = [p.name for p in PAGES[1:] if f"](docs/{p.name})" not in readme]
    assert not orphans, orphans


def test_readme_is_short():
    """A person reads the README in five minutes; the guide is in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 200, len(lines)


def test_the_make_targets_the_docs_name_exist_and_set_up_first():
    """Every `make TARGET` README.md and docs/ name is a target of the Makefile, and the ones a person runs
    on a fresh clone (demo, test, test-fast, lab, bench) do all set-up first: they depend on `setup`."""
    makefile = (ROOT / "Makefile").read_text()
    targets = dict(re.findall(r"^([\w-]+):(.*)$", makefile, flags=re.M))
    named = {t for page in PAGES for t in re.findall(r"(?:`|^)make ([a-z][\w-]*)", page.read_text(), flags=re.M)}
    assert {"demo", "test"} <= named and named <= set(targets), named - set(targets)
    assert all("setup" in targets[t].split() for t in named - {"setup", "clean"}), targets
