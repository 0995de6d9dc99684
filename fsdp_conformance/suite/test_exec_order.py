"""Ranks running instances in different orders get a clear error (``exec_order.divergent``),
and ``expect_error``, which the misuse checks (test_bad_inputs.py) share.

[Note: misuse]
Each misuse must raise within ``DEADLINE_S`` (the harness timeout catches a hang) with a message
naming the problem (an implementation-neutral regular expression per case). Every rank makes
the same mistake, so an implementation raising before any collective leaves no rank waiting.
An adapter accepting a misuse silently fails, unless it declares the deviation."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_conformance.checks import CheckFailure

from .declare import check
from .verdict import failure_line

# generous for a loaded machine; the harness timeout (default 120 s) is the backstop
DEADLINE_S = 30.0
WIDTH = 8


def expect_error(action: Callable[[], Any], pattern: str, label: str) -> BaseException:
    """Run ``action``: it must raise within ``DEADLINE_S`` with a message matching ``pattern``;
    else ``CheckFailure`` "no error raised", "an error raised too late" (``seconds``) or, raised
    *from* the error, "an error that does not name the problem" (``error``: its type and first
    line, as ``verdict.failure_line`` writes them)."""
    start = time.perf_counter()
    try:
        action()
    except Exception as error:
        elapsed = time.perf_counter() - start
        message = f"{type(error).__name__}: {error}"
        if elapsed > DEADLINE_S:
            raise CheckFailure(
                f"{label}: raised only after {elapsed:.1f} s (expected within "
                f"{DEADLINE_S:g} s): {message}",
                "an error raised too late",
                seconds=round(elapsed, 1),
            ) from error
        if not re.search(pattern, message, re.IGNORECASE | re.DOTALL):
            # some other error: reported as the cause, so "accepts the misuse" does not cover it
            raise CheckFailure(
                f"{label}: the error does not name the problem (expected a message matching "
                f"{pattern!r}), got {message}",
                "an error that does not name the problem",
                error=failure_line(error),
            ) from error
        return error
    raise CheckFailure(
        f"{label}: no exception was raised (expected one matching {pattern!r})", "no error raised"
    )


class TwoBranches(nn.Module):
    """A root Linear and two wrapped Linears, run in either order; of the same shape, so an
    implementation not checking the order exchanges matching all-gathers instead of hanging."""

    def __init__(self, wrap: Callable[[nn.Module], nn.Module]) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        linears = [nn.Linear(WIDTH, WIDTH) for _ in range(3)]
        with torch.no_grad():
            for linear in linears:
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator))
        self.stem = linears[0]
        self.branch_a = wrap(linears[1])
        self.branch_b = wrap(linears[2])
        self.swapped = False  # run branch_b before branch_a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if self.swapped:
            return self.branch_a(self.branch_b(x))
        return self.branch_b(self.branch_a(x))


class BaseExecOrderTests:
    """Rank 1 runs ``branch_b`` before ``branch_a``: every rank must raise within
    ``DEADLINE_S`` with a message about the order naming a divergent instance, never hang."""

    @check(
        "exec_order.divergent",
        "ranks running instances in different orders get a clear error",
        strict=False,
    )
    @pytest.mark.world_size(2)
    def test_divergent_exec_order_raises(self, fsdp_adapter: Any, dist: Any):
        wrap = fsdp_adapter.wrapper()
        model = fsdp_adapter.wrap(TwoBranches(wrap), root=True)
        fsdp_adapter.unwrap(model).swapped = dist.rank == 1
        x = torch.ones(2, WIDTH, device=dist.device)
        expect_error(
            lambda: fsdp_adapter.backward(model, model(x).sum()),
            r"order.*branch_[ab]|branch_[ab].*order",
            f"adapter {fsdp_adapter.name!r}, rank {dist.rank} running "
            f"{'branch_b, branch_a' if dist.rank == 1 else 'branch_a, branch_b'}",
        )


class TestExecOrder(BaseExecOrderTests): ...
