"""torch FSDP1's methods through the API an adapter declares (the ``fsdp1`` family:
``Declarations(api={"fsdp1": namespace})``, feature ``fsdp1_api``; docs/suite.md, "FSDP1
methods"), each promise against a reference:

- ``fsdp1.state_dict_types``: each ``StateDictType`` with its two configs, set by
  ``state_dict_type`` (restored on exit) and ``set_state_dict_type`` (returns the previous
  settings), reported by ``get_state_dict_type``. The model's state dict holds DDP's values (FULL:
  every tensor; SHARDED: this rank's ShardedTensor / DTensor shard at its offsets; LOCAL: this
  rank's pieces, all ranks' together DDP's values), ``optim_state_dict`` DDP's Adam state by
  parameter name the same way; ``rank0_only``: empty on other ranks; ``offload_to_cpu``: on the
  CPU, else on the parameters' device. Loaded (``optim_state_dict_to_load``, also
  ``is_named_optimizer`` and ``load_directly``) after training on, the next step is DDP's.
- ``fsdp1.optim_state_dicts``: the other optimizer-state routes, each resuming a fresh Adam exactly
  as DDP continues: ``full_optim_state_dict`` -> ``shard_full_optim_state_dict``,
  ``scatter_full_optim_state_dict``, ``sharded_optim_state_dict`` ->
  ``flatten_sharded_optim_state_dict``, ``rekey_optim_state_dict`` to and from the unwrapped
  model's optimizer (ids as its own ``state_dict()``); every ``optim_input`` form and ``optim``
  give the same result.
- ``fsdp1.summon_options``: ``summon_full_params`` with ``with_grads`` (DDP's full gradients;
  ``clip_grad_norm_(inf)`` then DDP's norm), ``rank0_only``, ``offload_to_cpu``, ``recurse=False``.
- ``fsdp1.comm_hook``: ``register_comm_hook(state, hook)``: our hook (reduce, then halve) is
  called with our state in every backward and FSDP applies its result: training equals DDP on the
  halved loss, bit for bit.

The model is the zoo's ``uneven`` (odd sizes: padded flat parameters, a parameter that rank 1
holds only padding of), wrapped by the namespace's ``FullyShardedDataParallel``; Adam runs in two
parameter groups. Checks of the
optimizer state wrap it on a group G of the test's ranks that is not the default group and pass
``group=G``: every collective the calls issue must run on G (a ``group`` dropped runs on the
default group).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import types
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as tdist

from fsdp_conformance import collective_observer
from fsdp_conformance.adapters import Feature
from fsdp_conformance.adapters.base import group_by
from fsdp_conformance.checks import CheckFailure
from fsdp_conformance.observe.comm_trace import ROOT_LABEL, instance_labels, observing_collectives

from . import training, zoo
from .declare import calls, check
from .training import check_gap, check_same_keys, check_same_values

MODEL = "uneven"
NESTED = ("odd.", "pair.", "one.")  # the wrapped submodules of MODEL (name prefixes)
FEATURES = (Feature.FSDP1_API,)
# StateDictType name -> its (state dict config, optimizer state dict config) classes
CONFIGS = {
    "FULL_STATE_DICT": ("FullStateDictConfig", "FullOptimStateDictConfig"),
    "SHARDED_STATE_DICT": ("ShardedStateDictConfig", "ShardedOptimStateDictConfig"),
    "LOCAL_STATE_DICT": ("LocalStateDictConfig", "LocalOptimStateDictConfig"),
}
# form -> (StateDictType name, state dict config fields, optimizer state dict config fields)
STATE_DICT_FORMS = {
    "full": ("FULL_STATE_DICT", {}, {"offload_to_cpu": False}),
    "full_rank0": ("FULL_STATE_DICT", {"rank0_only": True}, {"rank0_only": True}),
    "sharded": ("SHARDED_STATE_DICT", {"offload_to_cpu": True}, {"offload_to_cpu": False}),
    "sharded_dtensor": ("SHARDED_STATE_DICT", {"_use_dtensor": True}, {"_use_dtensor": True}),
    "local": ("LOCAL_STATE_DICT", {"offload_to_cpu": True}, {"offload_to_cpu": True}),
}
OPTIM_ROUTES = ("full", "scatter", "sharded", "rekey")
SUMMON_FORMS = ("with_grads", "rank0_only", "offload_to_cpu", "recurse_false")
HOOK_STRATEGIES = ("FULL_SHARD", "NO_SHARD")
_OPTIMIZER_DIFFERS = "optimizer state dict differs from the reference"


def _method(name: str, *forms: str) -> tuple[str, ...]:
    """The API items of FullyShardedDataParallel.`name` called, and with each of `forms`."""
    return calls(f"FullyShardedDataParallel.{name}", *forms)


def _config_items() -> tuple[str, ...]:
    """The config fields STATE_DICT_FORMS sets, as API items."""
    items = []
    for kind, *fields in STATE_DICT_FORMS.values():
        for config, values in zip(CONFIGS[kind], fields):
            items += [f"{config}({name}={value})" for name, value in values.items()]
    return tuple(items)


_CONFIGS = ("state_dict_config", "optim_state_dict_config")
_OPTIM_INPUT = ("optim_input=list[dict[str, Any]]", "optim_input=Iterable[Parameter]")
STATE_DICT_ITEMS = (
    *_method("set_state_dict_type", *_CONFIGS),
    *_method("state_dict_type", *_CONFIGS),
    *_method("get_state_dict_type"),
    *(f"StateDictType.{kind}" for kind in CONFIGS),
    *_config_items(),
    *_method("optim_state_dict", "optim_state_dict", "group"),
    *_method("optim_state_dict_to_load", "is_named_optimizer=True", "load_directly=True", "group"),
)
OPTIM_ITEMS = (
    *_method("full_optim_state_dict", *_OPTIM_INPUT, "rank0_only=False", "group"),
    *_method("shard_full_optim_state_dict", *_OPTIM_INPUT, "optim"),
    *_method("scatter_full_optim_state_dict", *_OPTIM_INPUT, "optim", "group"),
    *_method("sharded_optim_state_dict", "group"),
    *_method("flatten_sharded_optim_state_dict"),
    *_method("rekey_optim_state_dict", *_OPTIM_INPUT, "optim"),
    "OptimStateKeyType.PARAM_NAME",
    "OptimStateKeyType.PARAM_ID",
)
SUMMON_ITEMS = (
    *(
        f"FullyShardedDataParallel.summon_full_params({form})"
        for form in ("with_grads=True", "rank0_only=True", "offload_to_cpu=True", "recurse=False")
    ),
    "FullyShardedDataParallel.clip_grad_norm_(norm_type)",
    "FullyShardedDataParallel.no_sync()",
)


@dataclasses.dataclass(frozen=True)
class MethodCase:
    """The case an ``fsdp1.*`` cell hands to ``Deviation.applies``."""

    form: str  # a key of STATE_DICT_FORMS, an OPTIM_ROUTES, SUMMON_FORMS or HOOK_STRATEGIES entry
    use_orig_params: bool

    @property
    def id(self) -> str:
        return f"{self.form}-{'orig' if self.use_orig_params else 'flat'}_params"


def _cases(forms: Any, default_orig: set[str], coverage: str | None) -> list[MethodCase]:
    """Each form once (use_orig_params for those in `default_orig`); both with coverage full
    (with_grads: use_orig_params only, as documented)."""
    if coverage != "full":
        return [MethodCase(form, form in default_orig) for form in forms]
    both = [MethodCase(form, orig) for form in forms for orig in (False, True)]
    return [case for case in both if case.use_orig_params or case.form != "with_grads"]


def _api(adapter: Any) -> Any:
    return adapter.declarations.api["fsdp1"]


def _driver(
    adapter: Any, dist: Any, case: MethodCase, group: Any = None, **options: Any
) -> training.Driver:
    """``MODEL`` with each wrapped submodule and the root an instance of the namespace's
    FullyShardedDataParallel (on `group`, default the test's; `options`: its other keywords and
    ``optimizer_name``), driven through `adapter`."""
    fsdp = _api(adapter).FullyShardedDataParallel
    adam = options.pop("optimizer_name", "sgd") == "adam"
    options = {"device_id": dist.device, "use_orig_params": case.use_orig_params, **options}
    if "device_mesh" not in options:
        options["process_group"] = dist.group if group is None else group
    zoo_model = zoo.build(MODEL, dist.group, lambda module: fsdp(module, **options), dist.device)
    root = fsdp(zoo_model, **options)
    driver = training.Driver(root, zoo_model, dist.device, adapter)
    if adam:
        driver.optimizer = _adam(adapter, root)
    return driver


def _adam(adapter: Any, model: Any) -> torch.optim.Optimizer:
    """Adam in two parameter groups, the nested instances' parameters at half the learning rate
    (by the unwrapped model's names; `adapter` None: torch's over the unwrapped `model`)."""
    groups = lambda name, param: {"lr": training.ADAM_LR / 2} if name.startswith(NESTED) else {}
    if adapter is None:
        return torch.optim.Adam(group_by(model.named_parameters(), groups), lr=training.ADAM_LR)
    return adapter.optimizer(model, "adam", param_groups=groups, lr=training.ADAM_LR)


def _reference(dist: Any) -> training.Driver:
    """The DDP reference with ``_adam``."""
    reference = training.ddp_driver(MODEL, dist)
    reference.optimizer = _adam(None, reference.zoo_model)
    return reference


def _other_group(dist: Any) -> Any:
    """A new group of the test's ranks: not the default group."""
    return tdist.new_group(tdist.get_process_group_ranks(dist.group))


@contextlib.contextmanager
def _only_on(group: Any, label: str) -> Iterator[None]:
    """Fail when a collective issued inside runs on another group than `group`."""
    foreign: list[str] = []
    name = group.group_name

    def listener(call: collective_observer.CollectiveCall) -> None:
        if call.group is None or call.group.group_name != name:
            foreign.append(f"{call.name} on {getattr(call.group, 'group_name', None)}")

    with observing_collectives(listener, ops=None):
        yield
    if foreign:
        message = f"{label}: collectives ran outside the model's group {name!r} passed as group="
        failure = "collectives outside the given group"
        raise CheckFailure(f"{message}: {sorted(set(foreign))}", failure, count=len(foreign))


class _Failures:
    """A cell's failures, kept until its collectives are done (a rank failing early would leave
    the other waiting in one), then the first raised."""

    def __init__(self) -> None:
        self.seen: list[CheckFailure] = []

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        try:
            yield
        except CheckFailure as failure:
            self.seen.append(failure)

    def raise_first(self, group: Any) -> None:
        """Raise the first failure of the lowest failing rank, on every rank (one verdict)."""
        first = self.seen[0] if self.seen else None
        mine = None if first is None else (str(first), first.failure, first.figures)
        every: list[Any] = [None] * group.size()
        tdist.all_gather_object(every, mine, group)
        failed = [(rank, seen) for rank, seen in enumerate(every) if seen is not None]
        if failed:
            rank, (message, failure, figures) = failed[0]
            raise CheckFailure(f"{message} [rank {rank}]", failure, **figures)


def _assert_training(label: str, driver: training.Driver, losses: Any, reference: Any) -> None:
    """`losses` and the full parameters equal the reference's (`reference`: (losses, params))."""
    failure = "training differs from the reference"
    check_same_values(label + ", losses", failure, {"losses": losses}, {"losses": reference[0]})
    check_same_values(label + ", full parameters", failure, driver.params(), reference[1])


def _flat(state: dict, prefix: str = "") -> dict[str, Any]:
    """A nested (optimizer) state dict's leaves by dotted path (``state.<name>.exp_avg``);
    numbers as tensors, a param group's parameter list sorted (its order is not promised)."""
    flat = {}
    for key, value in state.items():
        if key == "params" and isinstance(value, list):
            value = sorted(value, key=str)
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        elif isinstance(value, (list, tuple)):
            flat.update(_flat(dict(enumerate(value)), f"{prefix}{key}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[f"{prefix}{key}"] = torch.tensor(float(value))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _assert_equal_dicts(label: str, failure: str, actual: dict, expected: dict) -> None:
    """Two (optimizer) state dicts equal leaf by leaf (tensors bit for bit, this rank's values
    of a ShardedTensor / DTensor)."""
    got, want = _flat(actual), _flat(expected)
    others = {key for key, value in want.items() if not isinstance(value, torch.Tensor)}
    unequal = sorted(key for key in others if key not in got or got[key] != want[key])
    if unequal:
        raise CheckFailure(f"{label}: {unequal[:4]} differ", failure, count=len(unequal))
    local = lambda flat: {
        key: torch.cat([t.reshape(-1) for _, t, _ in _pieces(value)] or [torch.zeros(0)])
        for key, value in flat.items()
        if key not in others
    }
    check_same_values(label, failure, local(got), local(want))


def _reference_adam(reference: training.Driver) -> dict[str, torch.Tensor]:
    """The DDP reference's Adam state by ``<parameter name>.<field>`` (copies)."""
    name_of = {id(param): name for name, param in reference.zoo_model.named_parameters()}
    groups = reference.optimizer.param_groups
    names = [name_of[id(param)] for group in groups for param in group["params"]]
    state = reference.optimizer.state_dict()["state"]
    by_name = {names[i]: {k: v.clone() for k, v in entry.items()} for i, entry in state.items()}
    return _flat(by_name)


Piece = tuple[list[int], torch.Tensor, str]  # offsets in the full tensor, values, device type


def _pieces(value: torch.Tensor) -> list[Piece]:
    """This rank's pieces of a ShardedTensor, of a DTensor sharded on a 1-D mesh (``Shard(d)``
    holds chunk ``rank`` of ``torch.chunk`` along d) or of a plain tensor (all of it)."""
    if hasattr(value, "local_shards"):
        local = [(list(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
    elif hasattr(value, "to_local"):
        offsets, dim = [0] * value.dim(), value.placements[0].dim
        chunk = -(-value.shape[dim] // value.device_mesh.size())
        offsets[dim] = min(value.device_mesh.get_local_rank() * chunk, value.shape[dim])
        local = [(offsets, value.to_local())]
    else:
        local = [([0] * value.dim(), value)]
    return [(offsets, t.detach().cpu(), t.device.type) for offsets, t in local]


def _gathered(state: dict, group: Any) -> list[dict[str, list[Piece]]]:
    """Every rank's tensors of `state` (by dotted path) as pieces, so that every rank checks
    the same data: the verdict is the same on all."""
    flat = _flat(state)
    mine = {key: _pieces(v) for key, v in flat.items() if isinstance(v, torch.Tensor)}
    every: list[Any] = [None] * group.size()
    tdist.all_gather_object(every, mine, group)
    return every


def _assert_state(
    label: str, part: str, ranks: list[dict], expected: dict, layout: str, device: str
) -> None:
    """The `part` ("model" or "optimizer") state dict as every rank's pieces (``_gathered``)
    holds `expected`'s values in `layout`: "full" (each rank all of each tensor), "sharded"
    (each key's pieces equal the full tensor at their offsets and add up to it; 0-dim values,
    Adam's step, in full on each rank) or "local" (all ranks' values together are `expected`'s
    as a multiset: the flat layout is the implementation's). Pieces with dimensions on
    `device`."""
    failure = f"{part} state dict differs from the reference"
    wrong = [
        f"rank {rank}: {key} on {where}"
        for rank, state in enumerate(ranks)
        for key, pieces in state.items()
        for _, values, where in pieces
        if values.dim() > 0 and where != device
    ]
    if wrong:
        message = f"{label}: every tensor belongs on {device}: {wrong[:4]}"
        raise CheckFailure(message, "tensors on the wrong device", count=len(wrong))
    if layout == "local":
        held = [v.reshape(-1).double() for s in ranks for p in s.values() for _, v, _ in p]
        full = [v.reshape(-1).cpu().double() for v in expected.values()]
        values = {"values": torch.sort(torch.cat(held or [torch.zeros(0)])).values}
        check_same_values(label, failure, values, {"values": torch.sort(torch.cat(full)).values})
        return
    for rank, state in enumerate(ranks):
        check_same_keys(f"{label} (rank {rank})", failure, state, expected)
        for key, full in expected.items():
            for offsets, values, _ in state[key]:
                region = tuple(slice(o, o + n) for o, n in zip(offsets, values.shape))
                message = f"{label} (rank {rank}): {key!r} at offsets {offsets} differs from "
                check_gap(message + "the reference", failure, values, full.cpu()[region])
    for key, full in expected.items():
        copies = len(ranks) if layout == "full" or full.dim() == 0 else 1
        held = sum(values.numel() for state in ranks for _, values, _ in state[key])
        gap = abs(held - copies * full.numel())
        if gap:
            message = (
                f"{label}: the ranks hold {held} elements of {key!r}, not {copies} x {full.numel()}"
            )
            raise CheckFailure(message, failure, element_gap=gap)


class BaseFSDP1MethodTests:
    """The ``fsdp1`` family's method checks: see this module's docstring."""

    pytestmark = pytest.mark.world_size(2)  # each cell's, where it names none

    STEPS: ClassVar[int] = 2

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        coverage = metafunc.config.getoption("fsdp_coverage", None)
        # the default: each form once (the full optimizer state of torch FSDP1 with
        # use_orig_params is wrong on a CPU host: the full route's and full_rank0's deviation)
        cases = {
            "state_dict_case": _cases(STATE_DICT_FORMS, {"full", "sharded"}, coverage),
            "optim_case": _cases(OPTIM_ROUTES, {"scatter", "sharded", "rekey"}, coverage),
            "summon_case": _cases(SUMMON_FORMS, {"with_grads", "offload_to_cpu"}, coverage),
            "hook_case": _cases(HOOK_STRATEGIES, {"NO_SHARD"}, coverage),
        }
        for name, values in cases.items():
            if name in metafunc.fixturenames:
                metafunc.parametrize(name, [pytest.param(v, id=v.id) for v in values])

    @check(
        "fsdp1.state_dict_types",
        "each StateDictType with its configs is set, reported and restored; the model and Adam "
        "state dicts hold DDP's values in that form (shards at their offsets, rank0_only, "
        "offload_to_cpu, group=) and load back to continue exactly as DDP",
        features=FEATURES,
        case="suite.test_fsdp1_methods.MethodCase",
        case_of="state_dict_case",
        api=STATE_DICT_ITEMS,
    )
    def test_state_dict_types(self, fsdp_adapter: Any, dist: Any, state_dict_case: MethodCase):
        case, api, failures = state_dict_case, _api(fsdp_adapter), _Failures()
        fsdp = api.FullyShardedDataParallel
        kind, *fields = STATE_DICT_FORMS[case.form]
        configs = [getattr(api, name)(**values) for name, values in zip(CONFIGS[kind], fields)]
        settings = (api.StateDictType[kind], *configs)
        group = _other_group(dist)
        options: dict[str, Any] = {"optimizer_name": "adam"}
        if fields[0].get("_use_dtensor"):
            from torch.distributed.device_mesh import DeviceMesh

            options["device_mesh"] = DeviceMesh.from_group(group, dist.device.type)
        driver = _driver(fsdp_adapter, dist, case, group, **options)
        root, optimizer = driver.model, driver.optimizer
        label = f"adapter {fsdp_adapter.name!r}, {MODEL}, {case.id}"
        reference = _reference(dist)
        first = (driver.run(1), reference.run(1))
        expected = {"model": reference.params(), "optimizer": _reference_adam(reference)}
        default = _triple(fsdp.get_state_dict_type(root))
        with failures.kept(), _only_on(group, label), fsdp.state_dict_type(root, *settings):
            seen = _triple(fsdp.get_state_dict_type(root))
            state = {"model": root.state_dict()}
            state["optimizer"] = fsdp.optim_state_dict(root, optimizer, group=group)
            given = optimizer.state_dict()
            from_given = fsdp.optim_state_dict(root, optimizer, optim_state_dict=given, group=group)
        with failures.kept():
            _assert_settings(f"{label}, inside state_dict_type", seen, settings)
            _assert_settings(f"{label}, after it", _triple(fsdp.get_state_dict_type(root)), default)
            message = f"{label}, optim_state_dict(optim_state_dict=optim.state_dict())"
            _assert_equal_dicts(message, _OPTIMIZER_DIFFERS, from_given, state["optimizer"])
        saved = copy.deepcopy(state)  # LOCAL_STATE_DICT's values are views of the shards
        layout = kind.split("_")[0].lower()
        optimizer_layout = "full" if layout == "full" else "sharded"  # LOCAL: sharded originals
        parts = {"model": (state["model"], layout)}
        parts["optimizer"] = (state["optimizer"].get("state", {}), optimizer_layout)
        for (part, (values, part_layout)), config in zip(parts.items(), configs):
            ranks, message = _gathered(values, group), f"{label}, the {part} state dict"
            device = "cpu" if config.offload_to_cpu else dist.device.type
            with failures.kept():
                if case.form == "full_rank0":
                    _assert_empty(message, sum(len(held) for held in ranks[1:]))
                    ranks = ranks[:1]
                _assert_state(message, part, ranks, expected[part], part_layout, device)
        driver.run(1, start=1)  # train on, then load what was saved
        if case.form == "full_rank0":  # the full state dict exists on rank 0 only: send it
            sent = [saved["model"]]
            tdist.broadcast_object_list(sent, group_src=0, group=dist.group)
            saved["model"] = sent[0]
        with failures.kept(), _only_on(group, label):
            previous = _triple(fsdp.set_state_dict_type(root, *settings))
            root.load_state_dict(saved["model"])
            load = fsdp.optim_state_dict_to_load
            named = load(root, optimizer, saved["optimizer"], is_named_optimizer=True, group=group)
            loaded = load(root, optimizer, saved["optimizer"], load_directly=True, group=group)
            fsdp.set_state_dict_type(root, *previous)
        with failures.kept():
            _assert_settings(f"{label}, set_state_dict_type's return", previous, default)
            failure = "optimizer state to load is inconsistent"
            _assert_named(f"{label}, is_named_optimizer=True", failure, named, loaded, root)
            message = f"{label}, load_directly=True: the optimizer's state_dict() after it"
            _assert_equal_dicts(message, failure, optimizer.state_dict(), loaded)
        label += ", the step after loading the state dicts saved a step earlier"
        _assert_next_step(label, driver, reference, first, failures)
        failures.raise_first(dist.group)

    @check(
        "fsdp1.optim_state_dicts",
        "full / scattered / sharded / rekeyed optimizer state dicts hold DDP's Adam state (every "
        "optim_input form and optim alike, group=) and resume a fresh optimizer exactly as DDP",
        features=FEATURES,
        case="suite.test_fsdp1_methods.MethodCase",
        case_of="optim_case",
        api=OPTIM_ITEMS,
    )
    def test_optim_state_dicts(self, fsdp_adapter: Any, dist: Any, optim_case: MethodCase):
        case, api, failures = optim_case, _api(fsdp_adapter), _Failures()
        group = _other_group(dist)
        driver = _driver(fsdp_adapter, dist, case, group, optimizer_name="adam")
        reference = _reference(dist)
        first = (driver.run(1), reference.run(1))
        label = f"adapter {fsdp_adapter.name!r}, {MODEL}, {case.id}"
        fresh = _adam(fsdp_adapter, driver.model)
        with _only_on(group, label):
            to_load = _ROUTES[case.form](label, api, driver, fresh, reference, group, failures)
        fresh.load_state_dict(to_load)
        driver.optimizer = fresh
        label += ", a fresh optimizer loaded with it, one step"
        _assert_next_step(label, driver, reference, first, failures)
        failures.raise_first(dist.group)

    @check(
        "fsdp1.summon_options",
        "after a micro-batch under no_sync and one more, summon_full_params shows DDP's full "
        "gradients (with_grads; clip_grad_norm_(inf) then returns DDP's norm), full parameters "
        "on rank 0 only (rank0_only), on the CPU (offload_to_cpu), only the outer instance's "
        "(recurse=False); nothing persists",
        features=FEATURES,
        case="suite.test_fsdp1_methods.MethodCase",
        case_of="summon_case",
        api=SUMMON_ITEMS,
    )
    def test_summon_options(self, fsdp_adapter: Any, dist: Any, summon_case: MethodCase):
        case, fsdp = summon_case, _api(fsdp_adapter).FullyShardedDataParallel
        driver, failures = _driver(fsdp_adapter, dist, case), _Failures()
        root, reference = driver.model, training.ddp_driver(MODEL, dist)
        label = f"adapter {fsdp_adapter.name!r}, {MODEL}, summon_full_params {case.id}"
        # two micro-batches, the first under no_sync(): the accumulated gradients
        first = [torch.stack(d.accumulate([False, True], d.loss)) for d in (driver, reference)]
        expected = {"params": reference.params(), "grads": reference.grads()}
        before = training.local_shards(root)
        option = {"recurse_false": {"recurse": False}}.get(case.form, {case.form: True})
        parts = {"params": _copy}
        if case.form == "with_grads":  # (reading .grad under offload_to_cpu=True crashes)
            parts["grads"] = lambda param: _copy(param.grad)
        else:
            option["writeback"] = False
        with fsdp.summon_full_params(root, **option):
            named = list(root.named_parameters())
            shown = {
                part: training.by_clean_name(fsdp_adapter, ((n, get(p)) for n, p in named))
                for part, get in parts.items()
            }
        labels = instance_labels(fsdp_adapter, root).values()
        nested = tuple(f"{path}." for path in labels if path != ROOT_LABEL)
        with failures.kept():
            _assert_summoned(label, case.form, shown, expected, nested, dist.rank)
        if case.form == "with_grads":  # then clipping by the inf-norm: DDP's norm
            max_norm = 0.5 * max(g.abs().max().item() for g in expected["grads"].values())
            norm = {"norm": root.clip_grad_norm_(max_norm, norm_type=math.inf)}
            expected_norm = {"norm": reference.clip(max_norm, math.inf)}
            with failures.kept():
                message = f"{label}, then clip_grad_norm_(max_norm, norm_type=inf)'s total norm"
                check_same_values(message, "norm differs from the reference", norm, expected_norm)
        with failures.kept():
            message = f"{label}, the shards after the context"
            failure = "changes inside summon_full_params persisted"
            check_same_values(message, failure, training.local_shards(root), before)
        failures.raise_first(dist.group)  # before training on, which such a failure may break
        driver.step()
        reference.step()
        _assert_next_step(f"{label}, training on", driver, reference, first, failures)
        failures.raise_first(dist.group)

    @check(
        "fsdp1.comm_hook",
        "register_comm_hook(state, hook): the hook gets the state in every backward and FSDP "
        "applies its reduction (reduce, then halve: training equals DDP on the halved loss)",
        features=FEATURES,
        case="suite.test_fsdp1_methods.MethodCase",
        case_of="hook_case",
        api=("FullyShardedDataParallel.register_comm_hook()",),
    )
    def test_comm_hook(self, fsdp_adapter: Any, dist: Any, hook_case: MethodCase):
        case, api = hook_case, _api(fsdp_adapter)
        strategy = api.ShardingStrategy[case.form]
        driver = _driver(fsdp_adapter, dist, case, sharding_strategy=strategy)
        state = types.SimpleNamespace(group=dist.group, calls=0)
        driver.model.register_comm_hook(state, _halving_hook)
        calls: list[int] = []
        losses = driver.run(self.STEPS, after_backward=lambda step: calls.append(state.calls))
        reference = training.ddp_driver(MODEL, dist)
        halved = lambda step, index: 0.5 * reference.loss(index)
        reference_run = (reference.run(self.STEPS, loss=halved), reference.params())
        label = f"adapter {fsdp_adapter.name!r}, {MODEL}, {case.id}, a comm hook halving gradients"
        idle = [step for step, count in enumerate(calls) if count == ([0] + calls)[step]]
        if idle:
            message = f"{label}: the hook was not called in the backward of steps {idle}"
            raise CheckFailure(message, "comm hook not called", steps=len(idle))
        _assert_training(label, driver, 0.5 * losses, reference_run)


def _assert_next_step(label: str, driver: Any, reference: Any, first: Any, failures: Any) -> None:
    """Step 1 of both runs: the losses of steps 0 and 1 (`first`: step 0's) and the full
    parameters after it are the reference's."""
    losses = torch.cat([first[0], driver.run(1, start=1)])
    expected = (torch.cat([first[1], reference.run(1, start=1)]), reference.params())
    with failures.kept():
        _assert_training(label, driver, losses, expected)


def _copy(tensor: Any) -> Any:
    """A copy of `tensor`; None for a view reaching past its storage (freed under it: reading
    it would crash the process)."""
    if tensor is None or tensor.numel() == 0:
        return None if tensor is None else tensor.detach().clone()
    extent = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    needed = (tensor.storage_offset() + extent + 1) * tensor.element_size()
    return tensor.detach().clone() if tensor.untyped_storage().nbytes() >= needed else None


def _triple(settings: Any) -> tuple:
    """A StateDictSettings as (type, state dict config, optimizer state dict config)."""
    return (settings.state_dict_type, settings.state_dict_config, settings.optim_state_dict_config)


def _assert_settings(label: str, seen: tuple, expected: tuple) -> None:
    if seen != expected:
        message = f"{label}: get_state_dict_type reports {seen}, expected {expected}"
        raise CheckFailure(message, "state dict settings differ", seen=str(seen[0]))


def _assert_empty(label: str, entries: int) -> None:
    if entries:
        message = f"{label}: rank0_only=True, yet other ranks than 0 hold {entries} entries"
        raise CheckFailure(message, "state dict not empty off rank 0", entries=entries)


def _assert_named(label: str, failure: str, named: dict, loaded: dict, root: Any) -> None:
    """is_named_optimizer=True: the state to load keyed by the names of the model's parameters
    (as a NamedOptimizer over it keys them), else the same as the id-keyed one."""
    names = [name for name, _ in root.named_parameters()]
    by_name = {names[index]: entry for index, entry in loaded["state"].items()}
    _assert_equal_dicts(label, failure, named["state"], by_name)


def _assert_summoned(
    label: str, form: str, shown: dict, expected: dict, nested: tuple, rank: int
) -> None:
    """What summon_full_params(`form`) showed: the full parameters (and with_grads: gradients)
    of DDP, on the CPU with offload_to_cpu; rank0_only: on rank 0 only, shards elsewhere;
    recurse=False: the root's own parameters full, the `nested` instances' still sharded."""
    params, reference = shown["params"], expected["params"]
    freed = sorted(name for name, value in params.items() if value is None)
    if freed:
        message = f"{label}: inside the context {freed} are views past the end of their storage"
        message += " (reading them crashes)"
        raise CheckFailure(message, "parameters in freed memory", count=len(freed))
    if form == "recurse_false":
        own = {name: value for name, value in reference.items() if not name.startswith(nested)}
        shown_own = {name: params.get(name) for name in own}
        check_same_values(label, "full params differ from the reference", shown_own, own)
        _assert_sharded(label, "nested instances unsharded", params, reference, nested)
        return
    if form == "rank0_only" and rank != 0:
        _assert_sharded(label, "full parameters off rank 0", params, reference, ("",))
        return
    for part, values in shown.items():
        message = f"{label}, the full {part}"
        check_same_values(message, f"full {part} differ from the reference", values, expected[part])
    on_device = sorted(name for name, t in params.items() if t.device.type != "cpu")
    if form == "offload_to_cpu" and on_device:
        message = f"{label}: offload_to_cpu=True, yet {on_device} are not on the CPU"
        raise CheckFailure(message, "tensors on the wrong device", count=len(on_device))


def _assert_sharded(label: str, failure: str, shown: dict, full: dict, prefixes: tuple) -> None:
    """The parameters under `prefixes` show fewer elements than in full (still sharded)."""
    held = sum(t.numel() for name, t in shown.items() if name.startswith(prefixes))
    total = sum(t.numel() for name, t in full.items() if name.startswith(prefixes))
    if held >= total:
        message = f"{label}: the parameters under {list(prefixes)} show {held} elements, "
        raise CheckFailure(message + f"in full {total}", failure, elements=held)


def _route_full(label, api, driver, fresh, reference, group, failures) -> dict:
    """full_optim_state_dict (rank 0, every rank, each optim_input form) ->
    shard_full_optim_state_dict (default, optim, each optim_input form)."""
    fsdp, root, optimizer = api.FullyShardedDataParallel, driver.model, driver.optimizer
    full_osd = functools.partial(fsdp.full_optim_state_dict, root, optimizer, group=group)
    full, on_rank0 = full_osd(rank0_only=False), full_osd()
    forms = {"rank0_only=True (default)": on_rank0} if group.rank() == 0 else {}
    for form, inputs in _optim_inputs(optimizer).items():
        forms[form] = full_osd(optim_input=inputs, rank0_only=False)
    with failures.kept():
        _assert_full_osd(f"{label}, full_optim_state_dict(rank0_only=False)", full, reference)
        if group.rank() != 0:
            _assert_empty(f"{label}, full_optim_state_dict()", len(on_rank0.get("state", {})))
        _assert_forms(f"{label}, full_optim_state_dict", forms, full)
    shard = fsdp.shard_full_optim_state_dict
    result = shard(copy.deepcopy(full), root, optim=fresh)
    forms = {"default": shard(copy.deepcopy(full), root)}
    for form, inputs in _optim_inputs(fresh).items():
        forms[form] = shard(copy.deepcopy(full), root, optim_input=inputs)
    with failures.kept():
        _assert_forms(f"{label}, shard_full_optim_state_dict", forms, result)
    return result


def _full_state(api: Any, driver: Any, group: Any, rank0_only: bool) -> dict:
    """The full optimizer state by optim_state_dict under FULL_STATE_DICT, not offloaded (the
    source of the scatter and rekey routes: torch FSDP1's offload has a bug of its own on a CPU
    host, the full route's deviation)."""
    fsdp, kind = api.FullyShardedDataParallel, api.StateDictType.FULL_STATE_DICT
    config = api.FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only)
    with fsdp.state_dict_type(driver.model, kind, None, config):
        return fsdp.optim_state_dict(driver.model, driver.optimizer, group=group)


def _route_scatter(label, api, driver, fresh, reference, group, failures) -> dict:
    """The full state on rank 0 -> scatter_full_optim_state_dict (optim, default, each
    optim_input form)."""
    fsdp, root = api.FullyShardedDataParallel, driver.model
    full = _full_state(api, driver, group, rank0_only=True)
    if group.rank() == 0:
        with failures.kept():
            _assert_full_osd(f"{label}, the full state on rank 0", full, reference)
    source = lambda: copy.deepcopy(full) if group.rank() == 0 else None
    scatter = fsdp.scatter_full_optim_state_dict
    result = scatter(source(), root, optim=fresh, group=group)
    forms = {"default": scatter(source(), root, group=group)}
    for form, inputs in _optim_inputs(fresh).items():
        forms[form] = scatter(source(), root, optim_input=inputs, group=group)
    with failures.kept():
        _assert_forms(f"{label}, scatter_full_optim_state_dict", forms, result)
    return result


def _route_sharded(label, api, driver, fresh, reference, group, failures) -> dict:
    """sharded_optim_state_dict (this rank's shards of DDP's state) ->
    flatten_sharded_optim_state_dict."""
    fsdp, root = api.FullyShardedDataParallel, driver.model
    sharded = fsdp.sharded_optim_state_dict(root, driver.optimizer, group=group)
    ranks = _gathered(sharded["state"], group)
    with failures.kept():
        message = f"{label}, sharded_optim_state_dict"
        _assert_state(message, "optimizer", ranks, _reference_adam(reference), "sharded", "cpu")
    return fsdp.flatten_sharded_optim_state_dict(sharded, root, fresh)


def _route_rekey(label, api, driver, fresh, reference, group, failures) -> dict:
    """rekey_optim_state_dict of the full state to PARAM_ID is the unwrapped model's optimizer's
    own state_dict(); of that to PARAM_NAME the full state (each form); sharded and loaded."""
    fsdp, keys = api.FullyShardedDataParallel, api.OptimStateKeyType
    full = _full_state(api, driver, group, rank0_only=False)
    plain, plain_optimizer = reference.zoo_model, reference.optimizer
    by_id, rekey = plain_optimizer.state_dict(), fsdp.rekey_optim_state_dict
    for key_type, source, expected in (
        (keys.PARAM_ID, full, by_id),
        (keys.PARAM_NAME, by_id, full),
    ):
        forms = {"default": rekey(copy.deepcopy(source), key_type, plain)}
        forms["optim"] = rekey(copy.deepcopy(source), key_type, plain, optim=plain_optimizer)
        for form, inputs in _optim_inputs(plain_optimizer).items():
            forms[form] = rekey(copy.deepcopy(source), key_type, plain, optim_input=inputs)
        with failures.kept():
            message = f"{label}, rekey_optim_state_dict(..., {key_type}, unwrapped model)"
            _assert_forms(message, forms, expected, _OPTIMIZER_DIFFERS)
    by_name = rekey(copy.deepcopy(by_id), keys.PARAM_NAME, plain)
    return fsdp.shard_full_optim_state_dict(by_name, driver.model, optim=fresh)


_ROUTES: dict[str, Callable[..., dict]] = {
    "full": _route_full,
    "scatter": _route_scatter,
    "sharded": _route_sharded,
    "rekey": _route_rekey,
}


def _optim_inputs(optimizer: Any) -> dict[str, Any]:
    """The two forms of ``optim_input``: the parameter groups, or an iterable of parameters (in
    the optimizer's order)."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    return {
        "optim_input=param_groups": optimizer.param_groups,
        "optim_input=parameters": iter(params),
    }


def _assert_full_osd(label: str, full: dict, reference: Any) -> None:
    """A full optimizer state dict: DDP's Adam state by parameter name."""
    check_same_values(label, _OPTIMIZER_DIFFERS, _flat(full["state"]), _reference_adam(reference))


def _assert_forms(
    label: str, forms: dict[str, dict], expected: dict, failure: str = "forms differ"
) -> None:
    """Each form's result equals `expected`."""
    for form, result in forms.items():
        _assert_equal_dicts(f"{label} ({form})", failure, result, expected)


def _halving_hook(state: Any, grad: torch.Tensor, output: Any = None) -> None:
    """Our reduction: the sum over ``state.group`` divided by twice its size (sharded
    strategies: this rank's part into `output`); counts its calls in ``state.calls``."""
    state.calls += 1
    divisor = 2 * state.group.size()
    if output is None:
        tdist.all_reduce(grad, group=state.group)
        grad.div_(divisor)
    else:
        tdist.reduce_scatter_tensor(output, grad, group=state.group)
        output.div_(divisor)


class TestFSDP1Methods(BaseFSDP1MethodTests): ...
