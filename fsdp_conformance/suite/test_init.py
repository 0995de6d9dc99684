"""Meta-device initialisation (``init.meta``): ``buffered_meta`` wrapped by hand or by an
``auto_wrap_policy``, materialised by ``Adapter.materialize``: nothing left on meta, every
parameter and buffer equal to the CPU-built model (each module initialised once), then trains
as DDP (docs/suite.md, "Full state dict and meta-device init").
"""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import pytest
import torch

from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.models import BufferedBlock

from . import training, zoo
from .declare import check

STEPS = 2


def _is_block(module: torch.nn.Module) -> bool:
    return isinstance(module, BufferedBlock)


class BaseMetaInitTests:
    """A meta-device model materialised after wrapping (see the module docstring)."""

    wrappings: ClassVar[tuple[str, ...]] = ("nested", "auto_wrap")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        training.parametrize(metafunc, wrapping=self.wrappings)

    @check(
        "init.meta",
        "a meta-device model materialised the implementation's way: nothing left on meta, nested "
        "instances initialised once, then loaded and trained as DDP",
        features=("meta_init",),
        case="wrapping: 'nested' (inner first by hand) or 'auto_wrap'",
        case_of="wrapping",
    )
    @pytest.mark.world_size(2)
    def test_meta_init(self, fsdp_adapter: Any, dist: Any, wrapping: str):
        adapter_features.skip_unless(fsdp_adapter, *zoo.MODELS["buffered_meta"].features)
        config = {"auto_wrap_policy": _is_block} if wrapping == "auto_wrap" else {}
        adapter_features.skip_unless(fsdp_adapter, *adapter_features.wrap_features(**config))
        nested = fsdp_adapter.wrapper(process_group=dist.group) if wrapping == "nested" else None
        zoo_model = zoo.build("buffered_meta", dist.group, nested, dist.device)
        root = fsdp_adapter.wrap(zoo_model, process_group=dist.group, root=True, **config)
        fsdp_adapter.materialize(root, device=dist.device)
        label = f"adapter {fsdp_adapter.name!r}, buffered_meta ({wrapping})"
        named = itertools.chain(root.named_parameters(), root.named_buffers())
        on_meta = [name for name, tensor in named if tensor.is_meta]
        assert not on_meta, f"{label}: still on the meta device after materialize: {on_meta}"
        plain = zoo.build("buffered", dist.group, None, dist.device).to(dist.device)
        full = fsdp_adapter.full_params(root)
        expected = {name: p.detach() for name, p in plain.named_parameters()}
        assert sorted(full) == sorted(expected), (
            f"{label}: full parameter names {sorted(full)}, the plain model's {sorted(expected)}"
        )
        buffers = training.by_clean_name(fsdp_adapter, fsdp_adapter.unwrap(root).named_buffers())
        for name, value in plain.named_buffers():  # persistent and not
            assert name in buffers, f"{label}: buffer {name!r} is gone ({sorted(buffers)})"
            expected[name] = value
            full[name] = buffers[name]
        wrong = {
            name: (full[name].cpu().double() - value.cpu().double()).abs().max().item()
            for name, value in expected.items()
            if not torch.equal(full[name].cpu(), value.cpu())
        }
        assert not wrong, (
            f"{label}: after materialisation these differ from the model built on the CPU "
            f"(max |difference|): {wrong}; each module must be initialised exactly once by "
            "its own reset_parameters() (initialised twice -- e.g. a nested instance "
            "re-initialised by its root's materialisation -- or left uninitialised)"
        )
        fsdp_adapter.load_state_dict(root, plain.state_dict())
        driver = training.Driver(root, zoo_model, dist.device, fsdp_adapter)
        losses = driver.run(STEPS)
        ddp = torch.nn.parallel.DistributedDataParallel(plain, process_group=dist.group)
        reference = training.Driver(ddp, plain, dist.device)
        expected = (reference.run(STEPS), reference.params())
        training.assert_trained(label, (losses, driver.params()), expected, STEPS)


class TestMetaInit(BaseMetaInitTests): ...
