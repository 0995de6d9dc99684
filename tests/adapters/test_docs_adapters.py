"""docs/adapters.md (the tutorial) keeps up with the code: every `Adapter` member and every
`Feature` is named there, and every name it tells an implementer to import exists."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from fsdp_conformance.adapters import ALL_FEATURES, Adapter

DOC = Path(__file__).resolve().parents[2] / "docs" / "adapters.md"
# the primitives a subclass implements (the rest of the `_` names are internal)
PRIMITIVES = ("_wrap", "_summon_full_params", "_assert_state", "_observe", "_install_device_handle")


def _code_spans() -> list[str]:
    text = DOC.read_text()
    return re.findall(r"`([^`\n]+)`", text) + re.findall(r"```python\n(.*?)```", text, re.DOTALL)


def _names_in_code() -> set[str]:
    return {word for span in _code_spans() for word in re.findall(r"\w+", span)}


def public_members() -> list[str]:
    return sorted({name for name in dir(Adapter) if not name.startswith("_")} | set(PRIMITIVES))


def test_every_adapter_member_is_documented() -> None:
    named = _names_in_code()
    missing = [name for name in public_members() if name not in named]
    assert not missing, f"docs/adapters.md does not name these Adapter members: {missing}"


def test_every_feature_is_documented() -> None:
    spans = set(_code_spans())
    missing = sorted(feature for feature in ALL_FEATURES if feature not in spans)
    assert not missing, f"docs/adapters.md does not name these features (as `name`): {missing}"


def _imports() -> list[tuple[str, str]]:
    """(module, name) of each ``from fsdp_conformance... import name`` in the Python blocks."""
    found = []
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL):
        try:
            tree = ast.parse(block)
        except SyntaxError:  # a fragment; its imports are one line each
            lines = [line for line in block.splitlines() if line.startswith("from ")]
            tree = ast.parse("\n".join(lines))
        for node in ast.walk(tree):
            module = getattr(node, "module", None) or ""
            if isinstance(node, ast.ImportFrom) and module.startswith("fsdp_conformance"):
                found += [(node.module, alias.name) for alias in node.names]
    return found


def test_the_docs_import_what_exists() -> None:
    imports = _imports()
    assert ("fsdp_conformance.adapters", "Adapter") in imports
    for module, name in imports:
        assert hasattr(importlib.import_module(module), name), f"from {module} import {name}"


@pytest.mark.parametrize(
    "name", ["Adapter", "ALL_FEATURES", "DeviceHandle", "Feature", "InstanceState", "RootState"]
)
def test_top_level_exports(name: str) -> None:
    import fsdp_conformance
    import fsdp_conformance.adapters

    assert getattr(fsdp_conformance, name) is getattr(fsdp_conformance.adapters, name)
