"""Misuses that do harm are refused with a clear error (``misuse.*``; [Note: misuse] in
test_exec_order.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from .declare import check
from .test_exec_order import WIDTH, expect_error


def _linear() -> nn.Linear:
    return nn.Linear(WIDTH, WIDTH)


def _trained(adapter: Any, dist: Any) -> tuple[nn.Module, torch.Tensor]:
    """A root around a nested instance after one backward, and its input."""
    model = adapter.wrap(nn.Sequential(adapter.wrap(_linear(), root=False), _linear()), root=True)
    x = torch.ones(2, WIDTH, device=dist.device)
    adapter.backward(model, model(x).sum())
    return model, x


class BaseBadInputTests:
    """Misuses whose acceptance hurts, each refused with a clear error ([Note: misuse]): a
    module wrapped twice (training silently diverges), parameters on cpu and meta (fails far
    from the cause), a forward inside ``summon_full_params`` (frees what the context exposes),
    ``summon_full_params`` inside forward (reshards what forward still uses),
    ``sync_module_states`` with shapes differing across ranks (hangs or corrupts). Nesting
    (``FSDP(FSDP(lin))``) is ordinary for torch FSDP1 and fairscale, so it is not here."""

    @check(
        "misuse.wrap_twice",
        "wrapping a module that an instance already wraps is refused",
        strict=False,
    )
    @pytest.mark.world_size(2)
    def test_wrapping_a_module_twice(self, fsdp_adapter: Any, dist: Any):
        linear = _linear()
        fsdp_adapter.wrap(linear, root=True)
        expect_error(
            lambda: fsdp_adapter.wrap(linear, root=True),
            r"already|twice|again",
            f"adapter {fsdp_adapter.name!r}, wrapping the same module twice",
        )

    @check("misuse.mixed_devices", "wrapping parameters on cpu and meta is refused", strict=False)
    @pytest.mark.world_size(2)
    def test_parameters_on_mixed_devices(self, fsdp_adapter: Any, dist: Any):
        module = nn.Sequential(_linear(), nn.Linear(WIDTH, WIDTH, device="meta"))
        expect_error(
            lambda: fsdp_adapter.wrap(module, root=True),
            r"device|meta",
            f"adapter {fsdp_adapter.name!r}, parameters on cpu and meta",
        )

    @check(
        "misuse.forward_inside_summon",
        "a forward inside summon_full_params is refused",
        features=("summon_full_params",),
        strict=False,
    )
    @pytest.mark.world_size(2)
    def test_forward_inside_summon_full_params(self, fsdp_adapter: Any, dist: Any):
        model, x = _trained(fsdp_adapter, dist)

        def forward_inside() -> None:
            with fsdp_adapter.summon_full_params(model):
                model(x)

        expect_error(
            forward_inside,
            r"summon|SUMMON|state",
            f"adapter {fsdp_adapter.name!r}, forward inside summon_full_params",
        )

    @check(
        "misuse.summon_during_forward",
        "summon_full_params inside forward is refused",
        features=("summon_full_params",),
        strict=False,
    )
    @pytest.mark.world_size(2)
    def test_summon_full_params_during_forward(self, fsdp_adapter: Any, dist: Any):
        model, x = _trained(fsdp_adapter, dist)
        inner = fsdp_adapter.unwrap(model)[1]

        def summon(*_: Any) -> None:
            with fsdp_adapter.summon_full_params(model):
                pass

        handle = inner.register_forward_hook(summon)
        try:
            expect_error(
                lambda: model(x),
                r"forward|backward|FORWARD_BACKWARD|IDLE|state",
                f"adapter {fsdp_adapter.name!r}, summon_full_params inside forward",
            )
        finally:
            handle.remove()

    @check(
        "misuse.sync_module_states_shapes",
        "sync_module_states with differing shapes is refused",
        features=("sync_module_states",),
        strict=False,
    )
    @pytest.mark.world_size(2)
    def test_sync_module_states_with_different_shapes(self, fsdp_adapter: Any, dist: Any):
        module = nn.Sequential(_linear(), nn.Linear(WIDTH, WIDTH + dist.rank))
        expect_error(
            lambda: fsdp_adapter.wrap(module, root=True, sync_module_states=True),
            r"shape|size|differ",
            f"adapter {fsdp_adapter.name!r}, sync_module_states with shapes that differ across "
            "ranks",
        )


class TestBadInputs(BaseBadInputTests): ...
