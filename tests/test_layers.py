"""The package's layers point one way: no module imports a layer above its own,
and the module import graph has no cycle (docs/architecture.md)."""

from __future__ import annotations

import ast
import pathlib

import kvstage

ROOT = pathlib.Path(kvstage.__file__).parent
#: bottom to top; a module may import its own layer and the ones before it
LAYERS = (
    ("errors", "config", "cudart", "metrics", "native", "ids"),
    ("layout",),
    ("tp",),
    ("link",),
    ("transports",),
    ("staging",),
    ("protocol",),
    ("plugin", "bench", "probe", "cli", "__init__", "__main__"),
)


def _layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else "__init__"
    return next(i for i, names in enumerate(LAYERS) if part in names)


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(path: pathlib.Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvstage") and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvstage"))
    return found


def test_no_module_imports_a_layer_above_its_own():
    mods = _modules()
    bad = []
    for name, path in mods.items():
        if name == "kvstage":
            continue  # the package's face: exports the public API, imported on first use
        for target in _imports(path, top_level_only=False):
            if target in mods or target.rsplit(".", 1)[0] in mods:
                if _layer(target) > _layer(name):
                    bad.append(f"{name} imports {target}")
    assert not bad, "\n".join(sorted(bad))


def test_the_module_import_graph_has_no_cycle():
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for target in _imports(path, top_level_only=True):
            mod = target if target in mods else target.rsplit(".", 1)[0]
            if mod in mods and mod != name:
                deps.add(mod)
        graph[name] = deps
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in graph[node]:
            if state.get(dep) == 1:
                cycle = trail[trail.index(dep):] + [dep] if dep in trail else [node, dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, trail + [dep])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_the_public_api_is_importable_from_the_package():
    for name in kvstage.__all__:
        assert getattr(kvstage, name) is not None, name
