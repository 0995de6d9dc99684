"""The full state dict (``state_dict.full``) on the zoo's ``buffered`` model against DDP, bit
for bit: the plain module's keys and DDP's values (also ``rank0_only`` / ``offload_to_cpu``),
buffers under mixed precision, a plain state dict loaded before the first forward, and all on a
one-rank subgroup (docs/suite.md, "Full state dict and meta-device init").
"""

from __future__ import annotations

import dataclasses
import inspect
import tempfile
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from fsdp_conformance.adapters import Feature, UnsupportedFeatureError
from fsdp_conformance.adapters import features as adapter_features

from . import training, zoo
from .declare import check

MODEL = "buffered"
STEPS = 2
# how long the subgroup cell may take before it is a hang (a FAIL); it needs ~1 s
SUBGROUP_TIMEOUT_S = 30


@dataclasses.dataclass(frozen=True)
class StateDictCase:
    """The case a ``state_dict.full`` cell hands to ``Deviation.applies``."""

    test: str  # "full", "mixed_precision_buffers", "load_plain" or "subgroup"
    # full: "default" / "rank0_only" / "offload_to_cpu"; load_plain: "copy" / "assign";
    # subgroup: "first" / "last" (the rank alone in it), "outside" on the other rank
    option: str = ""


def call_with_options(adapter: Any, method: str, *args: Any, **options: bool) -> Any:
    """``adapter.<method>(*args, **options)``, passing only the options that are set (so an
    override written without them still runs the default cells). An option the override does
    not take makes the cell not applicable, naming the member to extend."""
    given = {name: value for name, value in options.items() if value}
    bound = getattr(adapter, method)
    parameters = inspect.signature(bound).parameters.values() if given else ()
    missing = sorted(set(given) - {p.name for p in parameters})
    if missing and not any(p.kind is p.VAR_KEYWORD for p in parameters):
        raise UnsupportedFeatureError(
            adapter.name,
            Feature.FULL_STATE_DICT,
            f"{type(adapter).__name__}.{method} takes no keyword {', '.join(missing)}; "
            f"extend that override of Adapter.{method}",
        )
    return bound(*args, **given)


def assert_state_dict(label: str, actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """`actual` has exactly `expected`'s keys, and per key its dtype, shape and values."""
    missing = sorted(set(expected) - set(actual))
    unexpected = sorted(set(actual) - set(expected))
    assert not missing and not unexpected, (
        f"{label}: keys differ from the plain module's state_dict(): missing {missing}, "
        f"unexpected {unexpected}"
    )
    for key, value in expected.items():
        got = actual[key]
        assert not hasattr(got, "full_tensor"), f"{label}: {key!r} is a DTensor, not a full tensor"
        assert got.dtype == value.dtype and got.shape == value.shape, (
            f"{label}: {key!r} is {got.dtype} {tuple(got.shape)}, the plain module's is "
            f"{value.dtype} {tuple(value.shape)}"
        )
        assert torch.equal(got.cpu(), value.cpu()), (
            f"{label}: {key!r} differs from DDP's by "
            f"{(got.cpu().double() - value.cpu().double()).abs().max().item():.3g}"
        )


def _plain(dist: Any, state: dict[str, torch.Tensor] | None = None, group: Any = None):
    """The unwrapped model on the test's device, loaded (strict) from `state` if given."""
    model = zoo.build(MODEL, dist.group if group is None else group, None, dist.device)
    model.to(dist.device)
    if state is not None:
        model.load_state_dict(state, strict=True)
    return model


def _ddp_run(dist: Any, model: nn.Module, start: int = 0):
    """STEPS SGD steps of `model` under DDP from step `start`: (losses, full parameters)."""
    ddp = nn.parallel.DistributedDataParallel(model, process_group=dist.group)
    driver = training.Driver(ddp, model, dist.device)
    return driver.run(STEPS, start=start), driver.params()


def _member_rank(dist: Any, member: str) -> int:
    """The global rank alone in the subgroup: "first" rank 0, "last" rank 1 (whose group rank
    0 is not its global rank)."""
    import torch.distributed as tdist

    return tdist.get_process_group_ranks(dist.group)[0 if member == "first" else -1]


def _subgroup_case(dist: Any, member: str) -> StateDictCase:
    import torch.distributed as tdist

    inside = tdist.get_rank() == _member_rank(dist, member)
    return StateDictCase("subgroup", member if inside else "outside")


class BaseFullStateDictTests:
    """The full state dict (``state_dict.full``): see this module's docstring."""

    options: ClassVar[tuple[str, ...]] = ("default", "rank0_only", "offload_to_cpu")
    loads: ClassVar[tuple[str, ...]] = ("copy", "assign")
    members: ClassVar[tuple[str, ...]] = ("first", "last")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        training.parametrize(metafunc, option=self.options, load=self.loads, member=self.members)

    @check(
        "state_dict.full",
        "the full state dict has the plain module's keys and DDP's values, loads both ways "
        "(strict, assign, via DCP on a subgroup) and trains as DDP",
        # torch-fsdp1: state_dict_type(model, FULL_STATE_DICT, FullStateDictConfig(...))
        api=(
            "FullyShardedDataParallel.state_dict_type()",
            "FullyShardedDataParallel.state_dict_type(state_dict_config)",
            "StateDictType.FULL_STATE_DICT",
            "FullStateDictConfig(offload_to_cpu=True)",
            "FullStateDictConfig(rank0_only=True)",
        ),
        features=("full_state_dict",),
        case="suite.test_state_dict.StateDictCase",
        case_of=lambda option: StateDictCase("full", option),
    )
    @pytest.mark.world_size(2)
    def test_full_state_dict(self, fsdp_adapter: Any, dist: Any, option: str):
        options = {name: option == name for name in ("rank0_only", "offload_to_cpu")}
        label = f"adapter {fsdp_adapter.name!r}, {MODEL}, full state dict ({option})"
        driver = training.fsdp_driver(fsdp_adapter, MODEL, dist)
        root = driver.model
        early = root.state_dict()  # the default form, taken before training
        losses = driver.run(STEPS)
        reference = training.ddp_driver(MODEL, dist)
        training.assert_losses(label, losses, reference.run(STEPS))
        state = reference.zoo_model.state_dict()
        expected = {key: value.detach().clone() for key, value in state.items()}
        _assert_views(label, early, expected)
        full = call_with_options(fsdp_adapter, "state_dict", root, **options)
        if option == "rank0_only" and dist.rank != 0:
            assert not full, f"{label}: rank {dist.rank} got {len(full)} entries, not none"
            return
        assert_state_dict(label, full, expected)
        if option == "offload_to_cpu":
            elsewhere = sorted(key for key, value in full.items() if value.device.type != "cpu")
            assert not elsewhere, f"{label}: not on the CPU: {elsewhere}"
        if option == "default":  # a plain module loads it and trains as DDP's weights do
            plain_losses, plain_params = _ddp_run(dist, _plain(dist, full), STEPS)
            ref_losses, ref_params = _ddp_run(dist, _plain(dist, expected), STEPS)
            plain = (plain_losses, plain_params)
            label += ", loaded into a plain module"
            training.assert_trained(label, plain, (ref_losses, ref_params), 2 * STEPS)

    @check("state_dict.full", case_of=lambda: StateDictCase("mixed_precision_buffers"))
    @pytest.mark.world_size(2)
    def test_mixed_precision_buffers(self, fsdp_adapter: Any, dist: Any):
        low = torch.float16
        config = {"mixed_precision": {"param_dtype": low, "reduce_dtype": low, "buffer_dtype": low}}
        root, zoo_model = training.build(fsdp_adapter, MODEL, dist, config)
        inputs = zoo_model.get_input(dist.device)
        loss = zoo_model.get_loss(inputs, root(*inputs)).float()
        training.Driver(root, zoo_model, dist.device, fsdp_adapter).backward(loss)
        full = fsdp_adapter.state_dict(root)
        plain = _plain(dist)
        expected = plain.state_dict()
        label = f"adapter {fsdp_adapter.name!r}, {MODEL}, full state dict under fp16 buffers"
        # a buffer may come back rounded once to fp16 (its cast lost those bits), nothing else
        buffers = {name for name, _ in plain.named_buffers()}
        for key, value in list(expected.items()):
            rounded = value.to(low).to(value.dtype)
            got = full.get(key)
            if key in buffers and isinstance(got, torch.Tensor) and got.dtype == value.dtype:
                if torch.equal(got.cpu(), rounded.cpu()):
                    expected[key] = rounded
        assert_state_dict(label, full, expected)

    @check("state_dict.full", case_of=lambda load: StateDictCase("load_plain", load))
    @pytest.mark.world_size(2)
    def test_load_plain_state_dict(self, fsdp_adapter: Any, dist: Any, load: str):
        adapter = fsdp_adapter
        label = f"adapter {adapter.name!r}, {MODEL}, a plain state dict loaded ({load})"
        source = {  # other values for every floating-point entry
            key: value * 0.5 + 0.125 if value.is_floating_point() else value.clone()
            for key, value in _plain(dist).state_dict().items()
        }
        driver = training.fsdp_driver(adapter, MODEL, dist)
        # a copy: DCP's set_model_state_dict replaces the given dict's values by its shards
        assign = load == "assign"
        call_with_options(adapter, "load_state_dict", driver.model, dict(source), assign=assign)
        losses = driver.run(STEPS)
        reference_losses, reference_params = _ddp_run(dist, _plain(dist, source))
        expected = (reference_losses, reference_params)
        training.assert_trained(label, (losses, driver.params()), expected, STEPS)

    @check("state_dict.full", case_of=_subgroup_case)
    @pytest.mark.world_size(2)
    @pytest.mark.fsdp_timeout(SUBGROUP_TIMEOUT_S)
    def test_on_a_subgroup(self, fsdp_adapter: Any, dist: Any, member: str):
        import torch.distributed as tdist

        member_rank = _member_rank(dist, member)
        solo = tdist.new_group([member_rank])
        if tdist.get_rank() != member_rank:  # outside the group: nothing may wait for this rank
            return
        label = f"adapter {fsdp_adapter.name!r}, {MODEL}, on a one-rank subgroup"
        driver = training.fsdp_driver(fsdp_adapter, MODEL, dist, group=solo, optimizer_name="adam")
        driver.run(STEPS)
        reference = _plain(dist, group=solo)
        training.Driver(reference, reference, dist.device, optimizer_name="adam").run(STEPS)
        state = fsdp_adapter.state_dict(driver.model)
        assert_state_dict(label, state, reference.state_dict())
        fresh = training.fsdp_driver(fsdp_adapter, MODEL, dist, group=solo, optimizer_name="adam")
        fsdp_adapter.load_state_dict(fresh.model, reference.state_dict())
        reloaded = f"{label}, loaded into a fresh model"
        training.assert_params(reloaded, fresh.params(), dict(reference.named_parameters()), STEPS)
        if not adapter_features.supports(fsdp_adapter, Feature.CHECKPOINT_RESUME):
            return
        with tempfile.TemporaryDirectory(prefix="fsdp_state_dict_") as directory:
            fsdp_adapter.save_checkpoint(driver.model, driver.optimizer, directory)
            fsdp_adapter.load_checkpoint(fresh.model, fresh.optimizer, directory)
        after = [d.run(1, start=STEPS) for d in (driver, fresh)]
        label += ", a step after save/load_checkpoint"
        expected = (after[0], driver.params())
        training.assert_trained(label, (after[1], fresh.params()), expected, STEPS + 1)


def _assert_views(label: str, early: dict[str, Any], expected: dict[str, torch.Tensor]) -> None:
    """Every DTensor value of a default state dict taken before training (FSDP2 documents them
    as views of the live shards) shows the trained values now. Collective (``full_tensor``)."""
    from torch.distributed.tensor import DTensor

    for key, value in early.items():
        if isinstance(value, DTensor):
            now = value.full_tensor()
            assert torch.equal(now.cpu(), expected[key].cpu()), (
                f"{label}: {key!r} of the state dict taken before training (a DTensor, documented "
                f"as a view of the shards) differs from the trained value by "
                f"{(now.cpu() - expected[key].cpu()).abs().max().item():.3g}: a copy, or stale"
            )


class TestFullStateDict(BaseFullStateDictTests): ...
