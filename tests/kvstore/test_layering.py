"""Package layering, read from the source (every import statement of every module, walked by
``ast``): data flows engine -> connector -> store -> tiers, so

* ``kvstore`` never imports ``engine_min``, ``connectors`` or ``bench``;
* the store core (``kvstore`` outside ``kvstore.daemon``) never imports the daemon (only the
  command-line entry point ``kvstore.__main__`` runs it);
* ``engine_min`` never imports ``kvstore`` (it reaches the store through ``connectors``);
* ``kernels`` import nothing of ours but ``kernels``;
* the modules of ``kvstore``, and those of ``engine_min``, import one another without a
  cycle (module-level imports; those under ``if TYPE_CHECKING:`` or
  ``if __name__ == "__main__":`` and inside functions run later and are left out).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("kvstore", "connectors", "engine_min", "kernels", "bench", "tests", "tools")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: str) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file under ``package``."""
    return {module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _is_main_guard(node: ast.If) -> bool:
    """``if __name__ == "__main__":``: runs when the module is executed, not imported."""
    t = node.test
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name)
            and t.left.id == "__name__" and len(t.comparators) == 1
            and isinstance(t.comparators[0], ast.Constant)
            and t.comparators[0].value == "__main__")


def _walk(body: list[ast.stmt], module_level: bool):
    """(import node, at module level) for every import in ``body``, nested ones included."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, module_level
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(node.body, False)
        elif isinstance(node, ast.ClassDef):
            yield from _walk(node.body, module_level)
        elif isinstance(node, ast.If):
            inner = module_level and not _is_type_checking(node) and not _is_main_guard(node)
            yield from _walk(node.body, inner)
            yield from _walk(node.orelse, module_level)
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):
                sub = getattr(node, field, None)
                if isinstance(sub, list):
                    yield from _walk([s for s in sub if isinstance(s, ast.AST)], module_level)


def imports(path: Path, known: set[str] | None = None,
            root: Path = ROOT) -> list[tuple[str, bool]]:
    """``(imported module, at module level)`` for each import in ``path``. ``from a import b``
    names ``a.b`` when that is a module in ``known``, else ``a``; relative imports resolved."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node, top in _walk(tree.body, True):
        if isinstance(node, ast.Import):
            out += [(a.name, top) for a in node.names]
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        for a in node.names:
            full = f"{base}.{a.name}"
            out.append((full if known and full in known else base, top))
    return out


def _under(mod: str, package: str) -> bool:
    return mod == package or mod.startswith(package + ".")


def offenders(package: str, forbidden: tuple[str, ...], skip: tuple[str, ...] = ()
              ) -> list[str]:
    """``"module -> import"`` for each import of a forbidden package by a module of
    ``package`` (modules under ``skip`` left out)."""
    out = []
    for name, path in modules(package).items():
        if any(_under(name, s) for s in skip):
            continue
        for mod, _ in imports(path):
            if any(_under(mod, f) for f in forbidden):
                out.append(f"{name} -> {mod}")
    return out


def test_the_store_never_imports_the_engine_the_connectors_or_the_benchmarks():
    assert offenders("kvstore", ("engine_min", "connectors", "bench", "tests")) == []


def test_the_store_core_never_imports_the_daemon():
    assert offenders("kvstore", ("kvstore.daemon",),
                     skip=("kvstore.daemon", "kvstore.__main__")) == []


def test_kernels_import_nothing_of_ours_but_kernels():
    assert offenders("kernels", tuple(p for p in OURS if p != "kernels")) == []


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def kvstore_graph() -> dict[str, set[str]]:
    """Module-level imports between modules of ``kvstore`` (a package's ``__init__`` counts
    as the module named after the package)."""
    mods = modules("kvstore")
    return {name: {m for m, top in imports(path, set(mods)) if top and m in mods and m != name}
            for name, path in mods.items()}


def test_kvstore_modules_import_one_another_without_a_cycle():
    graph = kvstore_graph()
    assert graph["kvstore.store"] >= {"kvstore.api", "kvstore.store_state", "kvstore.direct"}
    assert find_cycle(graph) is None


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": set(), "c": {"a", "b"}}, None),
])
def test_find_cycle_finds_a_cycle_and_only_a_cycle(graph, cycle):
    assert find_cycle(graph) == cycle


def test_imports_resolve_relative_and_skip_type_checking_ones(tmp_path):
    pkg = tmp_path / "kvstore" / "sub"
    pkg.mkdir(parents=True)
    src = pkg / "mod.py"
    src.write_text("from typing import TYPE_CHECKING\nfrom . import sib\nfrom ..api import X\n"
                   "if TYPE_CHECKING:\n    from kvstore.store import ChunkStore\n"
                   "def f():\n    import connectors.base\n")
    assert imports(src, {"kvstore.sub.sib"}, root=tmp_path) == [
        ("typing", True), ("kvstore.sub.sib", True), ("kvstore.api", True),
        ("kvstore.store", False), ("connectors.base", False)]


def test_the_engine_never_imports_the_store():
    """The engine reaches the store only through a connector (``connectors``)."""
    assert offenders("engine_min", ("kvstore",)) == []


def test_engine_min_modules_import_one_another_without_a_cycle():
    mods = modules("engine_min")
    graph = {name: {m for m, top in imports(path, set(mods)) if top and m in mods and m != name}
             for name, path in mods.items()}
    assert graph["engine_min.engine"] >= {"engine_min.scheduler", "engine_min.block_manager"}
    assert find_cycle(graph) is None


def test_connectors_reach_the_engine_only_for_its_weights_fingerprint():
    """The connectors import the store, never an engine's internals; the one exception is the
    weights fingerprint (``engine_min.identity``), so that vLLM and engine_min name the same
    weights alike and share chunks."""
    found = offenders("connectors", ("engine_min", "bench", "tests"))
    assert [o for o in found if not o.endswith("-> engine_min.identity")] == []
    assert "connectors.vllm.identity -> engine_min.identity" in found


def test_the_engine_core_never_imports_its_server():
    """``engine_min.serve`` (the HTTP server) sits on the engine core, not the other way round;
    only the command line (``engine_min.cli``, ``python -m engine_min``) starts it, and the
    router (``engine_min.router``) parses requests with the server's own protocol module."""
    assert offenders("engine_min", ("engine_min.serve",),
                     skip=("engine_min.serve", "engine_min.router", "engine_min.cli",
                           "engine_min.__main__")) == []


def test_neither_the_engine_nor_its_server_imports_the_router():
    """The router sits in front of engines (it reaches them over HTTP only)."""
    assert offenders("engine_min", ("engine_min.router",),
                     skip=("engine_min.router", "engine_min.cli", "engine_min.__main__")) == []


def test_connector_modules_import_one_another_without_a_cycle():
    mods = modules("connectors")
    graph = {name: {m for m, top in imports(path, set(mods)) if top and m in mods and m != name}
             for name, path in mods.items()}
    assert "connectors.chunk_plan" in graph["connectors.engine_min"]
    assert find_cycle(graph) is None
