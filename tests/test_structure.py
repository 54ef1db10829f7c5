"""The house's structure, kept true: kvlab's modules import one another one way, layer by layer
(docs/architecture.md draws the layers), and the planner stands without torch or the engine.

Every ``import`` counts, at module level or inside a function (a lazy import is still an arrow),
except those under ``if TYPE_CHECKING:`` (annotations only: nothing runs).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvlab

PACKAGE = Path(kvlab.__file__).parent

# bottom to top: a module may import from its own layer's modules and from layers below, never
# from a layer above (docs/architecture.md)
LAYERS: list[tuple[str, ...]] = [
    ("units", "progress", "data", "hardware", "dtypes"),  # plain facts and helpers
    ("spec",),  # a model config as numbers
    ("gguf", "layout"),  # the GGUF reader; what the engine holds, in numbers
    ("catalog", "eviction"),  # named models; token eviction policies
    ("options", "plan"),  # every option, defined once; the planner (torch-free)
    ("kernels",),  # C kernels and oneDNN, run as told
    ("dispatch",),  # what runs here, decided once
    ("models", "sampling"),  # the model and its layers; logits to tokens
    ("engine",),  # the paged engine
    ("generate", "evaluate", "ruler"),  # the generation loop; quality under eviction, its tasks
    ("measure", "bench", "demo"),
    ("server", "render", "plots"),
    ("cli",),
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("kvlab", *path.relative_to(PACKAGE).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The kvlab modules ``path`` imports (a ``from package import name`` of a submodule counts
    as that submodule)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}

    def owner(name: str) -> str:
        while name not in known:
            name = name.rpartition(".")[0]
        return name

    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out |= {owner(a.name) for a in node.names if a.name.split(".")[0] == "kvlab"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "kvlab":
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.add(full if full in known else owner(node.module))  # type: ignore[arg-type]
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def layer(module: str) -> int | None:
    """The module's layer; None for entry points (``kvlab``'s lazy public API, ``__main__``s)."""
    parts = module.split(".")
    if module == "kvlab" or parts[-1] == "__main__":
        return None
    return RANK[parts[1]]


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in graph() if m != "kvlab" and m.split(".")[1] not in RANK | {"__main__": 0})
    assert not unplaced, f"modules in no layer of LAYERS: {unplaced}"


def test_no_module_imports_from_a_layer_above_it():
    upward = sorted(f"{m} -> {t}" for m, targets in graph().items() for t in targets
                    if layer(m) is not None and layer(t) is not None and layer(t) > layer(m))
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_the_import_graph_has_no_cycle():
    """A package's ``__init__`` may re-export its submodules; a submodule importing its own
    package's ``__init__`` back would close a loop, and counts."""
    edges = graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_see_a_planted_upward_import_and_cycle(tmp_path):
    """The graph is read from the source as written: an arrow planted in a copy shows."""
    known = {"kvlab.plan": tmp_path / "plan.py", "kvlab.engine": tmp_path / "engine.py"}
    known["kvlab.plan"].write_text("def f():\n    from kvlab.engine import LLMEngine\n")
    known["kvlab.engine"].write_text("import kvlab.plan\nif TYPE_CHECKING:\n    import kvlab.cli\n")
    assert imports(known["kvlab.plan"], known) == {"kvlab.engine"}
    assert imports(known["kvlab.engine"], known) == {"kvlab.plan"}
    assert layer("kvlab.engine") > layer("kvlab.plan")


def test_the_planner_imports_without_torch_or_the_engine():
    code = ("import sys, kvlab.plan, kvlab.options, kvlab.layout\n"
            "loaded = [m for m in ('torch', 'kvlab.engine', 'kvlab.models', 'kvlab.kernels') if m in sys.modules]\n"
            "print(','.join(loaded))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
