"""The package's layers import one way, as drawn in pipelinerl_jax/__init__.py.

- Every module belongs to exactly one layer (a new module must be placed).
- Importing all of a layer, in a fresh interpreter, loads no module of a later layer.
- No module imports a later layer anywhere in its source, function bodies included, and the
  package has no import circle, hidden ones included.
- A function-level import of the package's own modules says why on the line above it (only
  optional heavy dependencies are deferred on purpose).
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pipelinerl_jax"

# Top-level names of pipelinerl_jax (a module or a subpackage), by layer, first to last.
LAYERS = (
    (
        "foundation",
        ("errors", "cli", "interrupts", "glibc_malloc", "sharding", "kernels", "models"),
    ),
    ("parts", ("rewards", "data", "envs", "rl", "sampler")),
    ("train", ("train",)),
    ("run", ("pipeline", "distributed")),
    (
        "app",
        (
            "config_cli",
            "config_schema",
            "presets",
            "evaluate",
            "evaluate_settings",
            "generate",
            "export",
            "dry_run",
            "plan",
        ),
    ),
)
LAYER_OF = {name: i for i, (_, names) in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYER_OF.get(parts[1]) if len(parts) > 1 else -1  # the package itself: below all


def _imports(module: str, path: Path):
    """(target module, line, inside a function) for each import of a package module."""
    tree = ast.parse(path.read_text())
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(n) for n in ast.walk(node))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".")[: len(module.split(".")) - (0 if is_package else 1)]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([base] if base else []))
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        for target in targets:
            if target.startswith("pipelinerl_jax") and target != "pipelinerl_jax":
                while target not in MODULES:  # pipelinerl_jax.x.name -> pipelinerl_jax.x
                    target = target.rpartition(".")[0]
                yield target, node.lineno, id(node) in in_function


def test_every_module_has_one_layer():
    names = [n for _, ns in LAYERS for n in ns]
    assert len(names) == len(set(names))
    unplaced = sorted(m for m in MODULES if _layer(m) is None)
    assert not unplaced, f"place these in LAYERS (and the package docstring): {unplaced}"


def test_the_package_docstring_draws_these_layers():
    import pipelinerl_jax

    doc = pipelinerl_jax.__doc__
    drawn = doc.split("Layers.", 1)[1].split("\n\n", 2)[1]  # the block of layer lines
    for i, (name, names) in enumerate(LAYERS):
        entry = drawn.split(f"{i} {name}", 1)
        assert len(entry) == 2, f"layer '{i} {name}' is not drawn in pipelinerl_jax/__init__.py"
        entry = entry[1].split(f"{i + 1} ", 1)[0]
        for n in names:
            assert n in entry, f"{n} is not drawn on layer {i}: {entry!r}"


def test_no_module_imports_a_later_layer():
    later = [
        f"{m}:{line} imports {t} (layer {_layer(t)} > {_layer(m)})"
        for m, path in MODULES.items()
        for t, line, _ in _imports(m, path)
        if _layer(t) > _layer(m)
    ]
    assert not later, "\n".join(later)


def test_no_import_circles():
    edges = {m: {t for t, _, _ in _imports(m, p) if t != m} for m, p in MODULES.items()}
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for m in MODULES:
        if m not in index:
            visit(m)
    assert not circles, circles


def test_function_level_imports_say_why():
    unexplained = []
    for m, path in MODULES.items():
        lines = path.read_text().splitlines()
        for _, line, inside in _imports(m, path):
            if inside and not lines[line - 2].strip().startswith("#"):
                unexplained.append(f"{path.relative_to(ROOT)}:{line}")
    assert not unexplained, "import at the top, or say why not above it: " + ", ".join(unexplained)


_CHILD = """
import importlib, json, sys
loaded, skipped = [], []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if (e.name or "").startswith("pipelinerl_jax"):
            raise
        skipped.append([name, e.name])  # an optional dependency this environment lacks
print(json.dumps({"modules": sorted(m for m in sys.modules if m.startswith("pipelinerl_jax")),
                  "skipped": skipped}))
"""


@pytest.mark.parametrize("layer", range(len(LAYERS)), ids=[name for name, _ in LAYERS])
def test_importing_a_layer_loads_nothing_later(layer):
    mine = [m for m in MODULES if _layer(m) == layer and not m.endswith("__main__")]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *mine],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    later = [m for m in report["modules"] if _layer(m) > layer]
    assert not later, f"importing layer {LAYERS[layer][0]} loaded {later}"
