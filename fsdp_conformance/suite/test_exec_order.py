"""Ranks running instances in different orders get a clear error (``exec_order.divergent``;
[Note: misuse] in test_bad_inputs.py).

    class TestMyExecOrder(BaseExecOrderTests):   # in your tests; pytest collects Test* classes
        pass
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from .declare import check
from .test_bad_inputs import WIDTH, expect_error


class TwoBranches(nn.Module):
    """A root Linear and two wrapped Linears of the same shape, run in either order.

    Same shapes on purpose: an implementation that does not check the order exchanges
    matching all-gathers (wrong data, no hang), so the check fails quickly instead of hanging.
    """

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
        first, second = (
            (self.branch_b, self.branch_a) if self.swapped else (self.branch_a, self.branch_b)
        )
        return second(first(x))


class BaseExecOrderTests:
    """Ranks running FSDP instances in different orders get a clear error, never a hang.

    Rank 1 runs ``branch_b`` before ``branch_a`` in the first iteration; every rank must raise
    within ``DEADLINE_S`` with a message about the execution order naming a divergent instance
    (``branch_a`` or ``branch_b``).
    """

    @check(
        "exec_order.divergent",
        "ranks running instances in different orders get a clear error",
        strict=False,
    )
    @pytest.mark.world_size(2)
    def test_divergent_exec_order_raises(self, fsdp_adapter: Any, dist: Any):
        adapter = fsdp_adapter
        wrap = adapter.wrapper()
        model = adapter.wrap(TwoBranches(wrap), root=True)
        adapter.unwrap(model).swapped = dist.rank == 1
        x = torch.ones(2, WIDTH, device=dist.device)

        def iteration() -> None:
            adapter.backward(model, model(x).sum())

        expect_error(
            iteration,
            r"order.*branch_[ab]|branch_[ab].*order",
            f"adapter {adapter.name!r}, rank {dist.rank} running "
            f"{'branch_b, branch_a' if dist.rank == 1 else 'branch_a, branch_b'}",
        )


class TestExecOrder(BaseExecOrderTests):
    pass
