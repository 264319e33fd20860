"""The package's layout: no import cycle between longattn's modules, library tests independent of the benchmark,
the benchmark scripts outside the installed package, and a module's name enough to find it.

The package parsed is the one ``import longattn`` loads, and the tests and ``pyproject.toml`` those of the
repository it lives in (skipped for an installed copy without them)."""
from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest

import longattn

PACKAGE = Path(longattn.__file__).resolve().parent
ROOT = PACKAGE.parent
# The benchmark's own tests: the only test files that may import longattn.bench or the scripts of benchmarks/.
BENCH_TESTS = ("test_cli.py", "test_bench_*.py")
# Modules that may share a basename: package files, and the parallel kernels of the Triton and Gluon backends.
SHARED_BASENAMES = {"__init__.py", "fwd.py", "bwd.py", "launch.py"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, (ast.Name, ast.Attribute)) and ast.unparse(test).endswith("TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every import statement of a module, in function bodies too (a lazy import is a dependency all the same),
    except under ``if TYPE_CHECKING:`` (never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(child for child in ast.iter_child_nodes(node) if not _type_checking_only(child))


def _imported(node: ast.AST, importer: str, is_package: bool, modules) -> Set[str]:
    """The modules of ``modules`` an import statement in module ``importer`` names: for ``from a import b`` the
    module ``a.b`` if there is one, else ``a``."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    base = node.module or ""
    if node.level:
        here = importer.split(".") if is_package else importer.split(".")[:-1]
        here = here[:len(here) - (node.level - 1)]
        base = ".".join(here + ([base] if base else []))
    found = set()
    for alias in node.names:
        full = f"{base}.{alias.name}"
        if full in modules:
            found.add(full)
        elif base in modules:
            found.add(base)
    return found


def import_graph() -> Dict[str, Set[str]]:
    """``module -> the longattn modules it imports``."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = set().union(*(_imported(n, name, path.name == "__init__.py", modules) for n in _imports(tree)))
        graph[name].discard(name)
    return graph


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """A cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "longattn.bench.results" in graph["longattn.bench.report"]  # a module-level import
    assert "longattn.bench.suites" in graph["longattn.cli"]  # an import inside a function


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _test_files() -> List[Path]:
    tests = ROOT / "tests"
    if not tests.is_dir():
        pytest.skip(f"no tests/ beside the imported package {PACKAGE}")
    return sorted(tests.rglob("*.py"))


def _benchmark_imports(path: Path) -> List[str]:
    """What ``path`` imports of the benchmark: ``longattn.bench...``, ``benchmarks...`` or a ``bench_*`` script
    (also through ``importlib.import_module("...")``)."""
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args:
            names += [node.args[0].value] if isinstance(node.args[0], ast.Constant) else []
    return sorted({n for n in names if isinstance(n, str) and (
        n == "longattn.bench" or n.startswith(("longattn.bench.", "benchmarks", "bench_")))})


def test_library_tests_do_not_import_the_benchmark():
    offenders = {str(p.relative_to(ROOT)): found for p in _test_files()
                 if not any(p.match(pattern) for pattern in BENCH_TESTS) and (found := _benchmark_imports(p))}
    assert not offenders, f"library tests importing the benchmark (use longattn.utils or a test helper): {offenders}"


def test_the_bench_test_patterns_match_bench_tests_only():
    names = {p.name for p in _test_files() if any(p.match(pattern) for pattern in BENCH_TESTS)}
    assert "test_cli.py" in names
    assert all(n == "test_cli.py" or n.startswith("test_bench_") for n in names)


def test_installed_packages_are_the_library_only():
    """``pyproject.toml``'s package discovery finds the packages of ``longattn/`` (directories with an
    ``__init__.py``) and nothing else: no benchmark scripts, no leftover directory."""
    if sys.version_info < (3, 11):
        pytest.skip("tomllib needs Python 3.11")
    import tomllib

    from setuptools import find_namespace_packages, find_packages

    pyproject = ROOT / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip(f"no pyproject.toml beside the imported package {PACKAGE}")
    find = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["packages"]["find"]
    discover = find_namespace_packages if find.get("namespaces", True) else find_packages
    found = set(discover(str(ROOT), include=find.get("include", ["*"]), exclude=find.get("exclude", ())))
    library = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert found == library, f"shipped but not library packages: {sorted(found - library)}"
    assert not any("tables" in name.split(".") or name.startswith("benchmarks") for name in found)


def test_module_basenames_are_unique():
    """A module's file name says which one it is: no two share one, but for package files and the parallel
    kernel modules of the Triton and Gluon backends."""
    counts = Counter(p.name for p in PACKAGE.rglob("*.py"))
    shared = {name: sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob(name))
              for name, n in counts.items() if n > 1 and name not in SHARED_BASENAMES}
    assert not shared, f"modules sharing a name: {shared}"
