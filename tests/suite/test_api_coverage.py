"""docs/api_coverage.md is the API surface of the running torch with what drives each item, and
cannot drift: every item of the live signatures is in it, every in-scope item is driven by a
registered check, and every item a check declares exists ([Note: API surface])."""

from __future__ import annotations

import pathlib

import pytest
import torch

import fsdp_conformance.suite  # noqa: F401  (registers the checks)
from fsdp_conformance.adapters._support import release
from fsdp_conformance.suite import api_coverage

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api_coverage.md"
CI_TORCH = (2, 13)  # the table is generated on CI's torch (.ci/run)


def test_every_item_of_the_running_torch_is_in_the_table():
    text = DOC.read_text()
    missing = [item for item in api_coverage.surface() if f"| `{item}` |" not in text]
    assert not missing, (
        f"docs/api_coverage.md lacks {len(missing)} item(s) of torch {torch.__version__}: "
        f"{missing}; drive them from a check (@check(..., api=...)) or add them to "
        "api_coverage.OUT_OF_SCOPE, then regenerate (python -m fsdp_conformance.suite.api_coverage)"
    )


@pytest.mark.skipif(release(torch.__version__)[:2] != CI_TORCH, reason="generated on torch 2.13")
def test_the_table_is_fresh_and_every_in_scope_item_is_driven():
    assert DOC.read_text() == api_coverage.table(), (
        "docs/api_coverage.md is stale: python -m fsdp_conformance.suite.api_coverage > "
        "docs/api_coverage.md"
    )
    surface = set(api_coverage.surface())
    driven = api_coverage.drivers()
    assert not set(driven) - surface, f"checks declare unknown items: {set(driven) - surface}"
    assert set(api_coverage.OUT_OF_SCOPE) <= surface and len(api_coverage.OUT_OF_SCOPE) <= 12
    undriven = sorted(surface - set(driven) - set(api_coverage.OUT_OF_SCOPE))
    assert not undriven, f"{len(undriven)} in-scope items are driven by no check: {undriven}"


def test_items_come_from_the_signatures(monkeypatch):
    """A parameter added to the live signature becomes items (both forms of a union member)."""
    import torch.distributed.fsdp as fsdp

    def fully_shard(module, *, mesh=None, new_knob: bool | int | None = None):
        pass

    monkeypatch.setattr(fsdp, "fully_shard", fully_shard)
    items = api_coverage.surface()
    for form in ("True", "False", "int"):
        assert f"fully_shard(new_knob={form})" in items
    assert "fully_shard(reshard_after_forward=int)" not in items
