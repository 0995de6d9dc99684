"""The layer rule of docs/architecture.md, enforced on the imports of every module.

Each module of the package belongs to one layer; a module may import (at any place in the file:
module level, inside functions, under ``TYPE_CHECKING``) only its own layer and the layers
``ALLOWED`` lists for it. The imports are read with ``ast`` from the source files.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import fsdp_conformance

PACKAGE_DIR = pathlib.Path(fsdp_conformance.__file__).resolve().parent
MODELS_DIR = PACKAGE_DIR.parent / "models"  # installed as fsdp_conformance.models

# module (or package) of fsdp_conformance -> its layer; the longest matching prefix wins
LAYER_OF: dict[str, str] = {
    "fsdp_conformance": "package",
    "fsdp_conformance._lazy": "shared",
    "fsdp_conformance.constants": "shared",
    "fsdp_conformance.training_states": "shared",
    "fsdp_conformance.device_handle": "shared",
    "fsdp_conformance._patching": "shared",
    "fsdp_conformance.collective_observer": "shared",
    "fsdp_conformance._tensors": "shared",
    "fsdp_conformance.checks": "shared",
    "fsdp_conformance.models": "models",
    "fsdp_conformance.impl": "impl",
    "fsdp_conformance.harness": "harness",
    "fsdp_conformance.adapters": "adapters",
    "fsdp_conformance.observe": "observe",
    "fsdp_conformance.suite": "suite",
    "fsdp_conformance.testing": "testing",
    "fsdp_conformance.plugin": "plugin",
    "fsdp_conformance.cli": "cli",
    "fsdp_conformance.demo": "cli",
}

# layer -> the other layers its modules may import
ALLOWED: dict[str, frozenset[str]] = {
    "shared": frozenset(),
    "package": frozenset({"shared"}),
    "models": frozenset({"shared"}),
    "impl": frozenset({"shared"}),
    "harness": frozenset({"shared"}),
    "adapters": frozenset({"shared", "impl"}),
    "observe": frozenset({"shared", "adapters"}),
    "suite": frozenset({"shared", "models", "adapters", "observe", "harness"}),
    "testing": frozenset({"shared", "models", "harness"}),
    "plugin": frozenset({"shared", "harness", "adapters"}),
    "cli": frozenset({"shared", "models", "impl", "harness", "adapters", "observe", "suite"}),
}


def layer_of(module: str) -> str | None:
    """The layer of ``module`` (None: not part of the package, e.g. torch)."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        layer = LAYER_OF.get(".".join(parts[:end]))
        if layer is not None:
            return layer
    return None


def imported_modules(path: pathlib.Path, module: str) -> list[tuple[int, str]]:
    """(line, module) of every import in the file of ``module`` (relative ones resolved;
    ``from pkg import name`` counts as ``pkg.name``, which names a submodule or lies inside
    ``pkg``'s layer either way)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        found += [(node.lineno, target) for target in import_targets(node, path, module)]
    return found


# calls that import (or look up an imported module) by a string name
_STRING_IMPORTS = frozenset(
    {
        "importlib.import_module",
        "import_module",
        "__import__",
        "importlib.util.find_spec",
        "sys.modules.get",
        "sys.modules.pop",
        "sys.modules.setdefault",
    }
)


def string_import(node: ast.AST) -> str | None:
    """The fsdp_conformance module a string import names (``importlib.import_module("...")``,
    ``sys.modules.get("...")``, ``sys.modules["..."]``), or None."""
    name = None
    if isinstance(node, ast.Call) and ast.unparse(node.func) in _STRING_IMPORTS and node.args:
        name = node.args[0]
    elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules":
        name = node.slice
    if isinstance(name, ast.Constant) and isinstance(name.value, str):
        if name.value.split(".")[0] == "fsdp_conformance":
            return name.value
    return None


def import_targets(node: ast.AST, path: pathlib.Path, module: str) -> list[str]:
    """The modules one import statement of ``module`` (file ``path``) names ([] for others);
    a string import of one of our modules counts too (``string_import``)."""
    named = string_import(node)
    if named is not None:
        return [named]
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        parts = module.split(".")
        base = parts if path.name == "__init__.py" else parts[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [f"{source}.{alias.name}" for alias in node.names]


def package_modules(package_dir: pathlib.Path, package: str) -> list[tuple[pathlib.Path, str]]:
    """(file, dotted module name) of every module under ``package_dir``."""
    modules = []
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules.append((path, ".".join([package, *parts])))
    return modules


def violations(modules: list[tuple[pathlib.Path, str]]) -> list[str]:
    """``file:line: module (layer) imports target (layer)`` for every import the rule forbids."""
    found = []
    for path, module in modules:
        source = layer_of(module)
        if source is None:
            found.append(f"{path}: module {module} belongs to no layer; add it to LAYER_OF")
            continue
        for line, target in imported_modules(path, module):
            layer = layer_of(target)
            if layer is None or layer == source or layer in ALLOWED[source]:
                continue
            found.append(f"{path.name}:{line}: {module} ({source}) imports {target} ({layer})")
    return found


def all_modules() -> list[tuple[pathlib.Path, str]]:
    modules = package_modules(PACKAGE_DIR, "fsdp_conformance")
    modules += package_modules(MODELS_DIR, "fsdp_conformance.models")
    return [(path, module) for path, module in modules if "goldens" not in path.parts]


def test_every_layer_has_its_rule():
    assert set(LAYER_OF.values()) == set(ALLOWED)


def test_the_package_keeps_the_layer_rule():
    modules = all_modules()
    assert len(modules) > 50  # the walk found the package
    problems = violations(modules)
    assert not problems, "imports against docs/architecture.md:\n" + "\n".join(problems)


def test_the_documented_rule_is_this_rule():
    doc = (PACKAGE_DIR.parent / "docs" / "architecture.md").read_text()
    for layer, allowed in ALLOWED.items():
        expected = ", ".join(sorted(allowed)) if allowed else "nothing"
        assert f"| {layer} | {expected} |" in doc, f"docs/architecture.md: row of {layer!r}"


@pytest.mark.parametrize(
    ("relative", "source", "expected"),
    [
        ("impl/bad.py", "from fsdp_conformance.suite import overlap\n", "(impl) imports"),
        ("impl/bad.py", "def f():\n    from fsdp_conformance import plugin\n", "(plugin)"),
        ("harness/bad.py", "from fsdp_conformance.adapters import get_adapter\n", "(adapters)"),
        ("observe/bad.py", "from ..impl.device import CPUDeviceHandle\n", "(impl)"),
        ("observe/pkg/__init__.py", "from ...impl import device\n", "(impl)"),
        ("constants.py", "import fsdp_conformance.harness\n", "(shared) imports"),
        (
            "harness/bad.py",
            "import sys\nreg = sys.modules.get('fsdp_conformance.adapters.registry')\n",
            "(harness) imports fsdp_conformance.adapters.registry (adapters)",
        ),
        (
            "harness/bad.py",
            "import importlib\nm = importlib.import_module('fsdp_conformance.suite.zoo')\n",
            "(suite)",
        ),
        (
            "harness/bad.py",
            "import sys\nb = sys.modules['fsdp_conformance.adapters.base']\n",
            "(adapters)",
        ),
        ("impl/good.py", "from fsdp_conformance import constants\nfrom . import state\n", None),
        ("adapters/good.py", "from fsdp_conformance.impl import device\nimport torch\n", None),
    ],
)
def test_a_violating_module_is_reported(tmp_path, relative, source, expected):
    package = tmp_path / "fsdp_conformance"
    module_path = package / relative
    module_path.parent.mkdir(parents=True)
    module_path.write_text(source)
    found = violations(package_modules(package, "fsdp_conformance"))
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and expected in found[0], found


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (module -> modules it imports) as a path, or None."""
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> list[str] | None:
        if module in visiting:
            return [*visiting[visiting.index(module) :], module]
        if module in done or module not in graph:
            return None
        visiting.append(module)
        for target in sorted(graph[module]):
            cycle = visit(target)
            if cycle:
                return cycle
        visiting.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module)
        if cycle:
            return cycle
    return None


def test_the_cycle_finder_finds_a_function_level_cycle():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def impl_import_graph(modules: list[tuple[pathlib.Path, str]]) -> dict[str, set[str]]:
    """impl module -> the impl modules it imports (anywhere: inside functions and under
    ``TYPE_CHECKING`` too; a type-only cycle is still a cycle of the design)."""
    graph: dict[str, set[str]] = {}
    for path, module in modules:
        if layer_of(module) == "impl" and path.name != "__init__.py":
            graph[module] = {
                target
                for _, target in imported_modules(path, module)
                if target.startswith("fsdp_conformance.impl.")
            }
    # ``from fsdp_conformance.impl import trace`` names the module impl.trace
    return {
        module: {t if t in graph else t.rsplit(".", 1)[0] for t in targets} - {module}
        for module, targets in graph.items()
    }


def test_impl_has_no_import_cycle():
    """impl's imports (inside functions and ``TYPE_CHECKING`` blocks too) form no cycle."""
    graph = impl_import_graph(all_modules())
    assert len(graph) >= 10, sorted(graph)
    cycle = import_cycle(graph)
    assert cycle is None, "impl import cycle: " + " -> ".join(cycle)


def test_a_type_checking_only_cycle_is_found(tmp_path):
    (tmp_path / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from fsdp_conformance.impl.b import B\n"
    )
    (tmp_path / "b.py").write_text("def f():\n    from fsdp_conformance.impl.a import A\n")
    modules = package_modules(tmp_path, "fsdp_conformance.impl")
    cycle = import_cycle(impl_import_graph(modules))
    a, b = "fsdp_conformance.impl.a", "fsdp_conformance.impl.b"
    assert cycle == [a, b, a]
