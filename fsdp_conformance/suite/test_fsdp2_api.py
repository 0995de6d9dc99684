"""The FSDP2 API family: ``fully_shard``'s arguments and policies, each called through the
adapter's FSDP2 namespace (``ns = adapter.declarations.api["fsdp2"]``, ``Feature.FSDP2_API``) and
held to its documented promise against a reference (docs/suite.md, "The FSDP2 API family"):

- ``fsdp2.reshard_after_forward``: True (the root too) / False / an int: what each rank holds of
  the registered parameters after forward, the group backward all-gathers over, parity;
- ``fsdp2.mixed_precision``: a policy per module (fp32 norms in a bf16 model), ``output_dtype`` on
  inner units, ``cast_forward_inputs=False`` with an fp32 side input, the casts replayed in an
  activation-checkpoint recompute, each unit's reductions in its ``reduce_dtype``;
- ``fsdp2.grouped``: ``fully_shard([embed, head])`` with the head's weight tied to the embedding's
  and the head run per chunk after forward (chunked loss);
- ``fsdp2.shard_placement_fn``: ``Shard(1)`` layouts of parameters, gradients and both state dicts;
- ``fsdp2.cpu_offload``: ``CPUOffloadPolicy(pin_memory=False)`` with gradient accumulation;
- ``fsdp2.dp_mesh_dims``: ``DataParallelMeshDims`` naming the data-parallel dims of an SPMD mesh;
- ``fsdp2.activation_checkpointing``: ``checkpoint_wrapper`` around units (state dict keys), and
  composable ``checkpoint(block)`` around a sharded child, with two forwards per backward;
- ``fsdp2.tensor_parallel``: FSDP over the dp dim of a 2 x 2 (dp, tp) mesh: parity, 2-D
  clipping, the full state dict both ways (world size 4).

References: DDP (or the unwrapped model with gradients averaged by hand), the full parameter
values, the documented dtypes, devices and placements. Tolerances: bit-exact at world size 2
except where the order of a sum changes (``SUM_ORDER_TOL``, [Note: loop tolerances]), the
precision and clipping checks' own ([Note: precision tolerances], ``CLIP_*``).
"""

from __future__ import annotations

import collections
import functools
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fsdp_conformance.adapters import Feature
from fsdp_conformance.constants import REDUCE_OPS, Op
from fsdp_conformance.models import TiedInstances
from fsdp_conformance.models.model_base import ZooModel, rand_input, seeded_init_
from fsdp_conformance.observe.comm_trace import observing_collectives

from . import test_loops, test_parity, test_precision, training, zoo
from .declare import check
from .test_sharding import device_mesh, full_state_dict
from .training import LoopCase, check_listed, full_tensor, full_tensors

STEPS = 2
LOOPS = "loops"
SUM_ORDER_TOL = 1e-6  # gradients summed in another order ([Note: loop tolerances])
BF16, FP32 = torch.bfloat16, torch.float32
RESHARD_VALUES = {"True": True, "False": False, "int": 2}  # int: 2 of 4 ranks
# DataParallelMeshDims of a (1, world size) mesh named ("r", "s"), by case
MESH_DIMS = {
    "hsdp": {"shard": "s", "replicate": "r"},
    "shard_flat": {"shard": ("r", "s")},
    "replicate_flat": {"replicate": ("r", "s")},
}


def _api(adapter: Any) -> Any:
    """The adapter's FSDP2 namespace (``fully_shard``, ``MixedPrecisionPolicy``, ...)."""
    return adapter.declarations.api["fsdp2"]


def _shard_loops(ns: Any, model: nn.Module, **options: Any) -> nn.Module:
    """``ns.fully_shard`` the zoo's ``loops`` model as users shard a model: each block, the head,
    then the root (the trunk), every unit with `options`; returns the root."""
    for block in model.blocks:
        ns.fully_shard(block, **options)
    ns.fully_shard(model.head, **options)
    return ns.fully_shard(model, **options)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _case(variant: str, model: str = LOOPS) -> LoopCase:
    return LoopCase(model, "fully_shard", variant)


def _label(adapter: Any, what: str) -> str:
    return f"adapter {adapter.name!r}, {what}"


def _assert_trained(label, driver, losses, reference, ref_losses, tol=0.0, **tolerances) -> None:
    """Losses and full parameters (names without checkpoint_wrapper's segment) as the
    reference's, within `tol` (absolute and relative) or `tolerances` (``assert_same_training``'s
    atol, rtol, loss_rtol)."""
    params = {n.replace("_checkpoint_wrapped_module.", ""): v for n, v in driver.params().items()}
    actual = training.TrainingResult(losses, params)
    expected = training.TrainingResult(ref_losses, reference.params())
    tolerances = tolerances or {"atol": tol, "rtol": tol}
    training.assert_same_training(label, actual, expected, **tolerances)


class _Block(nn.Module):
    """``x + tanh(norm(linear(x))) * side``, `side` an fp32 tensor handed to every block; the norm
    under non-reentrant activation checkpointing (recomputed in backward, its unit's forward
    re-entered while that unit is in backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        normed = checkpoint(self.norm, self.linear(x), use_reentrant=False)
        return x + torch.tanh(normed) * side.to(x.dtype)


class _SideInputNet(ZooModel):
    """Linear(8, 16) -> 2 ``_Block`` -> Linear(16, 8); the root passes its fp32 buffer ``side``
    to each block."""

    def __init__(self, group: Any) -> None:
        super().__init__(group)
        self.trunk = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(16, 8)
        self.register_buffer("side", torch.linspace(0.5, 1.5, 16))
        seeded_init_(self, 9)

    def get_input(self, device: torch.device) -> tuple[torch.Tensor]:
        return rand_input(11 + self.rank, device, 4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.trunk(x)
        for block in self.blocks:
            x = block(x, self.side)
        return self.head(x)

    def get_loss(self, input: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.float().square().sum()


class _TiedChunks(TiedInstances):
    """The zoo's ``TiedInstances`` (head.weight is embed.weight) whose forward stops before the
    head, Embedding(12, 8) -> Linear(8, 8) -> tanh; the loss runs the head on each half of the
    batch (chunked loss)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(self.embed(ids)))

    def get_loss(self, input: tuple, output: torch.Tensor) -> torch.Tensor:
        chunks = zip(output.chunk(2), input[0].chunk(2))
        losses = [F.cross_entropy(self.head(h).flatten(0, 1), ids.flatten()) for h, ids in chunks]
        return sum(losses)


class _MLP(nn.Module):
    """``x + down(relu(up(x)))``, 8 -> 16 -> 8."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _TPNet(ZooModel):
    """Two ``_MLP`` blocks; `group`: the data-parallel group, whose rank seeds the input (the
    ranks of one tensor-parallel group see the same)."""

    def __init__(self, group: Any) -> None:
        super().__init__(group)
        self.blocks = nn.Sequential(_MLP(), _MLP())
        seeded_init_(self, 4)

    def get_input(self, device: torch.device) -> tuple[torch.Tensor]:
        return rand_input(11 + self.rank, device, 4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)

    def get_loss(self, input: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.square().sum()


def _reference(model: ZooModel, dist: Any, after_backward: Any = None, loss: Any = None):
    """The unwrapped `model` trained ``STEPS`` steps (``loss(model)``: ``Driver.run``'s `loss`),
    its gradients averaged over the test's ranks by hand, then ``after_backward(driver, step)``:
    (driver, losses)."""
    driver = training.Driver(model.to(dist.device), model, dist.device)

    def average(step: int) -> None:
        training.average_gradients(model, dist.group)
        if after_backward is not None:
            after_backward(driver, step)

    return driver, driver.run(STEPS, after_backward=average, loss=loss and loss(model))


def _two_forwards(model: ZooModel) -> Any:
    """``Driver.run``'s `loss`: the sum of two forwards' losses (inputs `index`, `index` + 9)."""

    def loss(step: int, index: int) -> torch.Tensor:
        device = model.trunk.weight.device
        inputs = [training.micro_input(model, device, i) for i in (index, index + 9)]
        return sum(model.get_loss(x, model(*x)) for x in inputs)

    return loss


def _holding(model: nn.Module, expected: dict[str, torch.Tensor], parts: int) -> list[str]:
    """Each registered parameter that does not hold 1/`parts` of its full value, or whose full
    value is not `expected`'s."""
    wrong = []
    for name, param in model.named_parameters():
        shape, value = tuple(_local(param).shape), expected[name]
        if _local(param).numel() * parts != value.numel():
            wrong.append(f"{name}: holds {shape} of {tuple(value.shape)}, 1/{parts} promised")
        elif not torch.equal(full_tensor(param), value):
            wrong.append(f"{name}: holds {shape}, but its full value is not the parameter's")
    return wrong


def _dim_one(param: torch.Tensor) -> Any:
    """The shard_placement_fn of ``fsdp2.shard_placement_fn``: matrices on dim 1."""
    from torch.distributed.tensor import Shard

    return Shard(1) if param.ndim == 2 else None


def _misplaced(model: nn.Module, expected: dict[str, torch.Tensor], when: str) -> list[str]:
    """The registered parameters not laid out as ``_dim_one`` says (matrices ``Shard(1)``, the
    rest ``Shard(0)``) over their mesh, or whose local shard is not that chunk of `expected`."""
    wrong = []
    for name, param in model.named_parameters():
        dim = 1 if param.ndim == 2 else 0
        placements = tuple(getattr(param, "placements", ()))
        if [getattr(placement, "dim", None) for placement in placements] != [dim]:
            wrong.append(f"{when}: {name} is placed {placements}, Shard({dim}) promised")
            continue
        mesh = param.device_mesh
        chunk = expected[name].chunk(mesh.size(), dim)[mesh.get_local_rank()]
        if not torch.equal(_local(param).detach(), chunk):
            wrong.append(f"{when}: {name}'s local shard is not its chunk {mesh.get_local_rank()}")
    return wrong


# _SideInputNet's units: the policy of each kind, and what each promises: the dtypes of its
# forward's inputs, of the parameters it computes with, of its output and of its reductions
_POLICIES = {
    "root": {"param_dtype": BF16, "reduce_dtype": FP32, "output_dtype": FP32},
    "block": {"param_dtype": BF16, "reduce_dtype": FP32, "cast_forward_inputs": False},
    "norm": {"param_dtype": FP32, "output_dtype": BF16},  # fp32 norms in a bf16 model
    "head": {"param_dtype": BF16},  # reduce_dtype None: reduces in param_dtype
}
_PROMISED = {
    "root": {"inputs": (BF16,), "parameters": BF16, "output": FP32, "reduction": FP32},
    # the trunk's bf16 output and the fp32 side input, not cast
    "block": {"inputs": (BF16, FP32), "parameters": BF16, "output": BF16, "reduction": FP32},
    "norm": {"inputs": (FP32,), "parameters": FP32, "output": BF16, "reduction": FP32},
    "head": {"inputs": (BF16,), "parameters": BF16, "output": BF16, "reduction": BF16},
}


def _mixed_precision_units(ns: Any, model: _SideInputNet, mesh: Any) -> dict[str, tuple]:
    """``ns.fully_shard`` each unit of `model` with its kind's policy: name -> (module, kind)."""
    units = {}
    for index, block in enumerate(model.blocks):
        units[f"blocks.{index}.norm"] = (block.norm, "norm")
        units[f"blocks.{index}"] = (block, "block")
    units["head"] = (model.head, "head")
    units["root"] = (model, "root")
    for module, kind in units.values():
        ns.fully_shard(module, mesh=mesh, mp_policy=ns.MixedPrecisionPolicy(**_POLICIES[kind]))
    return units


def _observe_dtypes(units: dict[str, tuple]) -> tuple[dict, collections.Counter, list]:
    """Hooks after the implementation's recording what each unit's forward sees: ``seen[unit,
    what]`` the dtypes of its inputs, of its first parameter and of its output, ``calls`` its
    forwards (recomputes too); each gradient arriving in a unit's own sharded parameters is
    appended to the returned `events` list (after that unit's reductions)."""
    seen: dict = collections.defaultdict(set)
    calls: collections.Counter = collections.Counter()
    events: list = []
    instances = [module for module, _ in units.values()]

    def pre_hook(name: str) -> Any:
        def record(module: nn.Module, args: tuple) -> None:
            calls[name] += 1
            seen[name, "inputs"].add(tuple(a.dtype for a in args if torch.is_tensor(a)))
            seen[name, "parameters"].add(next(module.parameters()).dtype)

        return record

    for name, (module, _) in units.items():
        module.register_forward_pre_hook(pre_hook(name))
        module.register_forward_hook(
            lambda m, a, out, name=name: seen[name, "output"].add(out.dtype)
        )
        for param in training.own_parameters(instances, module):
            param.register_post_accumulate_grad_hook(lambda p, name=name: events.append(name))
    return seen, calls, events


def _reductions_by_unit(events: list) -> dict[str, set]:
    """Unit -> the dtypes of the reductions issued since the previous unit's gradients arrived
    (`events`: each reduction's dtypes, each unit name as its gradient arrives)."""
    reduced: dict[str, set] = collections.defaultdict(set)
    pending: list = []
    for event in events:
        if isinstance(event, tuple):
            pending.extend(event)
        elif pending:
            reduced[event].update(pending)
            pending = []
    return reduced


class BaseFSDP2APITests:
    """``fully_shard``'s arguments and policies through the adapter's FSDP2 namespace (see the
    module docstring). `coverage`: "full" runs every case, "pairwise" (``fsdp-conformance
    run``'s default; ``--fsdp-coverage`` overrides) the cases in ``PAIRWISE``."""

    pytestmark = pytest.mark.world_size(2)  # each cell's, where it names none

    coverage: ClassVar[str] = "full"
    reshard_cases: ClassVar[tuple[str, ...]] = tuple(RESHARD_VALUES)
    offload_cases: ClassVar[tuple[str, ...]] = ("no_sync", "sync_every")
    mesh_dims_cases: ClassVar[tuple[str, ...]] = tuple(MESH_DIMS)
    checkpointing_cases: ClassVar[tuple[str, ...]] = ("wrapper", "composable")
    PAIRWISE: ClassVar[frozenset[str]] = frozenset({"True", "no_sync", "hsdp", "composable"})
    MAX_NORM: ClassVar[float] = 1.0

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        full = (metafunc.config.getoption("fsdp_coverage", None) or self.coverage) == "full"
        for name, cases in (
            ("reshard", self.reshard_cases),
            ("offload", self.offload_cases),
            ("mesh_dims", self.mesh_dims_cases),
            ("checkpointing", self.checkpointing_cases),
        ):
            if name in metafunc.fixturenames:
                chosen = [case for case in cases if full or case in self.PAIRWISE]
                marks = {"int": pytest.mark.world_size(4)}  # 2 of 4 ranks
                params = [pytest.param(case, id=case, marks=marks.get(case, ())) for case in chosen]
                metafunc.parametrize(name, params)

    @check(
        "fsdp2.reshard_after_forward",
        "fully_shard(reshard_after_forward=True / False / int): after forward each rank holds "
        "1/world size (the root too) / all / 1/int of every registered parameter, backward "
        "all-gathers over the whole mesh / not at all / int ranks; training matches DDP",
        features=(Feature.FSDP2_API,),
        case="suite.training.LoopCase",
        case_of=lambda reshard: _case(f"reshard_after_forward={reshard}"),
        api=(
            "fully_shard()",
            "fully_shard(mesh)",
            "fully_shard(reshard_after_forward=True)",
            "fully_shard(reshard_after_forward=False)",
            "fully_shard(reshard_after_forward=int)",
        ),
    )
    def test_reshard_after_forward(self, fsdp_adapter: Any, dist: Any, reshard: str):
        value = RESHARD_VALUES[reshard]
        model = zoo.build(LOOPS, dist.group, None, dist.device)
        _shard_loops(_api(fsdp_adapter), model, mesh=device_mesh(dist), reshard_after_forward=value)
        parts = {True: dist.world_size, False: 1}.get(value, value)  # of each parameter held
        what = f"loops, fully_shard(reshard_after_forward={value!r}) on {dist.world_size} ranks"
        label = _label(fsdp_adapter, what)
        problems: list[str] = []
        gathers: dict[int, set] = collections.defaultdict(set)  # step -> groups of backward's
        backward_of: dict = {}  # "step": the step whose backward runs

        def loss(step: int, index: int) -> torch.Tensor:
            before = full_tensors(model)
            inputs = training.micro_input(model, dist.device, index)
            step_loss = model.get_loss(inputs, model(*inputs))
            problems.extend(f"step {step}: {text}" for text in _holding(model, before, parts))
            backward_of["step"] = step
            return step_loss

        def record(call: Any) -> None:
            if call.op == Op.ALL_GATHER and "step" in backward_of:
                gathers[backward_of["step"]].add(call.group.size())

        driver = training.Driver(model, model, dist.device, fsdp_adapter)
        with observing_collectives(record, dist.barrier):
            losses = driver.run(STEPS, loss=loss, after_backward=lambda _: backward_of.clear())
        for step in range(STEPS):
            if sorted(gathers[step]) != ([] if parts == 1 else [parts]):
                problems.append(
                    f"step {step}: backward all-gathered over groups of {sorted(gathers[step])} "
                    f"ranks; {'none' if parts == 1 else f'{parts} ranks'} promised"
                )
        check_listed(label, "reshard_after_forward not kept", problems)
        reference = training.ddp_driver(LOOPS, dist)
        ref_losses = reference.run(STEPS)
        tol = test_parity.tolerance(dist.world_size)[0]
        _assert_trained(label, driver, losses, reference, ref_losses, tol)

    @check(
        "fsdp2.mixed_precision",
        "a MixedPrecisionPolicy per module (fp32 norms in a bf16 model; output_dtype on inner "
        "units; cast_forward_inputs=False with an fp32 side input): each unit computes, outputs "
        "and reduces in its policy's dtypes, in an activation-checkpoint recompute too; fp32 "
        "shards and gradients; training within tolerance of fp32",
        features=(Feature.FSDP2_API,),
        case="suite.training.LoopCase",
        case_of=lambda: _case("mixed_precision", "side_input"),
        api=(
            "fully_shard(mp_policy)",
            "MixedPrecisionPolicy(param_dtype)",
            "MixedPrecisionPolicy(reduce_dtype)",
            "MixedPrecisionPolicy(output_dtype)",
            "MixedPrecisionPolicy(cast_forward_inputs=False)",
        ),
    )
    def test_mixed_precision(self, fsdp_adapter: Any, dist: Any):
        model = _SideInputNet(dist.group).to(dist.device)
        units = _mixed_precision_units(_api(fsdp_adapter), model, device_mesh(dist))
        seen, calls, events = _observe_dtypes(units)
        driver = training.Driver(model, model, dist.device, fsdp_adapter)

        def reductions(call: Any) -> None:
            if call.op in REDUCE_OPS:
                events.append(tuple(call.dtypes))

        with observing_collectives(reductions, dist.barrier):
            losses = driver.run(STEPS)
        reduced = _reductions_by_unit(events)
        problems = []
        for name, (_, kind) in units.items():
            for what, promised in _PROMISED[kind].items():
                got = reduced[name] if what == "reduction" else seen[name, what]
                if got != {promised}:
                    seen_dtypes = sorted(map(str, got))
                    problems.append(f"{name} ({kind}) {what}: {seen_dtypes}, {promised} promised")
        if calls["blocks.0.norm"] < 2 * STEPS:  # the check's premise
            problems.append("blocks.0.norm ran no activation-checkpoint recompute (suite bug)")
        for name, param in model.named_parameters():
            dtypes = {str(param.dtype), str(getattr(param.grad, "dtype", FP32))}
            if dtypes != {str(FP32)}:
                problems.append(f"{name}: sharded parameter / gradient in {sorted(dtypes)}")
        label = _label(fsdp_adapter, "a MixedPrecisionPolicy per unit (module docstring)")
        check_listed(label, "dtypes differ from the policies'", problems)
        reference, ref_losses = _reference(_SideInputNet(dist.group), dist)
        eps = test_precision.EPS[BF16]
        fp32 = {"atol": test_precision.PARAM_ATOL_PER_EPS * eps}
        fp32["loss_rtol"] = test_precision.LOSS_RTOL_PER_EPS * eps
        _assert_trained(f"{label}, against fp32", driver, losses, reference, ref_losses, **fp32)

    @check(
        "fsdp2.grouped",
        "fully_shard([embed, head]) with head.weight tied to embed.weight and the head run per "
        "chunk after forward: both modules returned as FSDPModules, the weight stays one "
        "parameter, the full state dict holds it under both names; training matches DDP",
        features=(Feature.FSDP2_API,),
        case="suite.training.LoopCase",
        case_of=lambda: _case("grouped", "tied_chunks"),
        api=("fully_shard(module=list)",),
    )
    def test_grouped_tied(self, fsdp_adapter: Any, dist: Any):
        ns = _api(fsdp_adapter)
        model = _TiedChunks(dist.group).to(dist.device)
        mesh = device_mesh(dist)
        grouped = ns.fully_shard([model.embed, model.head], mesh=mesh)
        ns.fully_shard(model, mesh=mesh)
        label = _label(fsdp_adapter, "fully_shard([embed, head]) with head.weight = embed.weight")
        problems = []
        modules = list(grouped) if isinstance(grouped, (list, tuple)) else [grouped]
        if [id(m) for m in modules] != [id(model.embed), id(model.head)] or not all(
            isinstance(m, ns.FSDPModule) for m in modules
        ):
            problems.append(f"fully_shard returned {grouped!r}, not [embed, head] as FSDPModules")
        driver = training.Driver(model, model, dist.device, fsdp_adapter)
        losses = driver.run(STEPS)
        if model.head.weight is not model.embed.weight:
            problems.append("after training head.weight is no longer embed.weight")
        state = fsdp_adapter.state_dict(model)
        tied = [state.get(name) for name in ("embed.weight", "head.weight")]
        if any(value is None for value in tied) or not torch.equal(*map(full_tensor, tied)):
            problems.append(
                f"the full state dict does not hold the weight under both names: {sorted(state)}"
            )
        check_listed(label, "the tied weight is not kept", problems)
        reference, ref_losses = _reference(_TiedChunks(dist.group), dist)
        _assert_trained(label, driver, losses, reference, ref_losses, SUM_ORDER_TOL)

    @check(
        "fsdp2.shard_placement_fn",
        "fully_shard(shard_placement_fn=Shard(1) for matrices): parameters and gradients placed "
        "Shard(1) with the right chunk, gradients and training as DDP, the layout kept by "
        "load_state_dict of the sharded and of the full state dict",
        features=(Feature.FSDP2_API,),
        case="suite.training.LoopCase",
        case_of=lambda: _case("shard_placement_fn=Shard(1)"),
        api=("fully_shard(shard_placement_fn)",),
    )
    def test_shard_placement_fn(self, fsdp_adapter: Any, dist: Any):
        model = zoo.build(LOOPS, dist.group, None, dist.device)
        initial = full_tensors(model)
        _shard_loops(_api(fsdp_adapter), model, mesh=device_mesh(dist), shard_placement_fn=_dim_one)
        label = _label(fsdp_adapter, "loops, fully_shard(shard_placement_fn=Shard(1) for matrices)")
        problems = _misplaced(model, initial, "after fully_shard")
        grads: list = []

        def record(step: int) -> None:
            named = model.named_parameters()
            grads.append({name: (p.grad, full_tensor(p.grad)) for name, p in named})

        driver = training.Driver(model, model, dist.device, fsdp_adapter)
        losses = driver.run(STEPS, after_backward=record)
        reference = training.ddp_driver(LOOPS, dist)
        ref_grads: list = []
        ref_backward = lambda step: ref_grads.append(reference.grads())
        ref_losses = reference.run(STEPS, after_backward=ref_backward)
        for step, (step_grads, expected) in enumerate(zip(grads, ref_grads)):
            for name, (grad, value) in step_grads.items():
                param = model.get_parameter(name)
                if tuple(getattr(grad, "placements", ())) != tuple(param.placements):
                    problems.append(f"step {step}: {name}'s gradient placed {grad.placements}")
                elif not torch.equal(value, expected[name]):
                    problems.append(f"step {step}: {name}'s gradient differs from DDP's")
        check_listed(label, "Shard(1) layout not kept", problems)
        _assert_trained(label, driver, losses, reference, ref_losses)
        saved = {name: value.detach().clone() for name, value in model.state_dict().items()}
        full_state = {name: full_tensor(value) for name, value in saved.items()}
        for when, load in (
            ("load_state_dict of its sharded state dict", lambda: model.load_state_dict(saved)),
            (
                "loading the full state dict",
                lambda: fsdp_adapter.load_state_dict(model, dict(full_state)),
            ),
        ):
            driver.run(1, start=STEPS)  # moves the parameters away from the state dict's
            load()
            problems += _misplaced(model, full_state, f"after {when}")
        check_listed(label, "Shard(1) layout not kept", problems)

    @check(
        "fsdp2.cpu_offload",
        "fully_shard(offload_policy=CPUOffloadPolicy(pin_memory=False)) with gradient "
        "accumulation (inside and outside set_requires_gradient_sync(False)): sharded "
        "parameters, gradients and optimizer state on the CPU, forward computing on the "
        "device, training as DDP",
        features=(Feature.FSDP2_API, Feature.GRADIENT_ACCUMULATION),
        case="suite.training.LoopCase",
        case_of=lambda offload: _case(f"cpu_offload {offload}"),
        api=("fully_shard(offload_policy)", "CPUOffloadPolicy(pin_memory=False)"),
    )
    def test_cpu_offload(self, fsdp_adapter: Any, dist: Any, offload: str):
        ns = _api(fsdp_adapter)
        model = zoo.build(LOOPS, dist.group, None, dist.device)
        policy = ns.CPUOffloadPolicy(pin_memory=False)
        _shard_loops(ns, model, mesh=device_mesh(dist), offload_policy=policy)
        label = _label(fsdp_adapter, f"loops, CPUOffloadPolicy(pin_memory=False), {offload}")
        driver = training.Driver(model, model, dist.device, fsdp_adapter)
        wrong: list[str] = []

        def on_cpu(when: str, named: Any) -> None:
            wrong.extend(f"{when}: {n} on {t.device}" for n, t in named if t.device.type != "cpu")

        def computes_on_device(module: nn.Module, args: tuple) -> None:
            if module.weight.device != dist.device:
                wrong.append(f"forward: a Linear computes with a weight on {module.weight.device}")

        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_pre_hook(computes_on_device)

        def after_backward(step: int) -> None:
            named = list(model.named_parameters())
            on_cpu(f"step {step}", named)
            on_cpu(f"step {step} gradient", [(n, p.grad) for n, p in named])

        def after_step(step: int) -> None:
            state = driver.optimizer.state.values()
            on_cpu(f"step {step} optimizer state", [(k, v) for s in state for k, v in s.items()])

        options = {"micro_batches": 2, "sync_every": offload == "sync_every"}
        losses = driver.run(STEPS, after_backward=after_backward, after_step=after_step, **options)
        check_listed(label, "offloaded state not on the CPU", wrong)
        reference = training.ddp_driver(LOOPS, dist)
        ref_losses = reference.run(STEPS, **options)
        _assert_trained(label, driver, losses, reference, ref_losses, SUM_ORDER_TOL)

    @check(
        "fsdp2.dp_mesh_dims",
        "fully_shard(mesh=an SPMD mesh, dp_mesh_dims=DataParallelMeshDims(shard=..., "
        "replicate=..., a name or a tuple of names)) on parameters replicated over it: each "
        "rank holds 1/size of the shard dims of every parameter, training matches DDP",
        features=(Feature.FSDP2_API,),
        case="suite.training.LoopCase",
        case_of=lambda mesh_dims: _case(f"dp_mesh_dims {mesh_dims}"),
        api=(
            "fully_shard(dp_mesh_dims)",
            "DataParallelMeshDims(shard=str)",
            "DataParallelMeshDims(shard=tuple[str, ...])",
            "DataParallelMeshDims(replicate=str)",
            "DataParallelMeshDims(replicate=tuple[str, ...])",
        ),
    )
    def test_dp_mesh_dims(self, fsdp_adapter: Any, dist: Any, mesh_dims: str):
        from torch.distributed.tensor import DTensor, Replicate, distribute_module

        ns = _api(fsdp_adapter)
        mesh = device_mesh(dist, (1, dist.world_size), ("r", "s"))
        named = dict(zip(("r", "s"), mesh.mesh_dim_names))
        dims = {
            field: named[value] if isinstance(value, str) else tuple(named[v] for v in value)
            for field, value in MESH_DIMS[mesh_dims].items()
        }
        model = zoo.build(LOOPS, dist.group, None, dist.device)
        distribute_module(model, mesh)  # every parameter a DTensor replicated over the mesh
        spec = ns.DataParallelMeshDims(**dims)
        _shard_loops(ns, model, mesh=mesh, dp_mesh_dims=spec)
        label = _label(fsdp_adapter, f"loops on a {tuple(mesh.shape)} mesh, {spec}")
        parts = dist.world_size if "shard" in dims else 1
        held = _holding(model, full_tensors(model), parts)
        check_listed(label, "parameters not sharded over the shard dims", held)

        def loss(step: int, index: int) -> torch.Tensor:
            inputs = training.micro_input(model, dist.device, index)
            replicated = [Replicate()] * mesh.ndim
            output = model(DTensor.from_local(inputs[0], mesh, replicated, run_check=False))
            return model.get_loss(inputs, output.to_local())

        driver = training.Driver(model, model, dist.device, fsdp_adapter)
        losses = driver.run(STEPS, loss=loss)
        reference = training.ddp_driver(LOOPS, dist)
        _assert_trained(label, driver, losses, reference, reference.run(STEPS))

    @check(
        "fsdp2.activation_checkpointing",
        "activation checkpointing composed with fully_shard, two forwards before one backward: "
        "checkpoint_wrapper (apply_activation_checkpointing) around each unit, or composable "
        "checkpoint(block) around a fully_shard'ed child: every block recomputed, state dict "
        "keys those of the unwrapped model, training as the unwrapped model's",
        features=(Feature.FSDP2_API,),
        case="suite.training.LoopCase",
        case_of=lambda checkpointing: _case(f"checkpointing {checkpointing}"),
    )
    def test_activation_checkpointing(self, fsdp_adapter: Any, dist: Any, checkpointing: str):
        from torch.distributed._composable import checkpoint as checkpoint_module
        from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as wrapper

        ns, mesh = _api(fsdp_adapter), device_mesh(dist)
        model = zoo.build(LOOPS, dist.group, None, dist.device)
        keys, calls = sorted(model.state_dict()), collections.Counter()
        for index, block in enumerate(model.blocks):
            block[0].register_forward_pre_hook(lambda *_, index=index: calls.update([index]))
        if checkpointing == "wrapper":
            blocks = set(model.blocks)
            no_reentrant = functools.partial(
                wrapper.checkpoint_wrapper, checkpoint_impl=wrapper.CheckpointImpl.NO_REENTRANT
            )
            wrapper.apply_activation_checkpointing(
                model, checkpoint_wrapper_fn=no_reentrant, check_fn=blocks.__contains__
            )
            _shard_loops(ns, model, mesh=mesh)
        else:
            for block in model.blocks:
                checkpoint_module(block)
                ns.fully_shard(block[0], mesh=mesh)
            ns.fully_shard(model.head, mesh=mesh)
            ns.fully_shard(model, mesh=mesh)
        driver = training.Driver(model, model, dist.device, fsdp_adapter)
        losses = driver.run(STEPS, loss=_two_forwards(model))
        label = _label(fsdp_adapter, f"loops, checkpointing {checkpointing}, two forwards")
        problems = [f"block {i} ran {calls[i]} times" for i in range(3) if calls[i] < 4 * STEPS]
        if sorted(model.state_dict()) != keys:
            problems.append(f"state dict keys {sorted(model.state_dict())}, not {keys}")
        check_listed(label, "activation checkpointing not composed", problems)
        reference, ref_losses = _reference(
            zoo.build(LOOPS, dist.group, None, dist.device), dist, loss=_two_forwards
        )
        _assert_trained(label, driver, losses, reference, ref_losses, SUM_ORDER_TOL)

    @check(
        "fsdp2.tensor_parallel",
        "FSDP over the dp dim of a 2 x 2 (dp, tp) mesh around tensor-parallel blocks: losses, "
        "clip_grad_norm_'s 2-D norm and parameters as the unsharded model's; the full state "
        "dict holds the full parameters and loads back keeping the layout",
        features=(Feature.FSDP2_API, Feature.CLIP_GRAD_NORM, Feature.FULL_STATE_DICT),
        case="suite.training.LoopCase",
        case_of=lambda: _case("tensor_parallel", "tp_mlp"),
        api=("fully_shard(mesh)",),
    )
    @pytest.mark.world_size(4)
    def test_tensor_parallel(self, fsdp_adapter: Any, dist: Any):
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        ns = _api(fsdp_adapter)
        mesh = device_mesh(dist, (2, 2), ("dp", "tp"))
        dp, tp = (mesh[name] for name in mesh.mesh_dim_names)
        model = _TPNet(dp.get_group()).to(dist.device)
        initial = full_tensors(model)
        for block in model.blocks:
            parallelize_module(block, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            ns.fully_shard(block, mesh=dp)
        ns.fully_shard(model, mesh=dp)
        label = _label(fsdp_adapter, "two MLP blocks, tensor parallel within FSDP on (dp, tp)")
        norms, ref_norms = [], []
        driver = training.Driver(model, model, dist.device, fsdp_adapter)
        clip = lambda step: norms.append(driver.clip(self.MAX_NORM))
        losses = driver.run(STEPS, after_backward=clip)
        ref_clip = lambda reference, step: ref_norms.append(reference.clip(self.MAX_NORM))
        reference, ref_losses = _reference(_TPNet(dp.get_group()), dist, ref_clip)
        assert min(ref_norms) > self.MAX_NORM, (
            f"{label}: norms {ref_norms} clip nothing (suite bug)"
        )
        message = f"{label}: clip_grad_norm_ returned norms other than the unsharded model's"
        clipped, ref_clipped = torch.stack(norms), torch.stack(ref_norms)
        training.assert_close(message, clipped, ref_clipped, 0.0, test_loops.CLIP_NORM_RTOL)
        tol = test_loops.CLIP_PARAM_TOL
        _assert_trained(label, driver, losses, reference, ref_losses, tol)
        full_state, expected = full_state_dict(fsdp_adapter, model), reference.params()
        training.assert_params(f"{label}, full state dict", full_state, expected, STEPS, tol, tol)
        layout = {name: param.placements for name, param in model.named_parameters()}
        fsdp_adapter.load_state_dict(model, dict(initial))  # it replaces the values
        named = model.named_parameters()
        moved = [name for name, param in named if param.placements != layout[name]]
        check_listed(label, "the layout changed when loading the full state dict", moved)
        loaded = full_tensors(model)
        training.assert_params(f"{label}, loaded initial state dict", loaded, initial, 0)


class TestFSDP2API(BaseFSDP2APITests): ...
