"""The shape of the code, read from its own imports (ast): no import circles, arrows that point one
way (kernel -> widgets -> engine), only kv/codecs.py naming mlx-lm's cache classes, a small top
of engine/ and modules a person reads in one sitting.

Every import counts: module level, inside functions and under TYPE_CHECKING alike (a circle that
is only "not needed at load time" still ties two modules into one).
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest
from repo_paths import ROOT

PACKAGES = {"mlxcache_kernel": "mlxcache_kernel", "engine": "mlxcache_kernel.engine",
            "widgets": "mlxcache_kernel.widgets"}


def modules() -> dict[str, Path]:
    """Module name -> file, for every module of the three packages."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


MODULES = modules()


def imports_of(name: str, path: Path) -> set[str]:
    """The project modules `name` imports, anywhere in its file."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = here[: len(here) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES and "." in t:  # `import a.b.c` imports a.b.c; a name: its module
                t = t.rsplit(".", 1)[0]
            if t in MODULES and t != name:
                found.add(t)
    return found


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    found = cycles(GRAPH)
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_engine_imports_neither_the_kernel_nor_the_widgets():
    engine = "mlxcache_kernel.engine"
    bad = sorted((m, t) for m, ts in GRAPH.items() if m.startswith(engine) for t in ts if not t.startswith(engine))
    assert not bad, bad


def test_the_top_of_the_engine_holds_the_facade_and_what_every_part_shares():
    """At most 8 modules beside the folders: a newcomer finds each concept by its folder's name."""
    top = sorted(p.name for p in (ROOT / "engine").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 8, top


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_reads_in_one_sitting(name):
    """Under 400 lines (401 with a trailing blank line is still 400 of text)."""
    lines = MODULES[name].read_text().rstrip("\n").count("\n") + 1
    assert lines <= 400, f"{MODULES[name].relative_to(ROOT)}: {lines} lines; split it by concept"


def test_widgets_do_not_import_the_kernel():
    bad = sorted((m, t) for m, ts in GRAPH.items() if m.startswith("mlxcache_kernel.widgets") for t in ts
                 if not t.startswith(("mlxcache_kernel.widgets", "mlxcache_kernel.engine")))
    assert not bad, bad


def _cache_class_names() -> set[str]:
    from mlx_lm.models import cache as lm_cache

    return {n for n, v in vars(lm_cache).items() if isinstance(v, type) and n.endswith(("Cache", "CacheList"))
            or n == "CacheList"}


@pytest.mark.parametrize("name", [m for m in MODULES if m != "mlxcache_kernel.engine.kv.codecs"])
def test_only_the_codecs_name_mlx_lms_cache_classes(name):
    """Neither as code (`KVCache(...)`, `from mlx_lm.models.cache import ...`) nor as the strings
    compared with class names (`kind == "KVCache"`)."""
    classes = _cache_class_names()
    source = MODULES[name].read_text()
    named = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.string in classes:
            named.add(tok.string)
        elif tok.type == tokenize.STRING:
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):
                continue
            if value in classes:
                named.add(value)
    assert "mlx_lm.models.cache" not in source and not named, f"{name} names {sorted(named)}"
