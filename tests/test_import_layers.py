"""Layers import downward only (docs/architecture.md, STYLE.md 20): the import graph is read from the source
(ast, every `import` and `from ... import`, lazy and TYPE_CHECKING ones included) and no arrow may go from a
lower layer to a higher one. Imports within a layer are free."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"plexrl": ROOT / "plexrl", "plexrl.operators": ROOT / "operators", "plexrl.pipelines": ROOT / "pipelines"}

# bottom to top; a module belongs to the first layer one of whose prefixes it starts with, else to "library"
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("planner", ("plexrl.planner",)),  # pure: events in, instructions out
    ("reports", ("plexrl.reports",)),  # the records that services, executors and the runner exchange
    ("library", ()),  # engines, services, operators, pipelines, config, job, data, tasks, ...
    ("hooks", ("plexrl.hooks",)),
    ("runtime", ("plexrl.runtime",)),
    ("top", ("plexrl.cluster", "plexrl.server", "plexrl.sim", "plexrl.cli", "plexrl.config_kinds")),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}


def layer(module: str) -> str:
    for name, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return name
    return "library"


def modules() -> dict[str, Path]:
    out = {}
    for pkg, base in PACKAGES.items():
        for path in base.rglob("*.py"):
            parts = [pkg, *path.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports(module: str, path: Path) -> set[str]:
    found = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found |= {f"{target}.{a.name}" for a in node.names}  # `from plexrl import x` names a module
    mods = modules()
    return {t for t in found if t.startswith("plexrl") and t in mods}


def upward_arrows() -> list[str]:
    bad = []
    for module, path in sorted(modules().items()):
        for target in sorted(imports(module, path)):
            a, b = layer(module), layer(target)
            if RANK[b] > RANK[a]:
                bad.append(f"{module} ({a}) -> {target} ({b})")
    return bad


def test_no_import_goes_from_a_lower_layer_to_a_higher_one() -> None:
    assert upward_arrows() == []


def test_the_planner_imports_only_itself() -> None:
    mods = modules()
    outside = {
        f"{m} -> {t}" for m in mods if layer(m) == "planner" for t in imports(m, mods[m]) if layer(t) != "planner"
    }
    assert outside == set()


def test_below_the_top_no_private_name_crosses_a_package() -> None:
    """A service or an engine never reaches into the runtime's private names (nor the runtime into theirs):
    below the top layer, a `_name` is imported only within its own package."""
    bad = []
    for module, path in sorted(modules().items()):
        if layer(module) == "top":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("plexrl"):
                own, theirs = module.rsplit(".", 1)[0], node.module.rsplit(".", 1)[0]
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__") and own != theirs:
                        bad.append(f"{module}: from {node.module} import {a.name}")
    assert bad == []


def test_the_check_sees_an_upward_arrow(tmp_path: Path) -> None:
    """The check itself: a lazy import inside a function counts, and services -> runtime is upward."""
    assert layer("plexrl.services.service") == "library" and layer("plexrl.runtime.runner") == "runtime"
    assert RANK[layer("plexrl.runtime.runner")] > RANK[layer("plexrl.engines.fsdp_engine")]
    src = tmp_path / "mod.py"
    src.write_text("def f():\n    from plexrl.runtime.runner import Runner\n")
    assert "plexrl.runtime.runner" in imports("plexrl.services.fake", src)
