"""The package's import layering, read from the source (ast; nothing imported): no import cycle among the modules of
``longattn/backends/`` (inside functions too; ``test_package_layout`` checks the whole package), and no import from ``longattn/backends/`` up into the public-API layer
(the package itself, ``functional``, ``varlen``, ``kvcache``, ``runner``, ``ops``, ``utils``,
``flash_attn_interface``, ``nn/``, ``distributed/``, ``integrations/``, ``bench/``) at all,
except the imports inside functions listed in :data:`ALLOWED_UPWARD` with their reason."""
import ast
import pathlib
from typing import Dict, List, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parent.parent / "longattn"
BACKENDS = "longattn.backends"
PUBLIC = ("longattn", "longattn.functional", "longattn.varlen", "longattn.kvcache", "longattn.runner", "longattn.ops",
          "longattn.utils", "longattn.flash_attn_interface")
PUBLIC_PACKAGES = ("longattn.nn", "longattn.distributed", "longattn.integrations", "longattn.bench")

# (importing module, imported module) -> why an import inside a function may reach up (none today).
ALLOWED_UPWARD: Dict[Tuple[str, str], str] = {}


def _modules() -> Dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _targets(module: str, node) -> List[str]:
    """The modules an import statement of ``module`` names (``from a import b``: ``a.b`` where that is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
        package = package[:len(package) - (node.level - 1)]
        prefix = ".".join(package + ([node.module] if node.module else []))
    else:
        prefix = node.module
    return [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in MODULES else prefix for alias in node.names]


def _is_type_checking(node) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(module: str) -> List[Tuple[str, bool, int]]:
    """``(imported module, inside a function, line)`` for every import of ``module`` of a ``longattn`` module
    (those under ``if TYPE_CHECKING`` left out: they never run)."""
    found = []

    def walk(node, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((t, in_function, child.lineno) for t in _targets(module, child)
                             if t == "longattn" or t.startswith("longattn."))
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(ast.parse(MODULES[module].read_text()), False)
    return found


def _public(module: str) -> bool:
    return module in PUBLIC or any(module == p or module.startswith(p + ".") for p in PUBLIC_PACKAGES)


def _backend(module: str) -> bool:
    return module == BACKENDS or module.startswith(BACKENDS + ".")


def upward_imports() -> List[str]:
    return [f"{m} imports {t} (line {line}{', in a function' if in_fn else ''})"
            for m in sorted(MODULES) if _backend(m)
            for t, in_fn, line in imports(m)
            if _public(t) and not (in_fn and (m, t) in ALLOWED_UPWARD)]


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (or a module importing itself): Tarjan's."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def backend_graph() -> Dict[str, Set[str]]:
    """Imports among the backends' modules, inside functions too (a lazy import is a dependency all the same)."""
    return {m: {t for t, _, _ in imports(m) if _backend(t) and t != m} for m in MODULES if _backend(m)}


def test_the_walk_sees_the_backends_imports():
    graph = backend_graph()
    assert "longattn.backends.triton.planner" in graph
    assert "longattn.backends.routing" in graph["longattn.backends.triton.planner"]
    assert "longattn.backends.kernel_args" in graph["longattn.backends.gluon.launch"]
    assert any(t == "longattn.call" for t, _, _ in imports("longattn.backends.triton.planner"))
    # an import inside a function is seen, and told apart (the planner's of the fused backward's module)
    assert ("longattn.backends.gluon.bwd_fused", True) in {(t, fn) for t, fn, _ in
                                                           imports("longattn.backends.triton.planner")}


def test_no_import_cycle_among_the_backends():
    assert cycles(backend_graph()) == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}}) == [["a"]] and cycles({"a": {"b"}, "b": set()}) == []


def test_no_backend_imports_up_into_the_public_api():
    assert upward_imports() == []
    assert _public("longattn.distributed.ring") and _public("longattn") and not _public("longattn.call")
    for (m, t), why in ALLOWED_UPWARD.items():
        assert m in MODULES and t in MODULES and why, (m, t)
        assert (t, True) in {(x, fn) for x, fn, _ in imports(m)}, f"stale allowance: {m} -> {t}"


# Modules that reach the backends only through the runner (``runner.forward``/``runner.backward``/``runner.run``,
# or ``ops``): the sequence-parallel schemes' blocks. Every module of ``longattn/distributed/`` today.
THROUGH_THE_RUNNER = tuple(m for m in MODULES if m.startswith("longattn.distributed."))


def test_the_sequence_parallel_schemes_reach_the_backends_through_the_runner():
    """The ring's and the packed ring's blocks (and every other distributed module) run through the runner: no import
    of ``longattn.backends``, inside functions neither."""
    assert {"longattn.distributed.ring", "longattn.distributed.ring_varlen"} <= set(THROUGH_THE_RUNNER)
    found = [f"{m} imports {t} (line {line})" for m in THROUGH_THE_RUNNER for t, _, line in imports(m) if _backend(t)]
    assert found == []
    assert any(t == "longattn.runner" for t, _, _ in imports("longattn.distributed.ring_varlen"))
