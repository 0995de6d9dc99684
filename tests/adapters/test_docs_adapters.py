"""docs/adapters.md (the tutorial) keeps up with the code: its one table of every protocol name
and its table of removed names equal the code both ways (at most 45 protocol names), every
`Feature` is named there, and every name it tells an implementer to import exists."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from fsdp_conformance.adapters import ALL_FEATURES, Adapter, Declarations, _removed, base

DOC = Path(__file__).resolve().parents[2] / "docs" / "adapters.md"
MAX_PROTOCOL_NAMES = 45


def _code_spans() -> list[str]:
    text = DOC.read_text()
    return re.findall(r"`([^`\n]+)`", text) + re.findall(r"```python\n(.*?)```", text, re.DOTALL)


def _table(heading: str) -> list[list[str]]:
    """The rows of the first Markdown table after `heading`, without its header."""
    text = DOC.read_text()
    assert heading in text, f"docs/adapters.md lost its section {heading!r}"
    rows = []
    for line in text.split(heading, 1)[1].splitlines():
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


def _first_name(cell: str) -> str:
    """The name a cell spells first in backticks: `wrap(...)` -> wrap, `pkg.mod.X` -> X."""
    span = re.search(r"`([^`]+)`", cell).group(1)
    return re.match(r"[\w.]+", span).group(0).rsplit(".", 1)[-1]


def test_the_one_table_of_protocol_names_is_the_code() -> None:
    documented = [_first_name(row[0]) for row in _table("### Every protocol name")]
    assert len(documented) == len(set(documented)), documented
    members = {name for name in dir(Adapter) if not name.startswith("_")}
    # the primitives: what Adapter's methods call on a subclass
    primitives = set(re.findall(r'_primitive\(self, "(_\w+)"', Path(base.__file__).read_text()))
    fields = {field.name for field in dataclasses.fields(Declarations)}
    assert len(primitives) == 5, primitives
    code = members | primitives | fields
    assert not set(documented) - code, f"documented, not in the code: {set(documented) - code}"
    assert not code - set(documented), f"in the code, not documented: {code - set(documented)}"
    assert len(documented) <= MAX_PROTOCOL_NAMES, len(documented)


def test_the_removed_names_table_is_the_code() -> None:
    documented = {
        _first_name(row[0]): row[1].replace("`", "") for row in _table("## Removed names")
    }
    assert documented == {**_removed.REMOVED_MEMBERS, **_removed.REMOVED_EXPORTS}


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
