"""Misuse checks: divergent execution order across ranks, and bad inputs.

    class TestMyMisuse(BaseExecOrderTests, BaseBadInputTests):   # in your tests
        known_deviations = {"my-fsdp": {"wrap_twice": "why my FSDP accepts it"}}

[Note: misuse]
Each misuse must raise an exception *within seconds* (``DEADLINE_S``, generous for a loaded
machine; a hang is caught by the harness timeout as the backstop) whose message names the
problem (a per-case regular expression, implementation-neutral: the words any sensible message
would use). Every rank makes the same mistake, so an implementation that raises before any
collective raises on every rank and none is left waiting.

An adapter that accepts a misuse silently (no exception) fails the check, unless the class lists
it in ``known_deviations`` (adapter name -> case -> reason): then the case is an expected
failure with that reason; an adapter that raises anyway passes. docs/checks.md records what
each adapter does.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from fsdp_conformance.adapters import Feature

# Seconds a misuse may take to raise (the harness timeout, default 120 s, is the backstop)
DEADLINE_S = 30.0
WIDTH = 8

# Deviations measured on torch 2.13.0 (CPU, gloo, world size 2); see docs/checks.md.


def _fairscale(check: str) -> str:
    """The reason the fairscale adapter declares for `check` (its `known_deviations`)."""
    from fsdp_conformance.adapters.fairscale import DEVIATIONS

    return next(deviation.reason for deviation in DEVIATIONS if deviation.check == check)


# adapter name -> case -> reason
KNOWN_DEVIATIONS: dict[str, dict[str, str]] = {
    "torch-fsdp1": {
        "divergent_exec_order": (
            "torch FSDP1 compares the forward order across ranks only under "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL (_ExecOrderData); by default same-shaped instances "
            "silently exchange each other's all-gathers (torch 2.13.0)"
        ),
        "wrap_wrapped_instance": (
            "torch FSDP1 accepts FullyShardedDataParallel(fsdp_instance) and nests a second "
            "instance around it (torch 2.13.0)"
        ),
        "wrap_twice": (
            "torch FSDP1 wraps a module that another instance already wraps, without an error "
            "(torch 2.13.0)"
        ),
        "mixed_devices": (
            "torch FSDP1 wraps a module with cpu and meta parameters without an error "
            "(torch 2.13.0, device_id=cpu)"
        ),
        "forward_inside_summon": (
            "torch FSDP1 fails with an internal AssertionError ('Expects tensor to be "
            "unsharded with size ... but got ...') that does not name summon_full_params "
            "(torch 2.13.0)"
        ),
    },
    "torch-fsdp2": {
        "divergent_exec_order": (
            "torch FSDP2 does not compare the execution order across ranks; same-shaped "
            "instances silently exchange each other's all-gathers (torch 2.13.0)"
        ),
        "mixed_devices": (
            "torch FSDP2 fully_shard accepts a module with cpu and meta parameters without an "
            "error (torch 2.13.0)"
        ),
        "forward_inside_summon": (
            "torch FSDP2 has no summon_full_params; the torch-fsdp2 adapter emulates it with "
            "unshard()/reshard(), which do not refuse a forward"
        ),
        "summon_during_forward": (
            "torch FSDP2 has no summon_full_params; the torch-fsdp2 adapter emulates it with "
            "unshard()/reshard(), which may be called inside forward"
        ),
    },
    "fairscale": {
        "divergent_exec_order": _fairscale("exec_order.divergent"),
        "wrap_wrapped_instance": _fairscale("misuse.wrap_wrapped_instance"),
        "wrap_twice": _fairscale("misuse.wrap_twice"),
        "forward_inside_summon": _fairscale("misuse.forward_inside_summon"),
    },
}


def expect_error(
    action: Callable[[], Any], pattern: str, label: str, deviation: str | None = None
) -> BaseException | None:
    """Run ``action``; it must raise within ``DEADLINE_S`` with a message matching ``pattern``.

    Args:
        deviation: a known deviation's reason: if the check fails, xfail with it (and with
            what happened) instead.
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
            failure = (
                f"{label}: the error does not name the problem (expected a message matching "
                f"{pattern!r}), got {message}"
            )
        else:
            return error
    else:
        failure = f"{label}: no exception was raised (expected one matching {pattern!r})"
    if deviation is not None:
        pytest.xfail(f"{failure} -- known deviation: {deviation}")
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

    known_deviations: ClassVar[dict[str, dict[str, str]]] = {}

    @pytest.mark.world_size(2)
    def test_divergent_exec_order_raises(self, fsdp_adapter: Any, dist: Any):
        adapter = fsdp_adapter
        deviation = {**KNOWN_DEVIATIONS, **self.known_deviations}.get(adapter.name, {})
        wrap = adapter.wrapper()
        model = adapter.wrap(TwoBranches(wrap))
        adapter.unwrap(model).swapped = dist.rank == 1
        x = torch.ones(2, WIDTH, device=dist.device)

        def iteration() -> None:
            model(x).sum().backward()

        expect_error(
            iteration,
            r"order.*branch_[ab]|branch_[ab].*order",
            f"adapter {adapter.name!r}, rank {dist.rank} running "
            f"{'branch_b, branch_a' if dist.rank == 1 else 'branch_a, branch_b'}",
            deviation.get("divergent_exec_order"),
        )


# ---------------------------------------------------------------------------- bad inputs
def _linear() -> nn.Linear:
    return nn.Linear(WIDTH, WIDTH)


class BaseBadInputTests:
    """The reference FSDP's misuse catalogue, where it applies to any adapter ([Note: misuse])."""

    known_deviations: ClassVar[dict[str, dict[str, str]]] = {}

    def _deviation(self, adapter: Any, case: str) -> str | None:
        return {**KNOWN_DEVIATIONS, **self.known_deviations}.get(adapter.name, {}).get(case)

    @pytest.mark.world_size(2)
    def test_wrapping_a_wrapped_instance(self, fsdp_adapter: Any, dist: Any):
        adapter = fsdp_adapter
        wrapped = adapter.wrap(_linear())
        expect_error(
            lambda: adapter.wrap(wrapped),
            r"already|twice|again|nested",
            f"adapter {adapter.name!r}, wrapping an FSDP instance again",
            self._deviation(adapter, "wrap_wrapped_instance"),
        )

    @pytest.mark.world_size(2)
    def test_wrapping_a_module_twice(self, fsdp_adapter: Any, dist: Any):
        adapter = fsdp_adapter
        linear = _linear()
        adapter.wrap(linear)
        expect_error(
            lambda: adapter.wrap(linear),
            r"already|twice|again",
            f"adapter {adapter.name!r}, wrapping the same module twice",
            self._deviation(adapter, "wrap_twice"),
        )

    @pytest.mark.world_size(2)
    def test_parameters_on_mixed_devices(self, fsdp_adapter: Any, dist: Any):
        adapter = fsdp_adapter
        module = nn.Sequential(_linear(), nn.Linear(WIDTH, WIDTH, device="meta"))
        expect_error(
            lambda: adapter.wrap(module),
            r"device|meta",
            f"adapter {adapter.name!r}, parameters on cpu and meta",
            self._deviation(adapter, "mixed_devices"),
        )

    @pytest.mark.world_size(2)
    def test_forward_inside_summon_full_params(self, fsdp_adapter: Any, dist: Any):
        adapter = fsdp_adapter
        model = adapter.wrap(nn.Sequential(adapter.wrap(_linear()), _linear()))
        x = torch.ones(2, WIDTH, device=dist.device)
        model(x).sum().backward()

        def forward_inside() -> None:
            with adapter.summon_full_params(model):
                model(x)

        expect_error(
            forward_inside,
            r"summon|SUMMON|state",
            f"adapter {adapter.name!r}, forward inside summon_full_params",
            self._deviation(adapter, "forward_inside_summon"),
        )

    @pytest.mark.world_size(2)
    def test_summon_full_params_during_forward(self, fsdp_adapter: Any, dist: Any):
        adapter = fsdp_adapter
        model = adapter.wrap(nn.Sequential(adapter.wrap(_linear()), _linear()))
        x = torch.ones(2, WIDTH, device=dist.device)
        model(x).sum().backward()
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
                self._deviation(adapter, "summon_during_forward"),
            )
        finally:
            handle.remove()

    @pytest.mark.world_size(2)
    def test_sync_module_states_with_different_shapes(self, fsdp_adapter: Any, dist: Any):
        adapter = fsdp_adapter
        adapter.require(Feature.SYNC_MODULE_STATES)
        module = nn.Sequential(_linear(), nn.Linear(WIDTH, WIDTH + dist.rank))
        expect_error(
            lambda: adapter.wrap(module, sync_module_states=True),
            r"shape|size|differ",
            f"adapter {adapter.name!r}, sync_module_states with shapes that differ across ranks",
            self._deviation(adapter, "sync_module_states_shapes"),
        )
