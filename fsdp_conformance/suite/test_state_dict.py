"""The full state dict (check ``state_dict.full``): what users save and load.

``BaseFullStateDictTests`` runs the zoo's ``buffered`` model (models/buffered.py: nested
instances, a persistent and a non-persistent buffer, odd sizes so every shard is uneven at world
size 2) at world size 2 against DDP:

- ``test_full_state_dict[default|rank0_only|offload_to_cpu]``: after training, the adapter's
  full state dict (``Adapter.state_dict``: FSDP1 ``FULL_STATE_DICT`` with
  ``FullStateDictConfig``, FSDP2 ``get_model_state_dict(full_state_dict=True)``, impl's own)
  has exactly the keys of the plain module's ``state_dict()`` (no wrapper prefixes, the
  persistent buffer included), its dtypes and DDP's values bit for bit; ``rank0_only``: the
  other ranks get an empty dict; ``offload_to_cpu``: every tensor on the CPU. It loads with
  ``strict=True`` into a plain module that then trains as DDP's own weights do. A default state
  dict taken *before* training whose values are DTensors (FSDP2 documents them as views of the
  live shards) must show the trained values.
- ``test_mixed_precision_buffers``: under ``MixedPrecision`` with fp16 parameters, reduction and
  buffers (fp16: fairscale casts inputs with ``.half()`` whatever its compute dtype), after a
  forward and backward, the full state dict keeps every buffer's original dtype and its value
  (exact, or rounded once to fp16: a cast buffer cannot give back the bits fp16 dropped) and
  every parameter's (no step was taken: the fp32 master values).
- ``test_load_plain_state_dict[copy|assign]``: a plain module's state dict (other values than
  the initial ones) loaded into the freshly wrapped model before its first forward
  (``Adapter.load_state_dict``, with ``assign=True`` the parameters are re-assigned between
  wrapping and the first forward), which then trains as DDP from those values.
- ``test_on_a_subgroup[first|last]``: rank 0, or rank 1 (its group rank 0 is not its global
  rank), alone on a one-rank group, the other rank outside it: the full state dict, a load into a fresh model, and -- where the adapter checkpoints --
  ``save_checkpoint`` / ``load_checkpoint`` (DCP's ``get_state_dict`` / ``set_state_dict`` for
  the torch adapters) must use that group only. A collective on the world group hangs: the
  cell's timeout (``SUBGROUP_TIMEOUT_S``) turns that into a FAIL.

Every comparison is bit-exact: fp32, world size 2 (the same arithmetic as DDP, see
``[Note: loop tolerances]`` in suite/loops.py), and a state dict is a copy of the values.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from fsdp_conformance.adapters import Feature, UnsupportedFeatureError
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters import loop as adapter_loop

from . import loops, verdict, zoo

MODEL = "buffered"
STEPS = 2
# how long the subgroup cell may take before it is a hang (a FAIL); it needs ~1 s
SUBGROUP_TIMEOUT_S = 30


@dataclasses.dataclass(frozen=True)
class StateDictCase:
    """The case a ``state_dict.full`` cell hands to ``Deviation.applies``."""

    # "full", "mixed_precision_buffers", "load_plain" or "subgroup"
    test: str
    # "default" / "rank0_only" / "offload_to_cpu" (full), "copy" / "assign" (load_plain),
    # "first" / "last" (subgroup: the rank alone in it; "outside" on the other rank)
    option: str = ""


def call_with_options(adapter: Any, method: str, *args: Any, **options: bool) -> Any:
    """``adapter.<method>(*args, **options)``, passing only the options that are set (so an
    override written without them still runs the default cells). An option the override does
    not take makes the cell not applicable, naming the member to extend."""
    given = {name: value for name, value in options.items() if value}
    bound = getattr(adapter, method)
    if given:
        parameters = inspect.signature(bound).parameters.values()
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            names = {p.name for p in parameters}
            missing = sorted(name for name in given if name not in names)
            if missing:
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


def _same(actual: Any, expected: torch.Tensor) -> bool:
    """`actual` is a tensor of `expected`'s dtype with its values."""
    return (
        isinstance(actual, torch.Tensor)
        and actual.dtype == expected.dtype
        and torch.equal(actual.cpu(), expected.cpu())
    )


def _perturbed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Other values for every floating-point entry (parameters and the persistent buffer)."""
    return {
        key: value * 0.5 + 0.125 if value.is_floating_point() else value.clone()
        for key, value in state.items()
    }


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
    driver = loops.Driver(ddp, model)
    losses = loops._steps_from(driver, loops.ddp_optimizer(model), dist.device, start, STEPS)
    return losses, driver.params()


class BaseFullStateDictTests:
    """The full state dict (``state_dict.full``): see this module's docstring."""

    options: ClassVar[tuple[str, ...]] = ("default", "rank0_only", "offload_to_cpu")
    loads: ClassVar[tuple[str, ...]] = ("copy", "assign")
    members: ClassVar[tuple[str, ...]] = ("first", "last")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        loops._parametrize(metafunc, option=self.options, load=self.loads, member=self.members)

    @pytest.mark.world_size(2)
    def test_full_state_dict(self, fsdp_adapter: Any, dist: Any, option: str):
        adapter = fsdp_adapter
        with verdict.cell(adapter, "state_dict.full", StateDictCase("full", option)):
            options = {
                "rank0_only": option == "rank0_only",
                "offload_to_cpu": option == "offload_to_cpu",
            }
            label = f"adapter {adapter.name!r}, {MODEL}, full state dict ({option})"
            root, zoo_model = loops.build(adapter, MODEL, dist, {})
            early = root.state_dict()  # the default form, taken before training
            driver = loops.Driver(root, zoo_model, adapter)
            optimizer = loops.fsdp_optimizer(adapter, root)
            losses = loops._steps_from(driver, optimizer, dist.device, 0, STEPS)
            ddp, reference = loops.build_reference(MODEL, dist)
            reference_driver = loops.Driver(ddp, reference)
            reference_losses = loops._steps_from(
                reference_driver, loops.ddp_optimizer(ddp), dist.device, 0, STEPS
            )
            loops.assert_losses(label, losses, reference_losses)
            expected = {
                key: value.detach().clone() for key, value in reference.state_dict().items()
            }
            _assert_views(label, early, expected)
            full = call_with_options(adapter, "state_dict", root, **options)
            if option == "rank0_only" and dist.rank != 0:
                assert not full, f"{label}: rank {dist.rank} got {len(full)} entries, not none"
                return
            assert_state_dict(label, full, expected)
            if option == "offload_to_cpu":
                elsewhere = sorted(key for key, value in full.items() if value.device.type != "cpu")
                assert not elsewhere, f"{label}: not on the CPU: {elsewhere}"
            if option == "default":  # a plain module loads it and trains as DDP's weights do
                loaded = _ddp_run(dist, _plain(dist, full), STEPS)
                expected_run = _ddp_run(dist, _plain(dist, expected), STEPS)
                loops.assert_losses(
                    f"{label}, loaded into a plain module", loaded[0], expected_run[0]
                )
                loops.assert_params(label, loaded[1], expected_run[1], 2 * STEPS)

    @pytest.mark.world_size(2)
    def test_mixed_precision_buffers(self, fsdp_adapter: Any, dist: Any):
        adapter = fsdp_adapter
        with verdict.cell(adapter, "state_dict.full", StateDictCase("mixed_precision_buffers")):
            low = torch.float16
            config = {
                "mixed_precision": {"param_dtype": low, "reduce_dtype": low, "buffer_dtype": low}
            }
            root, zoo_model = loops.build(adapter, MODEL, dist, config)
            inputs = zoo_model.get_input(dist.device)
            loops.Driver(root, zoo_model, adapter).backward(
                zoo_model.get_loss(inputs, root(*inputs)).float()
            )
            full = adapter_loop.state_dict(adapter, root)
            plain = _plain(dist)
            expected = plain.state_dict()
            label = f"adapter {adapter.name!r}, {MODEL}, full state dict under fp16 buffers"
            # a buffer may come back rounded once to fp16 (its cast lost those bits), nothing else
            buffers = {name for name, _ in plain.named_buffers()}
            for key, value in list(expected.items()):
                rounded = value.to(low).to(value.dtype)
                got = full.get(key)
                if key in buffers and _same(got, rounded):
                    expected[key] = rounded
            assert_state_dict(label, full, expected)

    @pytest.mark.world_size(2)
    def test_load_plain_state_dict(self, fsdp_adapter: Any, dist: Any, load: str):
        adapter = fsdp_adapter
        with verdict.cell(adapter, "state_dict.full", StateDictCase("load_plain", load)):
            label = f"adapter {adapter.name!r}, {MODEL}, a plain state dict loaded ({load})"
            source = _perturbed(_plain(dist).state_dict())
            root, zoo_model = loops.build(adapter, MODEL, dist, {})
            # a copy: DCP's set_model_state_dict replaces the given dict's values by its shards
            call_with_options(
                adapter, "load_state_dict", root, dict(source), assign=load == "assign"
            )
            driver = loops.Driver(root, zoo_model, adapter)
            losses = loops._steps_from(
                driver, loops.fsdp_optimizer(adapter, root), dist.device, 0, STEPS
            )
            reference_losses, reference_params = _ddp_run(dist, _plain(dist, source))
            loops.assert_losses(label, losses, reference_losses)
            loops.assert_params(label, driver.params(), reference_params, STEPS)

    @pytest.mark.world_size(2)
    @pytest.mark.fsdp_timeout(SUBGROUP_TIMEOUT_S)
    def test_on_a_subgroup(self, fsdp_adapter: Any, dist: Any, member: str):
        import torch.distributed as tdist

        adapter = fsdp_adapter
        # "first": rank 0 alone; "last": rank 1 alone (its group rank 0 is not its global rank)
        member_rank = tdist.get_process_group_ranks(dist.group)[0 if member == "first" else -1]
        inside = tdist.get_rank() == member_rank
        case = StateDictCase("subgroup", member if inside else "outside")
        with verdict.cell(adapter, "state_dict.full", case):
            solo = tdist.new_group([member_rank])
            if not inside:  # outside the group: nothing of it may wait for this rank
                return
            label = f"adapter {adapter.name!r}, {MODEL}, on a one-rank subgroup"
            root, zoo_model = loops.build(adapter, MODEL, dist, {}, group=solo)
            driver = loops.Driver(root, zoo_model, adapter)
            optimizer = loops.fsdp_optimizer(adapter, root, "adam")
            loops._steps_from(driver, optimizer, dist.device, 0, STEPS)
            reference = _plain(dist, group=solo)
            loops._steps_from(
                loops.Driver(reference, reference),
                loops.ddp_optimizer(reference, "adam"),
                dist.device,
                0,
                STEPS,
            )
            assert_state_dict(label, adapter_loop.state_dict(adapter, root), reference.state_dict())
            fresh, fresh_zoo = loops.build(adapter, MODEL, dist, {}, group=solo)
            adapter_loop.load_state_dict(adapter, fresh, reference.state_dict())
            loops.assert_params(
                f"{label}, loaded into a fresh model",
                adapter_loop.full_params(adapter, fresh),
                dict(reference.named_parameters()),
                STEPS,
            )
            if not adapter_features.supports(adapter, Feature.CHECKPOINT_RESUME):
                return
            with _directory() as directory:
                adapter.save_checkpoint(root, optimizer, directory)
                fresh_optimizer = loops.fsdp_optimizer(adapter, fresh, "adam")
                adapter.load_checkpoint(fresh, fresh_optimizer, directory)
            after = [
                loops._steps_from(loops.Driver(model, zoo, adapter), opt, dist.device, STEPS, 1)
                for model, zoo, opt in (
                    (root, zoo_model, optimizer),
                    (fresh, fresh_zoo, fresh_optimizer),
                )
            ]
            loops.assert_losses(f"{label}, a step after save/load_checkpoint", after[1], after[0])
            loops.assert_params(
                f"{label}, a step after save/load_checkpoint",
                adapter_loop.full_params(adapter, fresh),
                adapter_loop.full_params(adapter, root),
                STEPS + 1,
            )


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


def _directory():
    import tempfile

    return tempfile.TemporaryDirectory(prefix="fsdp_state_dict_")


class TestFullStateDict(BaseFullStateDictTests):
    pass
