"""Rank processes get one intra-op thread unless the environment chooses (as torchrun does)."""

from __future__ import annotations

import pytest
from conftest import write_test

pytest_plugins = ["pytester"]

INNER = """
import os

import pytest
import torch


@pytest.mark.world_size(2)
def test_threads(dist):
    assert torch.get_num_threads() == int(os.environ["EXPECTED_THREADS"])
"""


@pytest.mark.parametrize(("chosen", "expected"), [(None, 1), ("2", 2)])
def test_rank_processes_get_one_thread_unless_chosen(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, chosen: str | None, expected: int
) -> None:
    if chosen is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", chosen)
    monkeypatch.setenv("EXPECTED_THREADS", str(expected))
    write_test(pytester, "test_inner", INNER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--fsdp-mode", "process")
    result.assert_outcomes(passed=1)
