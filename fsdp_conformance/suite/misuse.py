"""Misuse checks: divergent execution order across ranks, and bad inputs.

    class TestMyMisuse(BaseExecOrderTests, BaseBadInputTests):   # in your tests; pytest
        pass                                                   # collects Test* classes

[Note: misuse]
Each misuse must raise an exception *within seconds* (``DEADLINE_S``, generous for a loaded
machine; a hang is caught by the harness timeout as the backstop) whose message names the
problem (a per-case regular expression, implementation-neutral: the words any sensible message
would use). Every rank makes the same mistake, so an implementation that raises before any
collective raises on every rank and none is left waiting.

An adapter that accepts a misuse silently (no exception) fails the check, unless the adapter
declares it (``Adapter.known_deviations``, check ids ``exec_order.divergent`` and
``misuse.<case>``, see adapters/deviations.py): then the case is a deviation with that reason
(suite/verdict.py); an adapter that raises anyway passes. docs/checks.md records what each
adapter does and why each misuse does harm.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_conformance.adapters import Feature
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters import loop as adapter_loop

from . import verdict

# Seconds a misuse may take to raise (the harness timeout, default 120 s, is the backstop)
DEADLINE_S = 30.0
WIDTH = 8


def expect_error(action: Callable[[], Any], pattern: str, label: str) -> BaseException:
    """Run ``action``; it must raise within ``DEADLINE_S`` with a message matching ``pattern``.

    Raises:
        AssertionError: it did not raise or raised too late (what a misuse deviation covers),
            or raised an error not naming the problem (raised *from* that error, so only a
            deviation whose ``raises`` covers that error's type covers it).
    """
    start = time.perf_counter()
    try:
        action()
    except Exception as error:  # noqa: BLE001 -- any exception type is a clear refusal
        elapsed = time.perf_counter() - start
        message = f"{type(error).__name__}: {error}"
        if elapsed > DEADLINE_S:
            failure = (
                f"{label}: raised only after {elapsed:.1f} s (expected within "
                f"{DEADLINE_S:g} s): {message}"
            )
        elif not re.search(pattern, message, re.IGNORECASE | re.DOTALL):
            # not a refusal but some other error: the assertion reports it as its cause, so a
            # deviation declaring "accepts the misuse" does not cover it (Deviation.covers)
            raise AssertionError(
                f"{label}: the error does not name the problem (expected a message matching "
                f"{pattern!r}), got {message}"
            ) from error
        else:
            return error
    else:
        failure = f"{label}: no exception was raised (expected one matching {pattern!r})"
    raise AssertionError(failure)


# ---------------------------------------------------------------------------- exec order
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

    @pytest.mark.world_size(2)
    def test_divergent_exec_order_raises(self, fsdp_adapter: Any, dist: Any):
        with verdict.cell(fsdp_adapter, "exec_order.divergent"):
            adapter = fsdp_adapter
            wrap = adapter.wrapper()
            model = adapter.wrap(TwoBranches(wrap), root=True)
            adapter.unwrap(model).swapped = dist.rank == 1
            x = torch.ones(2, WIDTH, device=dist.device)

            def iteration() -> None:
                adapter_loop.backward(adapter, model, model(x).sum())

            expect_error(
                iteration,
                r"order.*branch_[ab]|branch_[ab].*order",
                f"adapter {adapter.name!r}, rank {dist.rank} running "
                f"{'branch_b, branch_a' if dist.rank == 1 else 'branch_a, branch_b'}",
            )


# ---------------------------------------------------------------------------- bad inputs
def _linear() -> nn.Linear:
    return nn.Linear(WIDTH, WIDTH)


class BaseBadInputTests:
    """Misuses that do harm, each refused with a clear error ([Note: misuse]).

    Only a misuse whose acceptance hurts is here (nesting an instance inside another, e.g.
    ``FSDP(FSDP(lin))``, is ordinary nesting for torch FSDP1 and fairscale, so it is not):

    - wrapping a module twice: two instances claim the same parameters; the first one's flat
      parameter is orphaned (its views replaced) and which instance reduces the gradients is
      undefined, so training silently diverges;
    - parameters on mixed devices (cpu and meta): a meta parameter has no data; flattening it
      with real ones fails (or trains garbage) far from the cause, at the first forward;
    - a forward inside ``summon_full_params``: the forward unshards and frees the buffers the
      context is still exposing (and a writeback would copy back what the forward freed);
    - ``summon_full_params`` inside forward: leaving the context reshards the parameters the
      running forward and backward still use;
    - ``sync_module_states`` with shapes differing across ranks: the broadcast of differing
      sizes hangs or corrupts the parameters.
    """

    @pytest.mark.world_size(2)
    def test_wrapping_a_module_twice(self, fsdp_adapter: Any, dist: Any):
        with verdict.cell(fsdp_adapter, "misuse.wrap_twice"):
            adapter = fsdp_adapter
            linear = _linear()
            adapter.wrap(linear, root=True)
            expect_error(
                lambda: adapter.wrap(linear, root=True),
                r"already|twice|again",
                f"adapter {adapter.name!r}, wrapping the same module twice",
            )

    @pytest.mark.world_size(2)
    def test_parameters_on_mixed_devices(self, fsdp_adapter: Any, dist: Any):
        with verdict.cell(fsdp_adapter, "misuse.mixed_devices"):
            adapter = fsdp_adapter
            module = nn.Sequential(_linear(), nn.Linear(WIDTH, WIDTH, device="meta"))
            expect_error(
                lambda: adapter.wrap(module, root=True),
                r"device|meta",
                f"adapter {adapter.name!r}, parameters on cpu and meta",
            )

    @pytest.mark.world_size(2)
    def test_forward_inside_summon_full_params(self, fsdp_adapter: Any, dist: Any):
        with verdict.cell(fsdp_adapter, "misuse.forward_inside_summon"):
            adapter = fsdp_adapter
            model = adapter.wrap(
                nn.Sequential(adapter.wrap(_linear(), root=False), _linear()), root=True
            )
            x = torch.ones(2, WIDTH, device=dist.device)
            adapter_loop.backward(adapter, model, model(x).sum())

            def forward_inside() -> None:
                with adapter.summon_full_params(model):
                    model(x)

            expect_error(
                forward_inside,
                r"summon|SUMMON|state",
                f"adapter {adapter.name!r}, forward inside summon_full_params",
            )

    @pytest.mark.world_size(2)
    def test_summon_full_params_during_forward(self, fsdp_adapter: Any, dist: Any):
        with verdict.cell(fsdp_adapter, "misuse.summon_during_forward"):
            adapter = fsdp_adapter
            model = adapter.wrap(
                nn.Sequential(adapter.wrap(_linear(), root=False), _linear()), root=True
            )
            x = torch.ones(2, WIDTH, device=dist.device)
            adapter_loop.backward(adapter, model, model(x).sum())
            inner = adapter.unwrap(model)[1]

            def summon(*_: Any) -> None:
                with adapter.summon_full_params(model):
                    pass

            handle = inner.register_forward_hook(summon)
            try:
                expect_error(
                    lambda: model(x),
                    r"forward|backward|FORWARD_BACKWARD|IDLE|state",
                    f"adapter {adapter.name!r}, summon_full_params inside forward",
                )
            finally:
                handle.remove()

    @pytest.mark.world_size(2)
    def test_sync_module_states_with_different_shapes(self, fsdp_adapter: Any, dist: Any):
        with verdict.cell(fsdp_adapter, "misuse.sync_module_states_shapes"):
            adapter = fsdp_adapter
            adapter_features.skip_unless(adapter, Feature.SYNC_MODULE_STATES)
            module = nn.Sequential(_linear(), nn.Linear(WIDTH, WIDTH + dist.rank))
            expect_error(
                lambda: adapter.wrap(module, root=True, sync_module_states=True),
                r"shape|size|differ",
                f"adapter {adapter.name!r}, sync_module_states with shapes that differ across ranks",
            )
