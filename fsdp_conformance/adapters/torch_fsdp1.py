"""Adapter for torch FSDP1: `torch.distributed.fsdp.FullyShardedDataParallel`.

On a host without an accelerator every wrap needs `device_id=cpu` ("FSDP needs a non-CPU
accelerator device"; added when not given), and `cpu_offload` / `sync_module_states` fail
(declared unsupported); measured on torch 2.13.0 (tests/adapters/test_torch_fsdp1.py).
"""

from __future__ import annotations

import functools
import re
import weakref
from typing import Any

import torch
import torch.distributed.fsdp
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from fsdp_conformance.constants import Op
from fsdp_conformance.device_handle import accelerator_available
from fsdp_conformance.training_states import InstanceState, RootState

from . import _dcp
from . import _fsdp1_internals as internals
from ._support import TORCH_RANGE, release
from .base import (
    Adapter,
    ObserverRegistry,
    UnsupportedFeatureError,
    clean_param_name,
    require_before_first_forward,
)
from .deviations import Deviation, Envelope
from .features import Declarations, Feature, fsdp1_style_kwargs, ignored_parameters, require

# process-wide: observers of the patched FSDP1 internals, and handle -> its FSDP instance
_REGISTRY = ObserverRegistry(
    "fsdp-conformance torch-fsdp1 comm trace", "torch " + "/".join(internals.VERIFIED_ON)
)
_INSTANCE_OF_HANDLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _patch_torch_fsdp1() -> None:
    """Label FSDP1's all-gathers and frees (`FlatParamHandle`) and reductions (`_runtime_utils.
    _reduce_grad(_no_shard)`, called through module globals) with their instance; once per
    process, pass-through while nobody observes."""
    handle_class = internals.flat_param_handle_class()
    runtime_utils = internals.runtime_utils()
    for owner, attribute, op, instance_of in (
        (handle_class, "_all_gather_flat_param", Op.ALL_GATHER, _INSTANCE_OF_HANDLE.get),
        (handle_class, "_free_unsharded_flat_param", Op.FREE, _INSTANCE_OF_HANDLE.get),
        (runtime_utils, "_reduce_grad", Op.REDUCE_SCATTER, lambda state: state),
        (runtime_utils, "_reduce_grad_no_shard", Op.ALL_REDUCE, lambda state: state),
    ):
        event = lambda first, *_, op=op, of=instance_of, **__: [(op, of(first))]
        _REGISTRY.patch_before(owner, attribute, event)


def label_instances(model: nn.Module) -> None:
    """Make every torch FSDP1 instance in ``model`` known to `observe_fsdp1` (its
    ``FlatParamHandle`` does not know it): call it on each model an adapter wraps."""
    for instance in FullyShardedDataParallel.fsdp_modules(model):
        handle = internals.handle_of(instance)
        if handle is not None:
            _INSTANCE_OF_HANDLE[handle] = instance


def observe_fsdp1(callback: Any, instances: list[nn.Module] | None) -> Any:
    """`Adapter._observe` for torch FSDP1: reports each labelled instance's all-gathers, frees
    and reductions to ``callback`` ([Note: observation] in adapters/base.py)."""
    _patch_torch_fsdp1()
    return _REGISTRY.observing(callback, instances)


def install_fsdp1_device_handle(adapter_name: str, model: nn.Module, handle: Any) -> None:
    """`Adapter._install_device_handle` for torch FSDP1: every instance in ``model`` and its
    ``FlatParamHandle`` use ``handle``; RuntimeError when ``model`` already ran forward (the
    first forward creates the streams)."""
    instances = FullyShardedDataParallel.fsdp_modules(model)
    require_before_first_forward(adapter_name, model, instances)
    for instance in instances:
        internals.set_device_handle(instance, handle)


# measured on CPU, gloo, world size 2 (docs/checks.md, docs/memory_bound.md)
_on_matrix = functools.partial(Deviation, measured_on="torch 2.13.0 (also 2.8.0, 2.14.1)")
_on_2_13 = functools.partial(Deviation, measured_on="torch 2.13.0")
# FULL_STATE_DICT offload_to_cpu on a CPU flat parameter: fixed in torch 2.14 (measured: 2.14.1)
OFFLOAD_FAILS = release(torch.__version__) < (2, 14, 0)
_fuzz = functools.partial(Deviation, measured_on="torch 2.13.0 (also 2.8.0, 2.14.1, 2.15.0)")
_DIFFERS = "training differs from DDP's"  # suite/training.py's failure


def _prefetching(case: Any) -> int:
    """How many of backward_prefetch=BACKWARD_PRE and forward_prefetch a limited FULL_SHARD
    memory-bound case sets (BACKWARD_POST prefetches with forward_prefetch only)."""
    if not (case.limit_all_gathers and case.sharding_strategy == "FULL_SHARD"):
        return 0
    return (case.backward_prefetch == "BACKWARD_PRE") + bool(case.forward_prefetch)


def _on_cpu_host(case: Any, form: str, use_orig_params: bool, offload_bug: bool = True) -> bool:
    """A case of the fsdp1 family (suite/test_fsdp1_methods.py) on a host without an
    accelerator (where FSDP1's offload to the CPU copies nothing); `offload_bug`: on a torch
    before 2.14 only."""
    return (
        case is not None
        and case.form in form.split()
        and case.use_orig_params == use_orig_params
        and not accelerator_available()
        and (OFFLOAD_FAILS or not offload_bug)
    )


_ALIASED_OPTIM_STATE = (
    "torch FSDP1 with use_orig_params=True on a CPU host returns a full optimizer state dict "
    "(full_optim_state_dict, or optim_state_dict under FullOptimStateDictConfig(offload_to_cpu="
    "True), the default) whose exp_avg is exp_avg_sq: _allgather_orig_param_states gathers "
    "every state into one buffer and 'offloads' the views with .cpu(), which copies nothing "
    "there, so the next state overwrites the last. Reproduction (2 ranks): FSDP(nn.Linear(8, 5), "
    "device_id=cpu, use_orig_params=True), one Adam step, FSDP.full_optim_state_dict(model, "
    "optim) on rank 0: state['weight']['exp_avg'] equals ['exp_avg_sq'] (the local shards "
    "differ); resuming from it trains another way"
)

FSDP1_DEVIATIONS = (
    _on_2_13(
        "fsdp1.state_dict_types",
        _ALIASED_OPTIM_STATE,
        lambda case: _on_cpu_host(case, "full_rank0", True, offload_bug=False),
        envelope=Envelope("optimizer state dict differs from the reference", max_gap=1e-5),
    ),
    _on_2_13(
        "fsdp1.optim_state_dicts",
        _ALIASED_OPTIM_STATE,
        lambda case: _on_cpu_host(case, "full", True, offload_bug=False),
        envelope=Envelope("optimizer state dict differs from the reference", max_gap=1e-5),
    ),
    _on_2_13(
        "fsdp1.state_dict_types",
        "torch FSDP1's LOCAL_STATE_DICT with use_orig_params=True holds each instance's "
        "_flat_param next to the original parameters, and load_state_dict rejects it "
        "(pytorch/pytorch#102667). Reproduction (2 ranks): FSDP(nn.Linear(8, 5), device_id=cpu, "
        "use_orig_params=True); under state_dict_type(LOCAL_STATE_DICT) model.state_dict() has "
        "keys ['_flat_param', 'bias', 'weight'] and model.load_state_dict(it) raises",
        lambda case: case is not None and case.form == "local" and case.use_orig_params,
        raises=RuntimeError,
        match=r'Unexpected key\(s\) in state_dict: "_flat_param"',
    ),
    Deviation(
        "fsdp1.summon_options",
        "torch FSDP1 before 2.14: summon_full_params(offload_to_cpu=True) on a CPU host fails "
        "('setStorage: ... out of bounds for storage of size 0', as FULL_STATE_DICT's offload in "
        "state_dict.full). Reproduction (2 ranks): FSDP(nn.Linear(8, 5), device_id=cpu), with "
        "FSDP.summon_full_params(model, offload_to_cpu=True, writeback=False): raises",
        lambda case: _on_cpu_host(case, "offload_to_cpu", False),
        raises=RuntimeError,
        match=r"setStorage: .* out of bounds for storage of size 0",
        measured_on="torch 2.13.0 (CPU build)",
    ),
    Deviation(
        "fsdp1.summon_options",
        "torch FSDP1 before 2.14: summon_full_params(offload_to_cpu=True) with "
        "use_orig_params=True on a CPU host shows every parameter as a view of a freed (0-byte) "
        "storage: reading one crashes the process (segmentation fault), and the next forward "
        "fails ('Output 0 of Split is a view and is being modified inplace'). Reproduction "
        "(2 ranks): FSDP(nn.Linear(8, 5), device_id=cpu, use_orig_params=True), inside "
        "FSDP.summon_full_params(model, offload_to_cpu=True, writeback=False): "
        "model.weight.untyped_storage().nbytes() is 0, the view needs 160",
        lambda case: _on_cpu_host(case, "offload_to_cpu", True),
        envelope=Envelope("parameters in freed memory", count=6),
        measured_on="torch 2.13.0 (CPU build)",
    ),
    *(
        _on_2_13(
            "memory_bound",
            "torch FSDP1 2.13.0 exceeds the two-instance bound from iteration 2 when handles are "
            "prefetched: the skipped unshard of a prefetched handle dequeues no free event, so "
            "3 events are queued and one buffer more than 'two consecutive FSDP instances' "
            "stays. Reproduction: FSDP(ChainOfLinears, limit_all_gathers=True, "
            f"backward_prefetch=BACKWARD_PRE{fwd}) with 6 inner instances under the lagging "
            f"device: peak {peak} resident inner buffers in forward and backward "
            "(docs/memory_bound.md, 'torch FSDP1')",
            applies,
            envelope=Envelope("memory bound exceeded", peak_forward=peak, peak_backward=peak),
        )
        for fwd, peak, applies in (
            (", forward_prefetch=True", 4, lambda case: _prefetching(case) == 2),
            ("", 3, lambda case: _prefetching(case) == 1),
        )
    ),
    _on_matrix(
        "exec_order.divergent",
        "torch FSDP1 compares the forward order across ranks only under "
        "TORCH_DISTRIBUTED_DEBUG=DETAIL (_ExecOrderData); by default same-shaped instances "
        "silently exchange each other's all-gathers. Reproduction: root Linear with two wrapped "
        "Linear(8, 8) branches, rank 1 runs them in the other order: no error",
        envelope=Envelope("no error raised"),
    ),
    _on_matrix(
        "misuse.wrap_twice",
        "torch FSDP1 wraps a module that another instance already wraps, without an error. "
        "Reproduction: lin = nn.Linear(8, 8); FSDP(lin); FSDP(lin) -> no error",
        envelope=Envelope("no error raised"),
    ),
    _on_matrix(
        "misuse.mixed_devices",
        "torch FSDP1 wraps a module with cpu and meta parameters without an error. Reproduction: "
        "FSDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8, device='meta')), device_id=cpu) -> no "
        "error",
        envelope=Envelope("no error raised"),
    ),
    _on_matrix(
        "misuse.forward_inside_summon",
        "torch FSDP1 fails with an internal AssertionError ('Expects tensor to be unsharded with "
        "size ... but got ...') that does not name summon_full_params. Reproduction: with "
        "FSDP.summon_full_params(model): model(x)",
        envelope=Envelope(
            "an error that does not name the problem",
            error=re.compile(r"^AssertionError: Expects tensor to be unsharded with size "),
        ),
    ),
    _on_2_13(
        "precision.dtypes",
        "torch FSDP1 accumulates gradients across no_sync() micro-batches in param_dtype (cast "
        "to reduce_dtype only at the synchronising backward), so N micro-batches round the "
        "running sum N times. Reproduction (2 ranks): FSDP(nn.Linear(8, 8), device_id=cpu, "
        "mixed_precision=MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)); two "
        "backwards inside no_sync() leave a bfloat16 gradient of the unsharded size. loops (one "
        "instance), 32 identical micro-batches: the update is 0.0178 (relative) away from float32 "
        "DDP's, 4.5x one micro-batch's 0.0039 (impl, FSDP2: 1.0x)",
        lambda case: case is not None and case.variant.startswith("no_sync"),
        envelope=Envelope("gradients accumulate in a low precision", growth=4.5, rtol=0.1),
    ),
    _on_2_13(
        "wrap.shared_across_instances",
        "torch FSDP1 silently unties a parameter tied across two instances wrapped apart (each "
        "flattens and trains its own copy), so training diverges from DDP. "
        "Reproduction (2 ranks, device_id=cpu): head.weight = embed.weight; FSDP(embed), "
        "FSDP(head), FSDP(root): the flat parameters hold 96 + 96 + 12 elements (the (12, 8) "
        "weight twice); after one SGD step embed's and head's weights differ under "
        "summon_full_params (tests/adapters/test_measured_torch_facts.py)",
        envelope=Envelope(
            _DIFFERS, rtol=0.25, loss_gap=0.064, param_gap=0.0282, parameter="embed.weight"
        ),
    ),
    _on_2_13(
        "forward.other_method",
        "torch FSDP1 leaves a nested instance called alone (after the root's lazy init) in "
        "BACKWARD_POST: only the root's forward queues the callback that resets states. "
        "Reproduction (2 ranks): loops wrapped FULL_SHARD, root(x) and backward once, then "
        "head(h).sum().backward(): head's handle state is BACKWARD_POST after the step "
        "(tests/adapters/test_measured_torch_facts.py)",
        lambda case: case.variant == "nested_alone",
        envelope=Envelope(
            "illegal training state",
            instance="head",
            hook="after optimizer.step",
            state="instance BACKWARD_POST",
        ),
    ),
    Deviation(
        "state_dict.full",
        "torch FSDP1 before 2.14: FULL_STATE_DICT with offload_to_cpu=True fails on a CPU-only "
        "host ('setStorage: ... out of bounds for storage of size 0'; rank0_only=True too); "
        "2.14 skips the offload of a flat parameter already on CPU. "
        "Reproduction (2 ranks): FSDP(nn.Linear(8, 5), device_id=cpu) after one step, "
        "model.state_dict() under state_dict_type(FULL_STATE_DICT, "
        "FullStateDictConfig(offload_to_cpu=True)) raises; offload_to_cpu=False works",
        lambda case: (
            case is not None
            and getattr(case, "option", "") == "offload_to_cpu"
            and not accelerator_available()
            and OFFLOAD_FAILS
        ),
        raises=RuntimeError,
        match=r"setStorage: .* out of bounds for storage of size 0",
        measured_on="torch 2.13.0 (CPU build)",
    ),
    _on_2_13(
        "state_dict.full",
        "torch FSDP1's load_state_dict(state_dict, assign=True) under FULL_STATE_DICT returns "
        "without an error but loads nothing: the model trains on from its old values. Reproduction "
        "(2 ranks): FSDP(nn.Linear(8, 5), device_id=cpu), load_state_dict({'weight': 0.5, 'bias': "
        "-1.0 filled}, assign=True) under FULL_STATE_DICT, one step: summon_full_params shows "
        "other values (assign=False loads them)",
        lambda case: case is not None and getattr(case, "option", "") == "assign",
        envelope=Envelope(
            _DIFFERS, rtol=0.25, loss_gap=138.0, param_gap=0.365, parameter="head.weight"
        ),
    ),
    Deviation(
        "state_dict.full",
        "torch FSDP1's FSDP.optim_state_dict (called by DCP's get_state_dict) fails on a group "
        "without global rank 0: _map_param_key_to_optim_keys broadcasts from src=0 over the "
        "model's group ('Global rank 0 is not part of group'). Reproduction (2 ranks): on rank 1, "
        "FSDP(nn.Linear(8, 5), process_group=new_group([1]), device_id=cpu), one Adam step, "
        "FSDP.optim_state_dict(model, optimizer, group=that group) raises. The cell reaches it "
        "only where torch-fsdp1 checkpoints (torch 2.13 on, [Note: DCP on a subgroup with FSDP1]; "
        "on 2.8.0 the cell passes)",
        lambda case: (
            case is not None
            and getattr(case, "test", "") == "subgroup"
            and getattr(case, "option", "") == "last"
            and not _dcp.fsdp1_group_dropped()
        ),
        raises=ValueError,
        match=r"Global rank 0 is not part of group",
        measured_on="torch 2.13.0, 2.14.1, 2.15.0",
    ),
    _fuzz(
        "fuzz.generated",
        "torch FSDP1 sets a flat parameter's gradient to None when its instance ran forward but "
        "none of its parameters was used in backward (even after zero_grad(set_to_none=False)): "
        "SGD with momentum skips them where DDP (a zero gradient) applies the momentum. "
        "Reproduction (2 ranks, FULL_SHARD): an inner FSDP(Branch) whose forward returns lin(x) + "
        "x in step 0 and x in step 1; after step 1's backward its flat parameter's grad is None on "
        "every rank, DDP's is zeros (found by fsdp-conformance fuzz --impl torch-fsdp1 --seed 0)",
        lambda case: case is not None and "branch" in case.uses(),
        envelope=Envelope("a gradient is None where DDP's is zero"),
    ),
    _fuzz(
        "fuzz.generated",
        "torch FSDP1 fails in backward with 'expected to be in states [IDLE] but current state is "
        "FORWARD_BACKWARD' when a frozen inner instance (requires_grad=False) ran backward in one "
        "step and returns its input unchanged in the next. Reproduction (2 ranks): Linear(4, 4) -> "
        "FSDP(Branch) with a frozen Linear(4, 4), Branch returning h + lin(h) in step 0 and h in "
        "step 1; step 1's backward raises in FSDP1's pre-backward hook (fsdp-conformance fuzz "
        "--impl torch-fsdp1 --seed 0)",
        lambda case: case is not None and {"branch", "frozen"} <= case.uses(),
        raises=ValueError,
        match="expected to be in states",
    ),
    *(
        Deviation(
            "fuzz.generated",
            "torch FSDP1 with NO_SHARD and use_orig_params=True drops an inner instance's original "
            "parameters from named_parameters() (so from summon_full_params, state_dict and later "
            "optimizers) once it skips a forward, for good; training still matches DDP. "
            "Reproduction (2 ranks, device_id=cpu): m.b = FSDP(Branch(), sharding_strategy="
            "NO_SHARD, use_orig_params=True) inside root = FSDP(m, same kwargs), Branch returning "
            "h + lin(h) in step 0 and h in step 1: after step 1 root.named_parameters() lists no "
            "b.lin.* (SHARD_GRAD_OP, FULL_SHARD keep them). So on 2.13.0 and 2.14.1; 2.15.0 fails "
            "in the next backward using the instance (_use_sharded_grad_views: 'a view and its "
            "base ... has been modified inplace'), 2.8.0 in its next forward "
            "(_writeback_orig_params: 'Cannot writeback when the parameter shape changes') "
            "(tests/adapters/test_measured_torch_facts.py)",
            lambda case: (
                case is not None
                and {"branch", "config:sharding_strategy=NO_SHARD", "config:use_orig_params=True"}
                <= case.uses()
            ),
            measured_on=measured_on,
            **covers,
        )
        for measured_on, covers in (
            (
                "torch 2.13.0, 2.14.1",
                # only missing names (those of the branch; a generated model's)
                {
                    "envelope": Envelope(
                        "parameter names differ from DDP's", missing=re.compile(".")
                    )
                },
            ),
            (
                "torch 2.15.0, 2.8.0",
                {
                    "raises": RuntimeError,
                    "match": r"is a view and its base or another view of its base has been "
                    r"modified inplace|Cannot writeback when the parameter shape changes",
                },
            ),
        )
    ),
)


def _fsdp1_unsupported() -> dict[str, str]:
    unsupported = {
        Feature.FORWARD_METHOD: (
            "torch FSDP1 has no way to run a method other than forward: root.encode(x) "
            "reaches the module's method through __getattr__ with the root's parameters "
            "sharded and fails (after a forward: 'setStorage: ... out of bounds for storage "
            "of size 0', measured on torch 2.13.0); FSDP1 users call wrapped children"
        ),
    }
    if _dcp.fsdp1_group_dropped():
        unsupported[Feature.CHECKPOINT_RESUME] = _dcp.FSDP1_SUBGROUP_REASON
    if accelerator_available():
        return unsupported
    return {
        **unsupported,
        Feature.CPU_OFFLOAD: (
            "torch FSDP1 CPU offload needs an accelerator: on a CPU-only host forward fails "
            "with 'Cannot access accelerator device when none is available' (a CUDA build: "
            "'Found no NVIDIA driver') (torch 2.13.0)"
        ),
        Feature.SYNC_MODULE_STATES: (
            "torch FSDP1 sync_module_states needs the module on GPU: on a CPU-only host "
            "wrap fails with 'The module has CPU parameters or buffers when "
            "`sync_module_states=True`' even with device_id=cpu (torch 2.13.0)"
        ),
    }


class TorchFSDP1Adapter(Adapter):
    """torch FSDP1 (`FullyShardedDataParallel`) through its public constructor."""

    name = "torch-fsdp1"

    @property
    def declarations(self) -> Declarations:
        return Declarations(
            unsupported=_fsdp1_unsupported(),
            known_deviations=FSDP1_DEVIATIONS,
            support=(TORCH_RANGE,),
            api={"fsdp1": torch.distributed.fsdp},
        )

    def _wrap(self, module: nn.Module, process_group: Any, config: dict[str, Any]) -> nn.Module:
        mixed = config.get("mixed_precision")
        if mixed is not None and mixed.output_dtype is not None:
            raise UnsupportedFeatureError(
                self.name,
                Feature.MIXED_PRECISION_POLICY,
                "torch FSDP1's MixedPrecision has no output_dtype (FSDP2's policy has)",
            )
        kwargs = fsdp1_style_kwargs(config, torch.distributed.fsdp)
        if "use_orig_params" in config:
            kwargs["use_orig_params"] = config["use_orig_params"]
        device_id = config.get("device_id")
        if device_id is None and not accelerator_available():
            device_id = torch.device("cpu")  # FSDP1 refuses a CPU-only host without it
        if device_id is not None:
            kwargs["device_id"] = device_id
        if config.get("ignored_params"):
            kwargs["ignored_states"] = ignored_parameters(config)
        wrapped = FullyShardedDataParallel(module, process_group=process_group, **kwargs)
        label_instances(wrapped)
        return wrapped

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, FullyShardedDataParallel) else model

    def instances(self, model: nn.Module) -> list[nn.Module]:
        return FullyShardedDataParallel.fsdp_modules(model)

    def training_state(self, instance: nn.Module) -> InstanceState:
        handle = internals.handle_of(instance)
        if handle is None:
            raise ValueError(
                f"{type(instance).__name__} instance has no parameters (no FlatParamHandle), so "
                "torch FSDP1 keeps no instance state for it; use root_state()"
            )
        return InstanceState[internals.handle_training_state_name(handle)]

    def root_state(self, instance: nn.Module) -> RootState:
        return RootState[internals.root_training_state_name(instance)]

    def is_unsharded(self, instance: nn.Module) -> bool:
        handle = internals.handle_of(instance)
        return handle is not None and internals.handle_is_unsharded(handle)

    def _assert_state(self, instance: nn.Module, states: tuple[RootState, ...]) -> None:
        internals.assert_state(instance, [state.value for state in states])

    def _summon_full_params(self, model: nn.Module, writeback: bool):
        return FullyShardedDataParallel.summon_full_params(model, writeback=writeback)

    def _observe(self, callback, instances):
        return observe_fsdp1(callback, instances)

    def _install_device_handle(self, model: nn.Module, handle: Any) -> None:
        install_fsdp1_device_handle(self.name, model, handle)

    def grad_scaler(self, model: nn.Module, **options: Any) -> Any:
        """``ShardedGradScaler`` over the root's process group, as FSDP1's docs pair them."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        device = next(model.parameters()).device.type
        return ShardedGradScaler(device, process_group=model.process_group, **options)

    def grad_shards(self, model: nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
        """Each FlatParameter's local gradient shard, cut by its shard metadata (no public view
        without ``use_orig_params``)."""
        paths = {id(module): name for name, module in model.named_modules()}
        pieces = {}
        for instance in FullyShardedDataParallel.fsdp_modules(model):
            handle = internals.handle_of(instance)
            if handle is None or handle.flat_param.grad is None:
                continue
            path = paths[id(instance)]
            prefix = clean_param_name(path + ".") if path else ""
            grad = handle.flat_param.grad.detach()
            for fqn, start, offset, numel in internals.grad_shard_layout(handle):
                pieces[prefix + fqn] = (start, grad[offset : offset + numel])
        return pieces

    def state_dict(
        self, model: nn.Module, *, rank0_only: bool = False, offload_to_cpu: bool = False
    ) -> dict[str, Any]:
        """``FULL_STATE_DICT`` with ``FullStateDictConfig(offload_to_cpu, rank0_only)``."""
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType

        config = FullStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=rank0_only)
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            return model.state_dict()

    def load_state_dict(
        self, model: nn.Module, state_dict: dict[str, Any], *, assign: bool = False
    ) -> None:
        from torch.distributed.fsdp import StateDictType

        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            model.load_state_dict(state_dict, assign=assign)

    def materialize(self, model: nn.Module, *, device: torch.device) -> None:
        """Nothing: FSDP1 materialises a meta-device module while wrapping it."""

    # no_sync() and clip_grad_norm_(): FSDP1's own methods on the root (the EngineHooks defaults)
    def save_checkpoint(self, model: nn.Module, optimizer: Any, directory: str) -> None:
        require(self, Feature.CHECKPOINT_RESUME)
        _dcp.save(model, optimizer, directory, model.process_group)

    def load_checkpoint(self, model: nn.Module, optimizer: Any, directory: str) -> None:
        require(self, Feature.CHECKPOINT_RESUME)
        _dcp.load(model, optimizer, directory, model.process_group)
