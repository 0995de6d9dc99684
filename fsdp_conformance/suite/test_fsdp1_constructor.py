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
import math
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from fsdp_conformance.adapters import Feature, clean_param_name
from fsdp_conformance.adapters.base import group_by
from fsdp_conformance.checks import CheckFailure
from fsdp_conformance.observe.comm_trace import observing_collectives

from . import test_optim, test_parity, test_precision, training, zoo
from .declare import check

STEPS = 2
MODEL = "loops"
FAMILY = (Feature.FSDP1_API,)
FSDP = "FullyShardedDataParallel"
BF16 = torch.bfloat16
REDUCTIONS = ("reduce_scatter", "all_reduce")


def _api(adapter: Any) -> Any:
    return adapter.declarations.api["fsdp1"]


def _fail(label: str, failure: str, detail: str, **figures: Any) -> None:
    raise CheckFailure(f"{label}: {detail}", failure, **figures)


def _wrap(api: Any, module: nn.Module, dist: Any, **kwargs: Any) -> nn.Module:
    """``FullyShardedDataParallel(module, **kwargs)`` on the test's group and device."""
    if "device_mesh" not in kwargs:
        kwargs.setdefault("process_group", dist.group)
    kwargs.setdefault("device_id", dist.device)
    return api.FullyShardedDataParallel(module, **kwargs)


def _selecting(modules: list[nn.Module]) -> Any:
    """A callable auto_wrap_policy ``(module, recurse, nonwrapped_numel)`` wrapping `modules`."""
    chosen = {id(module) for module in modules}
    return lambda module, recurse, nonwrapped_numel: recurse or id(module) in chosen


def _targets(model: nn.Module) -> list[nn.Module]:
    return [*model.blocks, model.head]


def _full(api: Any, root: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parameters, buffers) under ``summon_full_params``, by the names FSDP gives there."""
    with api.FullyShardedDataParallel.summon_full_params(root):
        params = {n: p.detach().clone() for n, p in root.named_parameters()}
        buffers = {n: b.detach().clone() for n, b in root.named_buffers()}
    return params, buffers


def _gap(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The largest |difference| between same-named tensors (inf: a name or shape differs)."""
    if actual.keys() != expected.keys():
        return math.inf
    gaps = [
        (actual[n].detach().float().cpu() - expected[n].detach().float().cpu()).abs().max().item()
        if actual[n].shape == expected[n].shape
        else math.inf
        for n in expected
    ]
    return max(gaps, default=0.0)


def _assert_trains_as(
    label: str,
    api: Any,
    root: nn.Module,
    model: nn.Module,
    reference: training.Driver,
    dist: Any,
    dtype: torch.dtype | None = None,
    calls: list[Any] | None = None,
    optimizer: Any = None,
    **run: Any,
) -> None:
    """``STEPS`` steps of `root` (wrapping `model`; `run`: ``Driver.run``'s hooks; its
    collectives into `calls`) against `reference`: losses and full parameters equal (test_parity's tolerance of the world size;
    with `dtype`, test_precision's of that dtype)."""
    expected_losses = reference.run(STEPS)  # first: only `root`'s collectives are observed
    driver = training.Driver(root, model, dist.device)
    if optimizer is not None:
        driver.optimizer = optimizer
    with observing_collectives((calls if calls is not None else []).append):
        losses = driver.run(STEPS, **run)
    params, expected = _full(api, root)[0], reference.params()
    if list(params) != list(expected):
        _fail(
            label,
            "parameter names differ from the plain module's",
            f"under summon_full_params named_parameters() gives {list(params)}, the plain "
            f"module {list(expected)}",
            offenders=len(set(params) ^ set(expected)),
        )
    eps = test_precision.EPS.get(dtype, 0.0)
    atol, rtol = test_parity.tolerance(dist.world_size)
    atol = max(atol, test_precision.PARAM_ATOL_PER_EPS * eps)
    rtol = max(rtol, test_precision.LOSS_RTOL_PER_EPS * eps)
    loss_gap = ((losses - expected_losses).abs() / expected_losses.abs()).max().item()
    param_gap = _gap(params, expected)
    if loss_gap > rtol or param_gap > atol:
        _fail(
            label,
            "training differs from the reference",
            f"after {STEPS} steps losses {losses.tolist()} vs {expected_losses.tolist()}, max "
            f"|parameter difference| {param_gap:.3g} (atol {atol:g}, losses rtol {rtol:g})",
            loss_gap=loss_gap,
            param_gap=param_gap,
        )


def _recording(modules: list[nn.Module]) -> dict[str, set]:
    """Forward hooks on `modules` recording, by class name, the dtypes each computes with
    (its input's and its weight's, as the forward sees them)."""
    seen: dict[str, set] = collections.defaultdict(set)

    def hook(module: nn.Module, args: tuple, output: Any) -> None:
        seen[type(module).__name__] |= {args[0].dtype, module.weight.dtype}

    for module in modules:
        module.register_forward_hook(hook)
    return seen


def _reductions(calls: list[Any]) -> set[str]:
    return {str(d) for call in calls if call.op in REDUCTIONS for d in call.dtypes}


class BaseFSDP1ConstructorTests:
    """The FSDP1 API family's constructor and config checks (see the module docstring)."""

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
    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("policy", ["callable", "module_wrap", "custom"])
    def test_auto_wrap_policy(self, fsdp_adapter: Any, dist: Any, policy: str):
        api = _api(fsdp_adapter)
        model = zoo.build(MODEL, dist.group, None, dist.device)
        blocks, head = list(model.blocks), model.head
        selected, dtype = _targets(model), None
        linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
        if policy == "callable":
            auto = _selecting(selected)
        elif policy == "module_wrap":
            auto, selected = api.wrap.ModuleWrapPolicy({nn.Linear}), linears
        else:  # block 1 without sharding, the head in bfloat16, the rest as the root
            dtype = BF16
            low = api.MixedPrecision(param_dtype=BF16, cast_forward_inputs=True)
            kwargs = {
                id(blocks[1]): {"sharding_strategy": api.ShardingStrategy.NO_SHARD},
                id(head): {"mixed_precision": low},
            }
            chosen = {id(module) for module in selected}
            auto = api.wrap.CustomPolicy(lambda m: kwargs.get(id(m), id(m) in chosen))
        sizes = {id(b): sum(p.numel() for p in b.parameters()) for b in blocks}
        seen = {id(linear): _recording([linear]) for linear in linears}
        names = {id(m): name or "<root>" for name, m in model.named_modules()}
        root = _wrap(api, model, dist, auto_wrap_policy=auto)
        label = f"adapter {fsdp_adapter.name!r}, {MODEL}, auto_wrap_policy {policy}"
        made = {id(i.module) for i in api.FullyShardedDataParallel.fsdp_modules(root)}
        wanted = {id(module) for module in [model, *selected]}
        if made != wanted:
            _fail(
                label,
                "instances differ from what the policy selects",
                f"instances around {sorted(names[i] for i in made)}, the policy selects "
                f"{sorted(names[i] for i in wanted)}",
                offenders=len(made ^ wanted),
            )
        reference = training.ddp_driver(MODEL, dist)
        _assert_trains_as(label, api, root, model, reference, dist, dtype)
        if policy != "custom":
            return
        # NO_SHARD keeps every element of block 1 on each rank; the others are sharded
        held = {id(b): sum(p.numel() for p in b.parameters()) for b in blocks}
        wrong = [i for i, b in enumerate(blocks) if (held[id(b)] == sizes[id(b)]) != (i == 1)]
        computed = {id(m): set().union(*seen[id(m)].values()) for m in linears}
        low_precision = [i for i, m in enumerate(linears) if computed[id(m)] != {torch.float32}]
        if wrong or low_precision != [len(linears) - 1] or computed[id(head)] != {BF16}:
            _fail(
                label,
                "per-module kwargs not applied",
                f"blocks holding all their elements on this rank: "
                f"{[i for i, b in enumerate(blocks) if held[id(b)] == sizes[id(b)]]} (NO_SHARD: "
                f"[1]); the head computed in {sorted(map(str, computed[id(head)]))} (its "
                "kwargs: bfloat16), Linear layers not in float32: "
                f"{low_precision} (only the head, {len(linears) - 1})",
                offenders=len(wrong) + len(low_precision),
            )

    @check(
        "fsdp1.mixed_precision",
        "MixedPrecision's fields as documented: keep_low_precision_grads leaves bf16 gradients "
        "(reduced in bf16), _module_classes_to_ignore runs those modules in float32, "
        "cast_root_forward_inputs=False leaves the root's inputs uncast while a nested "
        "cast_forward_inputs=True instance casts; each trains within tolerance of fp32 DDP",
        features=FAMILY,
        case="the MixedPrecision field driven",
        case_of=lambda use_orig_params: f"keep_low_precision_grads:{use_orig_params}",
        api=(
            f"{FSDP}(mixed_precision)",
            "MixedPrecision(param_dtype)",
            "MixedPrecision(keep_low_precision_grads=True)",
            "MixedPrecision(_module_classes_to_ignore)",
            "MixedPrecision(cast_forward_inputs=True)",
            "MixedPrecision(cast_root_forward_inputs=False)",
        ),
    )
    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
    def test_keep_low_precision_grads(self, fsdp_adapter: Any, dist: Any, use_orig_params: bool):
        api = _api(fsdp_adapter)
        model = zoo.build(MODEL, dist.group, None, dist.device)
        mixed = api.MixedPrecision(param_dtype=BF16, keep_low_precision_grads=True)
        root = _wrap(
            api,
            model,
            dist,
            auto_wrap_policy=_selecting(_targets(model)),
            mixed_precision=mixed,
            use_orig_params=use_orig_params,
        )
        dtypes: dict[str, set[str]] = {"param": set(), "grad": set()}

        def after_backward(step: int) -> None:
            for param in root.parameters():
                dtypes["param"].add(str(param.dtype))
                if param.grad is not None:
                    dtypes["grad"].add(str(param.grad.dtype))

        label = (
            f"adapter {fsdp_adapter.name!r}, {MODEL}, MixedPrecision(param_dtype=bfloat16, "
            f"keep_low_precision_grads=True), use_orig_params={use_orig_params}"
        )
        calls: list[Any] = []
        reference = training.ddp_driver(MODEL, dist)
        _assert_trains_as(
            label, api, root, model, reference, dist, BF16, calls, after_backward=after_backward
        )
        seen = {**dtypes, "reduction": _reductions(calls)}
        expected = {"param": {"torch.float32"}, "grad": {"torch.bfloat16"}}
        expected["reduction"] = expected["grad"]
        if seen != expected:
            _fail(
                label,
                "gradients not kept in low precision",
                f"after backward: parameters, gradients and reductions in {seen}, expected "
                f"{expected} (reduce_dtype None takes param_dtype)",
                grad=",".join(sorted(seen["grad"])),
            )

    @check("fsdp1.mixed_precision", case_of=lambda policy: f"_module_classes_to_ignore:{policy}")
    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("policy", ["callable", "module_wrap"])
    def test_module_classes_to_ignore(self, fsdp_adapter: Any, dist: Any, policy: str):
        api = _api(fsdp_adapter)
        model = zoo.build("loops_norm", dist.group, None, dist.device)
        norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
        seen = _recording([*norms, *(m for m in model.modules() if isinstance(m, nn.Linear))])
        auto = _selecting(_targets(model))
        if policy == "module_wrap":
            auto = api.wrap.ModuleWrapPolicy({nn.Linear})
        mixed = api.MixedPrecision(param_dtype=BF16, _module_classes_to_ignore=(nn.LayerNorm,))
        root = _wrap(api, model, dist, auto_wrap_policy=auto, mixed_precision=mixed)
        label = (
            f"adapter {fsdp_adapter.name!r}, loops_norm, MixedPrecision(param_dtype=bfloat16, "
            f"_module_classes_to_ignore=(LayerNorm,)), auto_wrap_policy {policy}"
        )
        reference = training.ddp_driver("loops_norm", dist)
        _assert_trains_as(label, api, root, model, reference, dist, BF16)
        expected = {"LayerNorm": {torch.float32}, "Linear": {BF16}}
        if dict(seen) != expected:
            _fail(
                label,
                "ignored module classes not in full precision",
                f"inputs and weights in forward: {dict(seen)}, expected {expected}",
                norm=",".join(sorted(map(str, seen["LayerNorm"]))),
            )

    @check("fsdp1.mixed_precision", case_of=lambda: "cast_forward_inputs")
    @pytest.mark.world_size(2)
    def test_cast_forward_inputs(self, fsdp_adapter: Any, dist: Any):
        api = _api(fsdp_adapter)
        model = zoo.build(MODEL, dist.group, None, dist.device)
        seen: dict[str, torch.dtype] = {}
        model.register_forward_pre_hook(lambda m, args: seen.update(root=args[0].dtype))
        # the model casts its input itself, as a model given float32 inputs must
        model.register_forward_pre_hook(lambda m, args: (args[0].to(m.trunk.weight.dtype),))
        model.head.register_forward_pre_hook(lambda m, args: seen.update(head=args[0].dtype))
        fp16 = api.MixedPrecision(param_dtype=torch.float16, cast_forward_inputs=True)
        model.head = _wrap(api, model.head, dist, mixed_precision=fp16)
        bf16 = api.MixedPrecision(param_dtype=BF16, cast_root_forward_inputs=False)
        root = _wrap(api, model, dist, mixed_precision=bf16)
        label = (
            f"adapter {fsdp_adapter.name!r}, {MODEL}, root MixedPrecision(param_dtype=bfloat16,"
            " cast_root_forward_inputs=False), head MixedPrecision(param_dtype=float16, "
            "cast_forward_inputs=True)"
        )
        reference = training.ddp_driver(MODEL, dist)
        _assert_trains_as(label, api, root, model, reference, dist, BF16)
        expected = {"root": torch.float32, "head": torch.float16}
        if seen != expected:
            _fail(
                label,
                "forward inputs cast against the configuration",
                f"the root's module got {seen.get('root')} (float32 inputs, not to be cast), "
                f"the head {seen.get('head')} (to be cast to its float16)",
                root=str(seen.get("root")),
                head=str(seen.get("head")),
            )

    @check(
        "fsdp1.param_init_fn",
        "param_init_fn materialises a meta-device model under auto-wrapping: called once per "
        "module, the values of the model built on the device, then trains as DDP",
        features=FAMILY,
        api=(f"{FSDP}(param_init_fn)",),
    )
    @pytest.mark.world_size(2)
    def test_param_init_fn(self, fsdp_adapter: Any, dist: Any):
        api = _api(fsdp_adapter)
        model = zoo.build("buffered_meta", dist.group, None, dist.device)
        names = {id(module): name or "<root>" for name, module in model.named_modules()}
        owners = {names[id(m)] for m in model.modules() if _own_tensors(m)}
        calls: collections.Counter[str] = collections.Counter()

        def init(module: nn.Module) -> None:  # the documented recipe: this module only
            calls[names.get(id(module), type(module).__name__)] += 1
            module.to_empty(device=dist.device, recurse=False)
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()

        policy = _selecting(_targets(model))
        root = _wrap(api, model, dist, param_init_fn=init, auto_wrap_policy=policy)
        label = f"adapter {fsdp_adapter.name!r}, buffered_meta, param_init_fn, auto-wrapped"
        wrong = {name: calls[name] for name in owners | set(calls) if calls[name] != 1}
        if wrong:
            _fail(
                label,
                "param_init_fn not called once per module",
                f"calls per module {dict(calls)}; each module holding meta tensors must be "
                f"initialised exactly once (wrong: {wrong})",
                offenders=len(wrong),
            )
        plain = zoo.build("buffered", dist.group, None, dist.device).to(dist.device)
        params, buffers = _full(api, root)
        expected = dict(plain.named_parameters()) | dict(plain.named_buffers())
        got = params | buffers
        if sorted(got) != sorted(expected) or _gap(got, expected) > 0:
            _fail(
                label,
                "materialised values differ from the reference",
                f"after wrapping: {sorted(got)} vs the model built on {dist.device} "
                f"{sorted(expected)}",
                gap=_gap(got, expected) if sorted(got) == sorted(expected) else math.inf,
            )
        reference = training.ddp_driver("buffered", dist)
        _assert_trains_as(label, api, root, model, reference, dist)

    @check(
        "fsdp1.ignored",
        "ignored_modules / ignored_states=[module]: the module is not wrapped though the policy "
        "selects it, its parameters stay whole and unreduced, the rest trains as DDP",
        features=FAMILY,
        case="the argument: 'ignored_modules' or 'ignored_states'",
        case_of="argument",
        api=(f"{FSDP}(ignored_modules)", f"{FSDP}(ignored_states=Iterable[Module])"),
    )
    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("argument", ["ignored_modules", "ignored_states"])
    def test_ignored_modules(self, fsdp_adapter: Any, dist: Any, argument: str):
        api = _api(fsdp_adapter)
        models = [zoo.build(MODEL, dist.group, None, dist.device) for _ in range(2)]
        model, plain = models
        policy, block = _selecting(_targets(model)), model.blocks[1]  # selected, but ignored
        ignored = dict(block.named_parameters())
        root = _wrap(api, model, dist, auto_wrap_policy=policy, **{argument: [block]})
        label = f"adapter {fsdp_adapter.name!r}, {MODEL}, {argument}=[blocks[1]], auto-wrapped"
        mine = {id(param) for param in ignored.values()}
        registered = [n for n, p in root.named_parameters() if id(p) in mine]
        instances = api.FullyShardedDataParallel.fsdp_modules(root)
        wrapped = [i for i in instances if i.module is block]
        if wrapped or len(registered) != len(ignored):
            _fail(
                label,
                "ignored module managed by FSDP",
                f"instances around it: {len(wrapped)}; its parameters registered as themselves "
                f"(whole): {registered}, expected all of {sorted(ignored)}",
                offenders=len(wrapped) + len(ignored) - len(registered),
            )
        losses, grads = _ignored_run(root, model, block, dist, reduce=False)
        plain.to(dist.device)
        ref_losses, ref_grads = _ignored_run(plain, plain, plain.blocks[1], dist, reduce=True)
        params, ref_params = _full(api, root)[0], dict(plain.named_parameters())
        gaps = {
            "grad_gap": _gap(grads, ref_grads),
            "loss_gap": (losses - ref_losses).abs().max().item(),
            "param_gap": _gap(params, ref_params),
        }
        if any(gaps.values()):
            _fail(
                label,
                "training differs from the reference",
                f"against the plain model with every gradient but the ignored module's averaged "
                f"(bit-exact): {gaps} (grad_gap: the ignored gradients after the first backward)",
                **gaps,
            )

    @check(
        "fsdp1.device_id",
        "device_id as a torch.device puts every instance's parameters and buffers there and "
        "trains as DDP; an int names an accelerator (refused on a host without one)",
        features=FAMILY,
        case="the form: 'device' or 'int'",
        case_of="form",
        api=(f"{FSDP}(device_id=device)", f"{FSDP}(device_id=int)"),
    )
    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("form", ["device", "int"])
    def test_device_id(self, fsdp_adapter: Any, dist: Any, form: str):
        api = _api(fsdp_adapter)
        model = zoo.build("loops_buffer", dist.group, None, torch.device("cpu"))
        device = dist.device
        label = f"adapter {fsdp_adapter.name!r}, loops_buffer built on cpu, device_id {form}"
        if form == "int" and device.type == "cpu":
            try:
                _wrap(api, model, dist, device_id=0)
            except (RuntimeError, ValueError) as error:
                if not any(word in str(error).lower() for word in ("accelerator", "cuda")):
                    _fail(label, "unclear error", f"refused with {error!r}, naming no device")
                return
            _fail(
                label,
                "an accelerator index accepted without an accelerator",
                "device_id=0 (an accelerator's index) was accepted on a host without one",
            )
        root = _wrap(api, model, dist, device_id=device.index if form == "int" else device)
        elsewhere = sorted(
            name
            for name, tensor in [*root.named_parameters(), *root.named_buffers()]
            if tensor.device != device
        )
        if elsewhere:
            _fail(
                label,
                "tensors not on device_id",
                f"not on {device}: {elsewhere}",
                offenders=len(elsewhere),
            )
        reference = training.ddp_driver("loops_buffer", dist)
        _assert_trains_as(label, api, root, model, reference, dist)

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
        from torch.distributed.device_mesh import init_device_mesh

        api = _api(fsdp_adapter)
        model = zoo.build(MODEL, dist.group, None, dist.device)
        kwargs: dict[str, Any] = {"auto_wrap_policy": _selecting(_targets(model))}
        if mesh_dims == "1d":
            mesh = init_device_mesh(dist.device.type, (dist.world_size,))
            groups = {"all_gather": mesh.get_group(), "reduce_scatter": mesh.get_group()}
        else:
            shape, dims = (2, dist.world_size // 2), ("replicate", "shard")
            mesh = init_device_mesh(dist.device.type, shape, mesh_dim_names=dims)
            kwargs["sharding_strategy"] = api.ShardingStrategy.HYBRID_SHARD
            groups = {
                "all_gather": mesh.get_group("shard"),
                "reduce_scatter": mesh.get_group("shard"),
                "all_reduce": mesh.get_group("replicate"),
            }
        root = _wrap(api, model, dist, device_mesh=mesh, **kwargs)
        label = f"adapter {fsdp_adapter.name!r}, {MODEL}, device_mesh {mesh_dims} {mesh}"
        calls: list[Any] = []
        reference = training.ddp_driver(MODEL, dist)
        _assert_trains_as(label, api, root, model, reference, dist, calls=calls)
        ranks = {op: tdist.get_process_group_ranks(g) for op, g in groups.items()}
        seen = {(c.op, tuple(tdist.get_process_group_ranks(c.group))) for c in calls}
        wrong = sorted(f"{op} over {list(r)}" for op, r in seen if list(r) != ranks.get(op))
        missing = sorted(op for op in ranks if op not in {op for op, _ in seen})
        if wrong or missing:
            _fail(
                label,
                "collectives outside the mesh's groups",
                f"{wrong}, none of {missing}; expected each op over {ranks}",
                offenders=len(wrong) + len(missing),
            )

    @check(
        "fsdp1.use_orig_params",
        "use_orig_params=True: named_parameters() are the original parameters (the plain "
        "module's names past FSDP's wrapper prefix, their requires_grad; full shapes and values "
        "under summon_full_params); AdamW groups by name with a frozen weight next to trainable "
        "ones in one instance train as DDP",
        features=FAMILY,
        api=(f"{FSDP}(use_orig_params=True)",),
    )
    @pytest.mark.world_size(2)
    def test_use_orig_params(self, fsdp_adapter: Any, dist: Any):
        api, name = _api(fsdp_adapter), "loops_frozen_mixed"
        model = zoo.build(name, dist.group, None, dist.device)
        plain = {n: (p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()}
        policy = _selecting(_targets(model))
        root = _wrap(api, model, dist, auto_wrap_policy=policy, use_orig_params=True)
        label = f"adapter {fsdp_adapter.name!r}, {name}, use_orig_params=True, auto-wrapped"
        named = [(clean_param_name(n), p) for n, p in root.named_parameters()]
        listed = [(n, p.requires_grad) for n, p in named]
        full = _full(api, root)[0]
        gap = _gap(full, {n: value for n, (value, _) in plain.items()})
        if listed != [(n, trains) for n, (_, trains) in plain.items()] or gap > 0:
            _fail(
                label,
                "original parameters not exposed",
                f"named_parameters() gives {listed} (under summon_full_params: max |difference| "
                f"{gap:.3g} from the plain module's values), the plain module "
                f"{[(n, trains) for n, (_, trains) in plain.items()]}",
                offenders=len(set(listed) ^ {(n, t) for n, (_, t) in plain.items()}),
            )
        adamw = {"lr": test_optim.ADAMW_LR, "weight_decay": test_optim.WEIGHT_DECAY}
        groups = group_by(named, test_optim.group_options)
        reference = training.ddp_driver(name, dist)
        reference.optimizer = torch.optim.AdamW(
            test_optim.reference_groups(reference.zoo_model), **adamw
        )
        optimizer = torch.optim.AdamW(groups, **adamw)
        _assert_trains_as(label, api, root, model, reference, dist, optimizer=optimizer)

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
    @pytest.mark.world_size(2)
    def test_module_api(self, fsdp_adapter: Any, dist: Any):
        api, name = _api(fsdp_adapter), "loops_buffer"
        model, plain = (zoo.build(name, dist.group, None, dist.device) for _ in range(2))
        plain.to(dist.device)
        side = nn.Linear(8, 8)  # a second root in the same module tree
        labels = {id(m): n or "<root>" for n, m in model.named_modules()} | {id(side): "side"}
        everything = sorted(labels[id(m)] for m in [model, *_targets(model), side])
        root = _wrap(api, model, dist, auto_wrap_policy=_selecting(_targets(model)))
        tree = nn.ModuleList([root, _wrap(api, side, dist)])
        inputs = plain.get_input(dist.device)
        output = root(*inputs)
        tree[1](inputs[0])
        label = f"adapter {fsdp_adapter.name!r}, {name} auto-wrapped next to a wrapped Linear"
        listing = api.FullyShardedDataParallel.fsdp_modules

        def wrapped(instances: Any) -> list[str]:
            return sorted(labels.get(id(i.module), type(i.module).__name__) for i in instances)

        seen = {
            "fsdp_modules()": wrapped(listing(tree)),
            "fsdp_modules(root_only=True)": wrapped(listing(tree, root_only=True)),
            "check_is_root() True": wrapped(i for i in listing(tree) if i.check_is_root()),
            "root.module is the model": root.module is model,
        }
        expected = {
            "fsdp_modules()": everything,
            "fsdp_modules(root_only=True)": ["<root>", "side"],
            "check_is_root() True": ["<root>", "side"],
            "root.module is the model": True,
        }
        wrong = {key: seen[key] for key in seen if seen[key] != expected[key]}
        if wrong:
            _fail(
                label,
                "instances differ from the documented ones",
                f"{wrong}; expected {expected}",
                offenders=len(wrong),
            )
        if not torch.equal(output, plain(*inputs)):
            _fail(
                label,
                "forward differs from the plain module's",
                "the root's output is not the plain module's (bit-exact)",
                gap=(output - plain(*inputs)).abs().max().item(),
            )
        params, buffers = _full(api, root)
        values = params | buffers
        expected_values = dict(plain.named_parameters()) | dict(plain.named_buffers())
        if list(values) != list(expected_values) or _gap(values, expected_values) > 0:
            _fail(
                label,
                "named tensors differ from the plain module's",
                f"under summon_full_params: {list(values)} vs the plain module's "
                f"{list(expected_values)} (names, then shapes and values)",
                offenders=len(set(values) ^ set(expected_values)),
            )

    @check(
        "fsdp1.apply",
        "apply(fn) runs fn on every module with its full parameters; what fn changes persists, "
        "and training goes on as DDP's from the same change",
        features=FAMILY,
        api=(f"{FSDP}.apply()",),
    )
    @pytest.mark.world_size(2)
    def test_apply(self, fsdp_adapter: Any, dist: Any):
        api = _api(fsdp_adapter)
        model = zoo.build(MODEL, dist.group, None, dist.device)
        reference = training.ddp_driver(MODEL, dist)
        shapes: dict[str, dict[str, tuple]] = {"fsdp": {}, "plain": {}}
        for key, module in (("fsdp", model), ("plain", reference.zoo_model)):
            names = {id(m): n for n, m in module.named_modules()}

            @torch.no_grad()
            def fn(m: nn.Module, names: dict = names, seen: dict = shapes[key]) -> None:
                if isinstance(m, nn.Linear):
                    seen[names[id(m)]] = tuple(m.weight.shape)
                    m.bias.fill_(0.25)

            if key == "fsdp":
                root = _wrap(api, model, dist, auto_wrap_policy=_selecting(_targets(model)))
                root.apply(fn)
            else:
                module.apply(fn)
        label = f"adapter {fsdp_adapter.name!r}, {MODEL}, apply(fn) setting every Linear's bias"
        if shapes["fsdp"] != shapes["plain"]:
            _fail(
                label,
                "fn did not see the full parameters",
                f"Linear weights seen by fn {shapes['fsdp']}, the plain module's {shapes['plain']}",
                offenders=len(set(shapes["fsdp"].items()) ^ set(shapes["plain"].items())),
            )
        _assert_trains_as(label, api, root, model, reference, dist)


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


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
