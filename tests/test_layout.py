"""The package's layers, held against its imports: nothing imports a layer above its own, and no
modules import each other in a circle (lazy imports inside functions included: a circle there is
still one module needing the other to work).

Bottom to top (README "Layout"): utilities; the library core, itself ordered from the row formats
and the ops up to the model; training; experiments; integrations (the checkpoint format first,
then each library's adapter); conversions; the command line.
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Each part is a module or a package (a prefix of dotted names); a module may import its own part
# and any part before it in this list.
PARTS = [
    "qkmla.utils",
    "qkmla.dtypes", "qkmla.kv_formats", "qkmla.ops", "qkmla.rope", "qkmla.config", "qkmla.norms",
    "qkmla.cache", "qkmla.attention", "qkmla.model",
    "qkmla.train",
    "qkmla.experiments",
    "qkmla.integrations.hub", "qkmla.integrations.transformers", "qkmla.integrations.vllm",
    "qkmla.integrations.torchtitan",
    "qkmla.convert",
    "qkmla.cli", "qkmla.__main__",
]
FACES = {"qkmla", "qkmla.integrations"}  # package faces that only hand names on (docstring, re-exports)


def modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "qkmla").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The qkmla modules ``name`` imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # "from pkg import module" imports the module (the package is its parent, already loading)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # an imported name resolves to the module holding it
                t = t.rpartition(".")[0]
            if t.startswith("qkmla") and t != name:
                out.add(t)
    return out


def part_of(name: str) -> int:
    matches = [i for i, p in enumerate(PARTS) if name == p or name.startswith(p + ".")]
    assert matches, f"{name}: a module on no layer; add it to PARTS (and the README's layout)"
    return max(matches, key=lambda i: len(PARTS[i]))


GRAPH = {name: imports(name, path, modules()) for name, path in modules().items()}


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if n not in FACES))
def test_no_module_imports_a_layer_above_its_own(name):
    upward = sorted(t for t in GRAPH[name] if t not in FACES and part_of(t) > part_of(name))
    assert not upward, f"{name} ({PARTS[part_of(name)]}) imports from higher layers: {upward}"


def test_the_top_level_holds_only_the_library():
    top = sorted(n for n in GRAPH if n.count(".") == 1 and (SRC / n.replace(".", "/")).with_suffix(".py").exists())
    assert top == ["qkmla.__main__", "qkmla.config", "qkmla.dtypes", "qkmla.kv_formats", "qkmla.norms", "qkmla.rope"]


def test_no_circle_of_imports():
    state, stack, circles = {}, [], []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for t in sorted(GRAPH.get(n, ())):
            if t in FACES:
                continue
            if state.get(t) == "open":
                circles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[n] = "done"

    for n in sorted(GRAPH):
        if n not in state and n not in FACES:
            visit(n)
    assert not circles, circles


def test_the_layers_are_held_by_this_test():
    """The check can fail: an import from the core up to the CLI is caught."""
    assert part_of("qkmla.attention.mla") < part_of("qkmla.cli.commands")
    assert part_of("qkmla.ops.mla_decode.backends") < part_of("qkmla.config")
    assert "qkmla.ops.mla_decode.backends" in GRAPH["qkmla.config"]
