"""The shared vocabulary is defined once (fsdp_conformance.constants) and re-used everywhere."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from fsdp_conformance import constants
from fsdp_conformance.constants import Op

PACKAGE = pathlib.Path(constants.__file__).resolve().parent
# the op names that must never be spelled as bare strings outside constants.py
COLLECTIVES = (Op.ALL_GATHER.value, Op.REDUCE_SCATTER.value, Op.ALL_REDUCE.value)


def test_vocab_imports_no_torch():
    code = "import sys, fsdp_conformance.constants\nassert 'torch' not in sys.modules\n"
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


def test_op_reads_as_its_string():
    assert Op.ALL_GATHER == "all_gather"
    assert f"{Op.REDUCE_SCATTER}" == str(Op.REDUCE_SCATTER) == "reduce_scatter"
    assert {Op.ALL_REDUCE: 1}["all_reduce"] == 1
    assert Op("free") is Op.FREE


def test_modules_reuse_the_vocabulary():
    from fsdp_conformance import models
    from fsdp_conformance.adapters import features, registry
    from fsdp_conformance.impl import limiter
    from fsdp_conformance.suite import memory_bound

    pairs = [
        (limiter.MAX_INFLIGHT, constants.MAX_INFLIGHT),
        (memory_bound.MAX_INFLIGHT, constants.MAX_INFLIGHT),
        (registry.BUILTIN_ADAPTERS, constants.BUILTIN_ADAPTERS),
        (features.ALWAYS_WRAP, constants.ALWAYS_WRAP),
        (models.ALWAYS_WRAP, constants.ALWAYS_WRAP),
    ]
    for index, (used, defined) in enumerate(pairs):
        assert used is defined, f"pair {index}: {used!r} is a copy, not vocab's object"
    # the registry resolves exactly the built-in names, in their order
    assert tuple(registry._BUILTIN) == constants.BUILTIN_ADAPTERS


def bare_op_strings(path: pathlib.Path) -> list[str]:
    """``file:line: value`` of every code string constant naming a collective (docstrings not)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [
        f"{path.name}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and node.value in COLLECTIVES
        and id(node) not in docstrings
    ]


def test_collective_names_are_spelled_only_in_vocab():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "constants.py" and "goldens" not in path.parts:
            found += bare_op_strings(path)
    assert not found, "use fsdp_conformance.constants.Op instead of:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('X = ("all_gather", "free")\n', 1),
        ('def f(op):\n    return op == "reduce_scatter"\n', 1),
        ('"""Docstring naming "all_reduce"."""\n', 0),
        ("from fsdp_conformance.constants import Op\nX = Op.ALL_GATHER\n", 0),
    ],
)
def test_the_scan_sees_a_redefinition(tmp_path, source, expected):
    module = tmp_path / "module.py"
    module.write_text(source)
    assert len(bare_op_strings(module)) == expected
