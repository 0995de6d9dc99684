"""The FSDP1 API family, constructor and config (``fsdp1.*``; docs/suite.md, "The FSDP1 API
family"): each argument of ``FullyShardedDataParallel`` and field of ``MixedPrecision`` driven
as users write it, through the adapter's ``Declarations.api["fsdp1"]`` namespace (torch's
``torch.distributed.fsdp``, or any implementation of that API), its documented promise asserted
against a reference: the unwrapped model under DDP or alone, the documented dtype, device,
group or instances. Cells need ``Feature.FSDP1_API``; world size 2 (4 for the 2-D mesh).

[Note: the FSDP1 family's model]
``loops`` (models/loops.py: trunk, blocks 0-2, head) built unwrapped, auto-wrapped by a
callable selecting the blocks and the head unless the check drives another policy, trained
``STEPS`` SGD steps by ``training.Driver`` (the root's own ``parameters()``); full parameters
come from ``summon_full_params`` + ``named_parameters()`` (the plain module's names, as
documented). Mixed precision against float32 DDP: ``test_precision``'s tolerances.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from fsdp_conformance.adapters import Feature, clean_param_name
from fsdp_conformance.adapters.base import group_by
from fsdp_conformance.checks import CheckFailure
from fsdp_conformance.constants import REDUCE_OPS, Op
from fsdp_conformance.observe.comm_trace import observing_collectives

from . import test_optim, test_parity, test_precision, training, zoo
from .declare import check
from .test_sharding import device_mesh

STEPS = 2
MODEL = "loops"
FAMILY = (Feature.FSDP1_API,)
FSDP = "FullyShardedDataParallel"
BF16 = torch.bfloat16


def _built(adapter: Any, dist: Any, name: str = MODEL) -> tuple[Any, nn.Module]:
    """(the adapter's FSDP1 API namespace, the zoo model `name` built unwrapped)."""
    return adapter.declarations.api["fsdp1"], zoo.build(name, dist.group, None, dist.device)


def _wrap(api: Any, module: nn.Module, dist: Any, **kwargs: Any) -> nn.Module:
    """``FullyShardedDataParallel(module, **kwargs)`` on the test's group and device, by default
    auto-wrapping the blocks and the head ([Note: the FSDP1 family's model])."""
    if "device_mesh" not in kwargs:
        kwargs.setdefault("process_group", dist.group)
    kwargs.setdefault("device_id", dist.device)
    if "auto_wrap_policy" not in kwargs:
        kwargs["auto_wrap_policy"] = _selecting([*module.blocks, module.head])
    return api.FullyShardedDataParallel(module, **kwargs)


def _selecting(modules: list[nn.Module]) -> Any:
    """A callable auto_wrap_policy ``(module, recurse, nonwrapped_numel)`` wrapping `modules`."""
    chosen = {id(module) for module in modules}
    return lambda module, recurse, nonwrapped_numel: recurse or id(module) in chosen


def _names(model: nn.Module) -> dict[int, str]:
    return {id(module): name or "<root>" for name, module in model.named_modules()}


def _expect(label: str, failure: str, *observations: tuple[str, Any, Any]) -> None:
    """CheckFailure(`failure`) naming each ``(what, seen, expected)`` of `observations` whose
    seen value is not the expected one."""
    wrong = [(what, seen, expected) for what, seen, expected in observations if seen != expected]
    if wrong:
        details = "; ".join(
            f"{what}: {seen}, expected {expected}" for what, seen, expected in wrong
        )
        raise CheckFailure(f"{label}: {details}", failure, offenders=len(wrong))


def _per_key(seen: dict[str, Any], expected: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``_expect``'s observations: each key of `expected`, what `seen` holds under it."""
    return [(key, seen.get(key), value) for key, value in expected.items()]


def _full(api: Any, root: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameters, buffers) under ``summon_full_params``, by the names FSDP gives there."""
    with api.FullyShardedDataParallel.summon_full_params(root):
        params = {n: p.detach().clone() for n, p in root.named_parameters()}
        buffers = {n: b.detach().clone() for n, b in root.named_buffers()}
    return params, buffers


def _assert_trains_as(
    label: str,
    api: Any,
    root: nn.Module,
    reference: training.Driver,
    dist: Any,
    dtype: torch.dtype | None = None,
    calls: list[Any] | None = None,
    optimizer: Any = None,
    **run: Any,
) -> None:
    """``STEPS`` steps of `root` (`run`: ``Driver.run``'s hooks; its collectives into `calls`)
    against `reference`: the same parameter names under ``summon_full_params``, losses and full
    parameters within test_parity's tolerance of the world size (with `dtype`:
    test_precision's for it)."""
    expected = training.TrainingResult(reference.run(STEPS), reference.params())  # unobserved
    driver = training.Driver(root, root.module, dist.device)
    if optimizer is not None:
        driver.optimizer = optimizer
    with observing_collectives((calls if calls is not None else []).append):
        losses = driver.run(STEPS, **run)
    params = _full(api, root)[0]
    names = "parameter names under summon_full_params"
    failure = "parameter names differ from the plain module's"
    _expect(label, failure, (names, list(params), list(expected.params)))
    eps = test_precision.EPS.get(dtype, 0.0)
    atol, rtol = test_parity.tolerance(dist.world_size)
    atol = max(atol, test_precision.PARAM_ATOL_PER_EPS * eps)
    rtol = max(rtol, test_precision.LOSS_RTOL_PER_EPS * eps)
    actual = training.TrainingResult(losses, params)
    training.assert_same_training(label, actual, expected, atol, loss_rtol=rtol)


def _dtypes(modules: list[nn.Module]) -> dict[str, set[str]]:
    """Forward hooks on `modules` recording, by class name, the dtypes each computes with
    (its input's and its weight's, as its forward sees them)."""
    seen: dict[str, set[str]] = collections.defaultdict(set)

    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        seen[type(module).__name__] |= {str(args[0].dtype), str(module.weight.dtype)}

    for module in modules:
        module.register_forward_hook(hook)
    return seen


def _of(cls: type, model: nn.Module) -> list[nn.Module]:
    return [module for module in model.modules() if isinstance(module, cls)]


class BaseFSDP1ConstructorTests:
    """The FSDP1 API family's constructor and config checks (see the module docstring)."""

    pytestmark = pytest.mark.world_size(2)  # each cell's, where it names none

    @check(
        "fsdp1.auto_wrap_policy",
        "a callable, ModuleWrapPolicy or CustomPolicy auto_wrap_policy makes exactly the "
        "instances it selects (CustomPolicy with its per-module kwargs: NO_SHARD and bf16 "
        "observed) and trains as DDP",
        features=FAMILY,
        case="the policy form",
        case_of="policy",
        api=(
            f"{FSDP}(auto_wrap_policy=Callable)",
            f"{FSDP}(auto_wrap_policy=ModuleWrapPolicy)",
            f"{FSDP}(auto_wrap_policy=CustomPolicy)",
            "ShardingStrategy.NO_SHARD",
        ),
    )
    @pytest.mark.parametrize("policy", ["callable", "module_wrap", "custom"])
    def test_auto_wrap_policy(self, fsdp_adapter: Any, dist: Any, policy: str):
        api, model = _built(fsdp_adapter, dist)
        blocks, head, names = list(model.blocks), model.head, _names(model)
        selected, dtype = [*blocks, head], None
        if policy == "callable":
            auto = _selecting(selected)
        elif policy == "module_wrap":
            auto, selected = api.wrap.ModuleWrapPolicy({nn.Linear}), _of(nn.Linear, model)
        else:  # block 1 without sharding, the head in bfloat16, the rest as the root
            dtype = BF16
            low = api.MixedPrecision(param_dtype=BF16, cast_forward_inputs=True)
            kwargs = {
                id(blocks[1]): {"sharding_strategy": api.ShardingStrategy.NO_SHARD},
                id(head): {"mixed_precision": low},
            }
            chosen = {id(module) for module in selected}
            auto = api.wrap.CustomPolicy(lambda m: kwargs.get(id(m), id(m) in chosen))
        sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
        computed = {"head": _dtypes([head]), "trunk": _dtypes([model.trunk])}
        root = _wrap(api, model, dist, auto_wrap_policy=auto)
        label = f"adapter {fsdp_adapter.name!r}, {MODEL}, auto_wrap_policy {policy}"
        made = [names[id(i.module)] for i in api.FullyShardedDataParallel.fsdp_modules(root)]
        wanted = [names[id(module)] for module in [model, *selected]]
        failure = "instances differ from what the policy selects"
        _expect(label, failure, ("instances around", sorted(made), sorted(wanted)))
        _assert_trains_as(label, api, root, training.ddp_driver(MODEL, dist), dist, dtype)
        if policy == "custom":  # NO_SHARD keeps all of block 1 on each rank, sharded others not
            held = [sum(p.numel() for p in block.parameters()) for block in blocks]
            whole = [i for i in range(3) if held[i] == sizes[i]]
            _expect(
                label,
                "per-module kwargs not applied",
                ("blocks holding all their elements", whole, [1]),
                ("head computes in", dict(computed["head"]), {"Linear": {str(BF16)}}),
                ("trunk computes in", dict(computed["trunk"]), {"Linear": {str(torch.float32)}}),
            )

    @check(
        "fsdp1.mixed_precision",
        "MixedPrecision's fields as documented: keep_low_precision_grads leaves bf16 gradients "
        "(reduced in bf16), _module_classes_to_ignore runs those modules in float32, "
        "cast_root_forward_inputs=False leaves the root's inputs uncast while a nested "
        "cast_forward_inputs=True instance casts; each trains within tolerance of fp32 DDP",
        features=FAMILY,
        case="the MixedPrecision field driven",
        case_of=lambda strategy: f"keep_low_precision_grads:{strategy}",
        api=(
            f"{FSDP}(mixed_precision)",
            "MixedPrecision(param_dtype)",
            "MixedPrecision(keep_low_precision_grads=True)",
            "MixedPrecision(_module_classes_to_ignore)",
            "MixedPrecision(cast_forward_inputs=True)",
            "MixedPrecision(cast_root_forward_inputs=False)",
        ),
    )
    @pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
    def test_keep_low_precision_grads(self, fsdp_adapter: Any, dist: Any, strategy: str):
        api, model = _built(fsdp_adapter, dist)
        mixed = api.MixedPrecision(param_dtype=BF16, keep_low_precision_grads=True)
        # NO_SHARD with the original parameters: the other reduction and gradient paths
        kwargs = {"sharding_strategy": api.ShardingStrategy[strategy], "mixed_precision": mixed}
        root = _wrap(api, model, dist, use_orig_params=strategy == "NO_SHARD", **kwargs)
        seen: dict[str, set[str]] = collections.defaultdict(set)

        def after_backward(step: int) -> None:
            for param in root.parameters():
                seen["parameters"].add(str(param.dtype))
                seen["gradients"] |= {str(param.grad.dtype)} if param.grad is not None else set()

        label = (
            f"adapter {fsdp_adapter.name!r}, {MODEL}, MixedPrecision(param_dtype=bfloat16, "
            f"keep_low_precision_grads=True), {strategy}, use_orig_params={strategy == 'NO_SHARD'}"
        )
        calls: list[Any] = []
        reference = training.ddp_driver(MODEL, dist)
        # alternate_set_to_none: step 1 accumulates into zeroed low-precision gradients
        hooks = {"after_backward": after_backward, "alternate_set_to_none": True}
        _assert_trains_as(label, api, root, reference, dist, BF16, calls, **hooks)
        seen["reductions"] = {str(d) for c in calls if c.op in REDUCE_OPS for d in c.dtypes}
        # reduce_dtype None takes param_dtype
        expected = {"parameters": {"torch.float32"}, "gradients": {"torch.bfloat16"}}
        expected["reductions"] = expected["gradients"]
        _expect(label, "gradients not kept in low precision", *_per_key(seen, expected))

    @check("fsdp1.mixed_precision", case_of=lambda policy: f"_module_classes_to_ignore:{policy}")
    @pytest.mark.parametrize("policy", ["callable", "module_wrap"])
    def test_module_classes_to_ignore(self, fsdp_adapter: Any, dist: Any, policy: str):
        api, model = _built(fsdp_adapter, dist, "loops_norm")
        seen = _dtypes(_of(nn.LayerNorm, model) + _of(nn.Linear, model))
        auto = {"module_wrap": api.wrap.ModuleWrapPolicy({nn.Linear})}.get(policy)
        kwargs = {"auto_wrap_policy": auto} if auto else {}
        mixed = api.MixedPrecision(param_dtype=BF16, _module_classes_to_ignore=(nn.LayerNorm,))
        root = _wrap(api, model, dist, mixed_precision=mixed, **kwargs)
        label = (
            f"adapter {fsdp_adapter.name!r}, loops_norm, MixedPrecision(param_dtype=bfloat16, "
            f"_module_classes_to_ignore=(LayerNorm,)), auto_wrap_policy {policy}"
        )
        _assert_trains_as(label, api, root, training.ddp_driver("loops_norm", dist), dist, BF16)
        expected = {"LayerNorm": {"torch.float32"}, "Linear": {"torch.bfloat16"}}
        _expect(label, "ignored module classes not in full precision", *_per_key(seen, expected))

    @check("fsdp1.mixed_precision", case_of=lambda: "cast_forward_inputs")
    def test_cast_forward_inputs(self, fsdp_adapter: Any, dist: Any):
        api, model = _built(fsdp_adapter, dist)
        seen: dict[str, str] = {}
        model.register_forward_pre_hook(lambda m, args: seen.update(root=str(args[0].dtype)))
        # the model casts its input itself, as a model given float32 inputs must
        model.register_forward_pre_hook(lambda m, args: (args[0].to(m.trunk.weight.dtype),))
        model.head.register_forward_pre_hook(lambda m, a: seen.update(head=str(a[0].dtype)))
        fp16 = api.MixedPrecision(param_dtype=torch.float16, cast_forward_inputs=True)
        model.head = _wrap(api, model.head, dist, mixed_precision=fp16, auto_wrap_policy=None)
        bf16 = api.MixedPrecision(param_dtype=BF16, cast_root_forward_inputs=False)
        root = _wrap(api, model, dist, mixed_precision=bf16, auto_wrap_policy=None)
        label = (
            f"adapter {fsdp_adapter.name!r}, {MODEL}, root MixedPrecision(param_dtype=bfloat16,"
            " cast_root_forward_inputs=False), head MixedPrecision(param_dtype=float16, "
            "cast_forward_inputs=True)"
        )
        _assert_trains_as(label, api, root, training.ddp_driver(MODEL, dist), dist, BF16)
        # the root's module gets the float32 inputs as given, the head casts to its float16
        expected = {"root": "torch.float32", "head": "torch.float16"}
        _expect(label, "forward inputs cast against the configuration", *_per_key(seen, expected))

    @check(
        "fsdp1.param_init_fn",
        "param_init_fn materialises a meta-device model under auto-wrapping: called once per "
        "module, the values of the model built on the device, then trains as DDP",
        features=FAMILY,
        api=(f"{FSDP}(param_init_fn)",),
    )
    def test_param_init_fn(self, fsdp_adapter: Any, dist: Any):
        api, model = _built(fsdp_adapter, dist, "buffered_meta")
        names = _names(model)
        calls: collections.Counter[str] = collections.Counter()

        def init(module: nn.Module) -> None:  # the documented recipe: this module only
            calls[names.get(id(module), type(module).__name__)] += 1
            module.to_empty(device=dist.device, recurse=False)
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()

        # each module holding tensors on meta (its own) initialised exactly once
        owners = [m for m in model.modules() if [*m.parameters(False), *m.buffers(False)]]
        expected = {names[id(m)]: 1 for m in owners}
        root = _wrap(api, model, dist, param_init_fn=init)
        label = f"adapter {fsdp_adapter.name!r}, buffered_meta, param_init_fn, auto-wrapped"
        seen = {name: n for name, n in calls.items() if n != 1 or name in expected}
        _expect(label, "param_init_fn not called once per module", ("calls", seen, expected))
        plain = zoo.build("buffered", dist.group, None, dist.device).to(dist.device)
        params, buffers = _full(api, root)
        want = dict(plain.named_parameters()) | dict(plain.named_buffers())
        message = f"{label}, the values against the model built on the device"
        failure = "materialised values differ from the reference"
        training.check_same_values(message, failure, params | buffers, want)
        _assert_trains_as(label, api, root, training.ddp_driver("buffered", dist), dist)

    @check(
        "fsdp1.ignored",
        "ignored_modules / ignored_states=[module]: the module is not wrapped though the policy "
        "selects it, its parameters stay whole and unreduced, the rest trains as DDP",
        features=FAMILY,
        case="the argument: 'ignored_modules' or 'ignored_states'",
        case_of="argument",
        api=(f"{FSDP}(ignored_modules)", f"{FSDP}(ignored_states=Iterable[Module])"),
    )
    @pytest.mark.parametrize("argument", ["ignored_modules", "ignored_states"])
    def test_ignored_modules(self, fsdp_adapter: Any, dist: Any, argument: str):
        api, model = _built(fsdp_adapter, dist)
        model.to(dist.device)  # FSDP moves no ignored module
        block = model.blocks[1]  # selected by the policy, but ignored
        ignored = {id(param): name for name, param in block.named_parameters()}
        root = _wrap(api, model, dist, **{argument: [block]})
        label = f"adapter {fsdp_adapter.name!r}, {MODEL}, {argument}=[blocks[1]], auto-wrapped"
        instances = api.FullyShardedDataParallel.fsdp_modules(root)
        own = sorted(ignored[id(p)] for p in root.parameters() if id(p) in ignored)
        _expect(
            label,
            "ignored module managed by FSDP",
            ("instances around it", sum(i.module is block for i in instances), 0),
            ("its parameters registered as themselves", own, sorted(ignored.values())),
        )
        losses, grads = _ignored_run(root, model, block, dist, reduce=False)
        plain = zoo.build(MODEL, dist.group, None, dist.device).to(dist.device)
        ref_losses, ref_grads = _ignored_run(plain, plain, plain.blocks[1], dist, reduce=True)
        # bit-exact against the plain model with every gradient but the ignored ones averaged
        failure = "training differs from the reference"
        message = f"{label}, its gradients after the first backward"
        training.check_same_values(message, failure, grads, ref_grads)
        actual = {"losses": losses, **_full(api, root)[0]}
        expected = {"losses": ref_losses, **dict(plain.named_parameters())}
        training.check_same_values(f"{label}, losses and parameters", failure, actual, expected)

    @check(
        "fsdp1.device_id",
        "device_id as a torch.device puts every instance's parameters and buffers there and "
        "trains as DDP; an int names an accelerator (refused on a host without one)",
        features=FAMILY,
        case="the form: 'device' or 'int'",
        case_of="form",
        api=(f"{FSDP}(device_id=device)", f"{FSDP}(device_id=int)"),
    )
    @pytest.mark.parametrize("form", ["device", "int"])
    def test_device_id(self, fsdp_adapter: Any, dist: Any, form: str):
        api = fsdp_adapter.declarations.api["fsdp1"]
        model = zoo.build("loops_buffer", dist.group, None, torch.device("cpu"))
        device = dist.device
        label = f"adapter {fsdp_adapter.name!r}, loops_buffer built on cpu, device_id {form}"
        if form == "int" and device.type == "cpu":
            try:
                _wrap(api, model, dist, device_id=0)
            except (RuntimeError, ValueError) as error:
                named = "accelerator" in str(error).lower()
                _expect(label, "unclear error", ("the error names the accelerator", named, True))
                return
            raise CheckFailure(
                f"{label}: device_id=0 (an accelerator's index) was accepted on a host without one",
                "an accelerator index accepted without an accelerator",
            )
        root = _wrap(api, model, dist, device_id=device.index if form == "int" else device)
        tensors = [*root.named_parameters(), *root.named_buffers()]
        elsewhere = [name for name, t in tensors if t.device != device]
        _expect(label, "tensors not on device_id", (f"not on {device}", elsewhere, []))
        _assert_trains_as(label, api, root, training.ddp_driver("loops_buffer", dist), dist)

    @check(
        "fsdp1.device_mesh",
        "device_mesh: a 1-D mesh shards over its group; a 2-D (replicate, shard) mesh with "
        "HYBRID_SHARD gathers and reduce-scatters within the shard dimension and all-reduces "
        "across the replicate one; both train as DDP",
        features=FAMILY,
        case="the mesh: '1d' or '2d'",
        case_of="mesh_dims",
        api=(f"{FSDP}(device_mesh)", "ShardingStrategy.HYBRID_SHARD"),
    )
    @pytest.mark.parametrize(
        "mesh_dims",
        [
            pytest.param("1d", marks=pytest.mark.world_size(2)),
            pytest.param("2d", marks=pytest.mark.world_size(4)),
        ],
    )
    def test_device_mesh(self, fsdp_adapter: Any, dist: Any, mesh_dims: str):
        api, model = _built(fsdp_adapter, dist)
        kwargs: dict[str, Any] = {}
        if mesh_dims == "1d":
            mesh = device_mesh(dist)
            shard = replicate = mesh.get_group()
        else:  # replicate across the rows, shard within them: torch's DeviceMesh layout
            mesh = device_mesh(dist, (2, dist.world_size // 2), ("replicate", "shard"))
            kwargs["sharding_strategy"] = api.ShardingStrategy.HYBRID_SHARD
            shard, replicate = mesh.get_group(1), mesh.get_group(0)
        root = _wrap(api, model, dist, device_mesh=mesh, **kwargs)
        label = f"adapter {fsdp_adapter.name!r}, {MODEL}, device_mesh {mesh_dims} {mesh}"
        calls: list[Any] = []
        _assert_trains_as(label, api, root, training.ddp_driver(MODEL, dist), dist, calls=calls)
        expected = {Op.ALL_GATHER: shard, Op.REDUCE_SCATTER: shard}
        expected |= {Op.ALL_REDUCE: replicate} if mesh_dims == "2d" else {}
        seen: dict[str, set] = collections.defaultdict(set)
        for call in calls:
            seen[call.op].add(tuple(tdist.get_process_group_ranks(call.group)))
        ranks = {op: {tuple(tdist.get_process_group_ranks(g))} for op, g in expected.items()}
        _expect(label, "collectives outside the mesh's groups", *_per_key(seen, ranks))

    @check(
        "fsdp1.use_orig_params",
        "use_orig_params=True: named_parameters() are the original parameters (the plain "
        "module's names past FSDP's wrapper prefix, their requires_grad; full shapes and values "
        "under summon_full_params); AdamW groups by name with a frozen weight next to trainable "
        "ones in one instance train as DDP",
        features=FAMILY,
        api=(f"{FSDP}(use_orig_params=True)",),
    )
    def test_use_orig_params(self, fsdp_adapter: Any, dist: Any):
        api, model = _built(fsdp_adapter, dist, "loops_frozen_mixed")
        plain = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainable = [(n, p.requires_grad) for n, p in model.named_parameters()]
        root = _wrap(api, model, dist, use_orig_params=True)
        label = f"adapter {fsdp_adapter.name!r}, loops_frozen_mixed, use_orig_params=True"
        named = [(clean_param_name(n), p) for n, p in root.named_parameters()]
        failure = "original parameters not exposed"
        seen = [(n, p.requires_grad) for n, p in named]
        _expect(label, failure, ("named_parameters() (name, requires_grad)", seen, trainable))
        message = f"{label}, under summon_full_params"
        training.check_same_values(message, failure, _full(api, root)[0], plain)
        adamw = {"lr": test_optim.ADAMW_LR, "weight_decay": test_optim.WEIGHT_DECAY}
        reference = training.ddp_driver("loops_frozen_mixed", dist)
        groups = test_optim.reference_groups(reference.zoo_model)
        reference.optimizer = torch.optim.AdamW(groups, **adamw)
        optimizer = torch.optim.AdamW(group_by(named, test_optim.group_options), **adamw)
        _assert_trains_as(label, api, root, reference, dist, optimizer=optimizer)

    @check(
        "fsdp1.module_api",
        "the instance API: .module is the wrapped module; fsdp_modules() lists every instance "
        "of a tree, root_only=True its roots, check_is_root() is True exactly on them; "
        "forward() gives the plain module's output; named_parameters() / named_buffers() give "
        "its names, shapes and values under summon_full_params",
        features=FAMILY,
        api=(
            f"{FSDP}()",
            f"{FSDP}.module",
            f"{FSDP}.forward()",
            f"{FSDP}.check_is_root()",
            f"{FSDP}.fsdp_modules()",
            f"{FSDP}.fsdp_modules(root_only=True)",
            f"{FSDP}.named_parameters()",
            f"{FSDP}.named_buffers()",
        ),
    )
    def test_module_api(self, fsdp_adapter: Any, dist: Any):
        api, model = _built(fsdp_adapter, dist, "loops_buffer")
        plain = zoo.build("loops_buffer", dist.group, None, dist.device).to(dist.device)
        side = nn.Linear(8, 8)  # a second root in the same module tree
        names = _names(model) | {id(side): "side"}
        every = sorted(names[id(m)] for m in [model, *model.blocks, model.head, side])
        root = _wrap(api, model, dist)
        tree = nn.ModuleList([root, _wrap(api, side, dist, auto_wrap_policy=None)])
        inputs = plain.get_input(dist.device)
        output = root(*inputs)
        tree[1](inputs[0])
        label = f"adapter {fsdp_adapter.name!r}, loops_buffer auto-wrapped next to a wrapped Linear"
        listing = api.FullyShardedDataParallel.fsdp_modules

        def wrapped(instances: Any) -> list[str]:
            return sorted(names.get(id(i.module), type(i.module).__name__) for i in instances)

        params, buffers = _full(api, root)
        want = dict(plain.named_parameters()) | dict(plain.named_buffers())
        values, roots, instances = params | buffers, ["<root>", "side"], listing(tree)
        failure = "the instance API differs from the documented one"
        _expect(
            label,
            failure,
            ("root.module is the model", root.module is model, True),
            ("fsdp_modules()", wrapped(instances), every),
            ("fsdp_modules(root_only=True)", wrapped(listing(tree, root_only=True)), roots),
            (
                "check_is_root() is True on",
                wrapped(i for i in instances if i.check_is_root()),
                roots,
            ),
            ("named_parameters() + named_buffers()", list(values), list(want)),
        )
        expected = {"forward()": plain(*inputs), **want}
        training.check_same_values(label, failure, {"forward()": output, **values}, expected)

    @check(
        "fsdp1.apply",
        "apply(fn) runs fn on every module with its full parameters; what fn changes persists, "
        "and training goes on as DDP's from the same change",
        features=FAMILY,
        api=(f"{FSDP}.apply()",),
    )
    def test_apply(self, fsdp_adapter: Any, dist: Any):
        api, model = _built(fsdp_adapter, dist)
        reference = training.ddp_driver(MODEL, dist)
        names = _names(model) | _names(reference.zoo_model)  # by id: the two models' modules
        root = _wrap(api, model, dist)
        shapes: dict[str, dict[str, tuple]] = {}
        for key, module in (("fn saw", root), ("the plain module's", reference.zoo_model)):
            seen = shapes.setdefault(key, {})

            @torch.no_grad()
            def fn(m: nn.Module, seen: dict = seen) -> None:
                if isinstance(m, nn.Linear):
                    seen[names[id(m)]] = tuple(m.weight.shape)
                    m.bias.fill_(0.25)

            module.apply(fn)
        label = f"adapter {fsdp_adapter.name!r}, {MODEL}, apply(fn) setting every Linear's bias"
        expected = ("Linear weight shapes", shapes["fn saw"], shapes["the plain module's"])
        _expect(label, "fn did not see the full parameters", expected)
        _assert_trains_as(label, api, root, reference, dist)


def _ignored_run(
    root: nn.Module, model: nn.Module, ignored: nn.Module, dist: Any, reduce: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(losses, `ignored`'s gradients after the first backward) of ``STEPS`` steps; `reduce`:
    average every other gradient by hand (the plain reference)."""
    own = dict(ignored.named_parameters())
    first: dict[str, torch.Tensor] = {}

    def after_backward(step: int) -> None:
        if step == 0:
            first.update({name: param.grad.clone() for name, param in own.items()})
        if reduce:
            saved = [param.grad for param in own.values()]
            for param in own.values():
                param.grad = None
            training.average_gradients(model, dist.group)
            for param, grad in zip(own.values(), saved, strict=True):
                param.grad = grad

    losses = training.Driver(root, model, dist.device).run(STEPS, after_backward=after_backward)
    return losses, first


class TestFSDP1Constructor(BaseFSDP1ConstructorTests): ...
