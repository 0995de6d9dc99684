"""Typed parent <-> rank messages: a message of an unexpected type fails the test with a
ProtocolError naming the rank and the message, instead of being misread; and rank-side
assertion explanations survive both shapes of pytest's private ``assertrepr_compare``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from conftest import write_test
from fsdp_conformance.harness import rank, wire

pytest_plugins = ["pytester"]


def test_expect_rejects_an_unknown_message() -> None:
    assert wire.expect(wire.Started(), "rank 0", wire.Started) == wire.Started()
    with pytest.raises(wire.ProtocolError, match=r"unexpected message from rank 1: \('run',"):
        wire.expect(("run", b""), "rank 1", wire.Started, wire.Finished)


def test_parent_rejects_an_unknown_message_from_a_rank(pytester: pytest.Pytester) -> None:
    write_test(
        pytester,
        "test_inner",
        """
import torch
import torch.distributed as tdist

from fsdp_conformance.harness import rank


def test_a_garbles(dist):
    if dist.rank == 1:
        rank._process.conn.send(("result", "not a Finished message"))
    tdist.barrier()


def test_b_next(dist):
    t = torch.ones(1)
    tdist.all_reduce(t)
    assert t.item() == 2
""",
    )
    result = pytester.runpytest_subprocess("--fsdp-timeout=60", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            (
                "rank 1 of 2 failed: ProtocolError: unexpected message from rank 1: "
                "('result', 'not a Finished message') (expected Started or Finished)*"
            )
        ]
    )


def test_rank_side_assert_explanation(pytester: pytest.Pytester) -> None:
    write_test(
        pytester,
        "test_inner",
        """
def test_lists(dist):
    assert [1, 2, dist.rank] == [1, 2, 7]
""",
    )
    result = pytester.runpytest_subprocess("--fsdp-mode=thread", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*At index 2 diff: 0 != 7*"])


def _shape_from_pytest_9_2(
    op: str,
    left: Any,
    right: Any,
    *,
    verbose: int,
    highlighter: Any,
    assertion_text_diff_style: str,
    truncation_budget: Any = None,
) -> Iterator[str]:
    # pytest 9.2's shape: no config, required keyword-only settings, an iterator of lines
    assert (verbose, highlighter("x"), assertion_text_diff_style) == (0, "x", "ndiff")
    yield f"{left!r} {op} {right!r}"
    yield "At index 2 diff: 0 != 7"


def test_assertrepr_compare_both_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    from _pytest.assertion import util

    installed = rank._reprcompare("==", [1, 2, 0], [1, 2, 7])
    assert installed is not None and "At index 2 diff: 0 != 7" in installed
    monkeypatch.setattr(util, "assertrepr_compare", _shape_from_pytest_9_2)
    newer = rank._reprcompare("==", [1, 2, 0], [1, 2, 7])
    assert newer == "[1, 2, 0] == [1, 2, 7]\n~At index 2 diff: 0 != 7"
    monkeypatch.setattr(util, "assertrepr_compare", lambda unknown, op, left, right: ["x"])
    assert rank._reprcompare("==", 1, 2) is None  # an unknown shape: no explanation
