"""The methods of torch FSDP2's ``FSDPModule`` (and ``UnshardHandle``, ``share_comm_ctx``), each
promise asserted against a reference (``fsdp2_module.*``; docs/suite.md, "The FSDPModule
methods"). Every check needs ``Feature.FSDP2_API`` and calls the API through the adapter's
namespace (``Declarations.api["fsdp2"]``), so any FSDP2-compatible implementation runs them.

[Note: FSDP2 module references]
The model is the loops checks' ``LoopModule`` (models/loops.py: trunk, three blocks, head, an
optional branch), its blocks, head and branch passed to ``fully_shard`` and then the root (or,
for ``share_comm_ctx``, three roots). The reference is the same unwrapped model trained
micro-batch by micro-batch, each micro-batch's gradients averaged across ranks by hand (a
parameter no rank used keeps no gradient, as DDP with ``find_unused_parameters``), times the
factor a divide-factor method promises for its unit (sum / factor = mean * world / factor).
What is compared:

- gradients after a backward (``full_tensor()`` of the sharded gradient) with the reference's
  accumulated ones, and losses and full parameters after every optimizer step; within
  ``TOL`` (a unit whose sync is off reduces the sum of its micro-batch gradients once, the
  reference adds the reduced ones: the order of float32 additions differs);
- where parameters live: a unit is *sharded* when every parameter it registers is a DTensor,
  *unsharded* when none is (FSDP2 registers the plain unsharded tensors while they exist);
- collectives per phase, from the collective observer (all-gathers, reduce-scatters and
  all-reduces this rank issues, with their process group): promised counts are bounds (at most
  one reduction per unit whose sync is on, none from a unit whose sync is off), never an
  implementation's exact count.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from fsdp_conformance.adapters import Feature
from fsdp_conformance.checks import CheckFailure
from fsdp_conformance.constants import Op
from fsdp_conformance.device_handle import accelerator_available
from fsdp_conformance.observe.comm_trace import observing_collectives

from . import training, zoo
from .declare import calls, check
from .test_sharding import device_mesh
from .training import full_tensor

TOL = 1e-6  # [Note: FSDP2 module references]
MICRO_BATCHES = 3
BLOCKS = ("blocks.0", "blocks.1", "blocks.2")
GRADIENTS_DIFFER = "gradients differ from the reference"
PARAMETERS_DIFFER = "parameters differ from the reference"
NOT_IN_LAYOUT = "parameters not in the promised layout"
PATTERN_BROKEN = "collectives break the promised pattern"
CUSTOM_COMM_UNUSED = "custom communication not used"
HSDP_DIMS = ("replicate", "shard")


def _averaged(param: torch.Tensor, group: Any) -> torch.Tensor | None:
    """The mean over `group` of `param`'s gradient (zeros where a rank has none); None when no
    rank has one."""
    has = torch.tensor([float(param.grad is not None)], device=param.device)
    tdist.all_reduce(has, group=group)
    if has.item() == 0:
        return None
    grad = torch.zeros_like(param) if param.grad is None else param.grad.detach().clone()
    grad /= group.size()
    tdist.all_reduce(grad, group=group)
    return grad


class _Comm:
    """A custom all-gather or reduce-scatter: torch.distributed's own collective into buffers
    from its ``allocate``, each call recorded (its label, reduce op, buffers from allocate)."""

    def __init__(self, run: _Run, label: str) -> None:
        self.run, self.label = run, label
        self.allocated: list[torch.Tensor] = []
        self.calls: list[tuple[Any, bool]] = []  # (reduce op or None, buffers allocated here)

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = torch.empty(*size, dtype=dtype, device=device)
        self.allocated.append(buffer)
        return buffer

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        ours = {t.data_ptr() for t in self.allocated}
        self.allocated.clear()
        self.calls.append((op, bool({output_tensor.data_ptr(), input_tensor.data_ptr()} & ours)))
        kind = Op.ALL_GATHER if op is None else Op.REDUCE_SCATTER
        self.run.events.append((self.run.phase, kind, self.label))
        collective = tdist.all_gather_into_tensor
        if op is not None:
            collective = functools.partial(tdist.reduce_scatter_tensor, op=op)
        self.run.inside_comm += 1
        try:
            return collective(output_tensor, input_tensor, group=group, async_op=async_op)
        finally:
            self.run.inside_comm -= 1


class _Run:
    """``LoopModule`` wrapped by the adapter's ``fully_shard`` next to its reference, trained
    micro-batch by micro-batch ([Note: FSDP2 module references])."""

    def __init__(
        self,
        adapter: Any,
        dist: Any,
        label: str,
        *,
        mesh: Any = None,
        branch: bool = False,
        roots: tuple[str, ...] = ("",),
        meshes: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        self.ns = adapter.declarations.api["fsdp2"]
        self.dist, self.label = dist, label
        name = "loops_branch" if branch else "loops"
        self.model = zoo.build(name, dist.group, None, dist.device).to(dist.device)
        self.mesh = device_mesh(dist) if mesh is None else mesh
        names = list(dict.fromkeys([*BLOCKS, "head", *(["branch"] if branch else []), *roots]))
        self.units: dict[str, nn.Module] = {}
        for unit in names:
            mesh = (meshes or {}).get(unit, self.mesh)
            module = self.model.get_submodule(unit)
            self.units[unit or "root"] = self.ns.fully_shard(module, mesh=mesh, **options)
        self.owner = {}  # parameter name -> the unit registering it
        for param_name, _ in self.model.named_parameters():
            prefixes = [u for u in names if u and param_name.startswith(u + ".")]
            self.owner[param_name] = max(prefixes, key=len) if prefixes else "root"
        self.driver = training.Driver(self.model, self.model, dist.device)
        self.driver.zero_grad()  # its SGD (the reference's) built now, over the sharded parameters
        self.reference = training.ddp_driver(name, dist, ddp=False)
        self.scale: dict[str, float] = {}  # unit -> factor its gradients are promised to carry
        self.grads: dict[str, torch.Tensor] = {}  # the reference's accumulated gradients
        self.micro_grads: dict[str, torch.Tensor] = {}  # of its last micro-batch
        self.losses: list[torch.Tensor] = []
        self.reference_losses: list[torch.Tensor] = []
        self.phase: str | None = None
        self.collectives: list[tuple[str, str, Any]] = []  # (phase, op, process group)
        self.events: list[tuple[str | None, str, str]] = []  # (phase, what, label)
        self.inside_comm = 0  # > 0 while a custom comm runs
        self.outside_comm = 0  # collectives FSDP issued outside its custom comms (prefetch)

    @contextlib.contextmanager
    def observing(self) -> Iterator[None]:
        with observing_collectives(self._on_collective, self.dist.barrier):
            yield

    def _on_collective(self, call: Any) -> None:
        if self.phase is not None:
            self.collectives.append((self.phase, call.op, call.group))
            self.outside_comm += call.op == Op.ALL_GATHER and not self.inside_comm

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        self.phase = phase
        try:
            yield
        finally:
            self.phase = None

    def fail(self, message: str, failure: str, **figures: Any) -> None:
        raise CheckFailure(f"{self.label}: {message}", failure, **figures)

    def check_gap(self, message: str, failure: str, actual: Any, expected: Any, tol: float):
        training.check_gap(f"{self.label}: {message}", failure, actual, expected, tol)

    # training

    def set_branch(self, used: bool) -> None:
        self.model.use_branch = self.reference.zoo_model.use_branch = used

    def micro_batch(self, step: int, micro: int = 0, count: int = 1, after_forward=None) -> None:
        """Forward and backward of micro-batch `micro` of `step` (phases ``"<where> forward"``
        and ``"<where> backward"``; `after_forward(where)` between them), then the
        reference's."""
        index = step * count + micro
        where = f"step {step} micro {micro}"
        with self.in_phase(f"{where} forward"):
            loss = self.driver.loss(index) / count
        if after_forward is not None:
            after_forward(where)
        with self.in_phase(f"{where} backward"):
            loss.backward()
        self.losses.append(loss.detach().float())
        reference = self.reference.zoo_model
        reference.zero_grad(set_to_none=True)
        reference_loss = self.reference.loss(index) / count
        reference_loss.backward()
        self.reference_losses.append(reference_loss.detach().float())
        self.micro_grads = {}
        for param_name, param in reference.named_parameters():
            grad = _averaged(param, self.dist.group)
            if grad is not None:
                grad *= self.scale.get(self.owner[param_name], 1.0)
                self.micro_grads[param_name] = grad
                previous = self.grads.get(param_name)
                self.grads[param_name] = grad if previous is None else previous + grad
        self._check_losses(where)

    def step(self, step: int) -> None:
        self.driver.step()
        self.driver.zero_grad()
        for param_name, param in self.reference.zoo_model.named_parameters():
            param.grad = self.grads.get(param_name)
        self.reference.optimizer.step()
        self.grads = {}
        self.check_params(f"after step {step}")

    # comparisons

    def _check_losses(self, where: str) -> None:
        message = (
            f"{where}: loss {self.losses[-1].item()} differs from the reference's "
            f"{self.reference_losses[-1].item()}"
        )
        losses, expected = torch.stack(self.losses), torch.stack(self.reference_losses)
        self.check_gap(message, "losses differ from the reference", losses, expected, TOL)

    def check_grads(self, where: str, units: Any = None) -> None:
        """The gradients of `units` (all by default) equal the reference's accumulated ones; no
        gradient where the reference has none."""
        for param_name, param in self.model.named_parameters():
            unit = self.owner[param_name]
            actual, wanted = param.grad, self.grads.get(param_name)
            if (units is not None and unit not in units) or (actual is None and wanted is None):
                continue
            if actual is None or wanted is None:
                held, reference = ("no", "one") if actual is None else ("a", "none")
                message = f"{where}: {param_name!r} of unit {unit!r} has {held} gradient, "
                message += f"the reference {reference}"
                self.fail(message, GRADIENTS_DIFFER, max_gap=math.inf)
            message = (
                f"{where}: the gradient of {param_name!r} (unit {unit!r}, the reference's scaled "
                f"by {self.scale.get(unit, 1.0)}) differs from the reference's"
            )
            tol = TOL * (1 + wanted.abs().max().item())
            self.check_gap(message, GRADIENTS_DIFFER, full_tensor(actual), wanted, tol)

    def check_params(self, where: str) -> None:
        full = {name: full_tensor(param) for name, param in self.model.named_parameters()}
        expected = dict(self.reference.zoo_model.named_parameters())
        training.check_same_values(f"{self.label}: {where}", PARAMETERS_DIFFER, full, expected, TOL)

    def layout(self, unit: str) -> str:
        """``sharded`` (every parameter it registers a DTensor), ``unsharded`` (none) or
        ``mixed``."""
        from torch.distributed.tensor import DTensor

        kinds = {"sharded" if isinstance(p, DTensor) else "unsharded" for p in self.own(unit)}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def own(self, unit: str) -> list[torch.Tensor]:
        """The parameters `unit` registers (not those of the units inside it)."""
        return training.own_parameters(list(self.units.values()), self.units[unit])

    def check_layouts(self, where: str, unsharded: Any = ()) -> None:
        """Units in `unsharded` hold their unsharded parameters, every other unit is sharded."""
        seen = {unit: self.layout(unit) for unit in self.units if self.own(unit)}
        wanted = {unit: "unsharded" if unit in unsharded else "sharded" for unit in seen}
        wrong = {unit: kind for unit, kind in seen.items() if kind != wanted[unit]}
        if wrong:
            message = f"{where}: parameters not where the methods called promise them: "
            message += f"expected {wanted}, seen {seen}"
            self.fail(message, NOT_IN_LAYOUT, offenders=len(wrong), seen=str(wrong))

    def check_count(self, phase: str, op: str, low: int, high: int, why: str, groups=None):
        """`phase` issued `low` to `high` collectives `op` (on one of `groups` if given)."""
        issued = sum(
            where == phase and kind == op and (groups is None or group in groups)
            for where, kind, group in self.collectives
        )
        if not low <= issued <= high:
            message = f"{phase}: {issued} {op} collective(s), the methods called promise "
            message += f"{low} to {high}: {why}"
            self.fail(message, PATTERN_BROKEN, excess=max(issued - high, low - issued))

    def check_raises(self, error: type, call: Any, what: str) -> None:
        try:
            call()
        except error:
            return
        except Exception as other:  # noqa: BLE001  (reported as the wrong error)
            self.fail(f"{what} raised {other!r}, not {error.__name__}", "wrong error raised")
        self.fail(f"{what} raised nothing; expected {error.__name__}", "no error on a misuse")


def _flat_shard(grads: list[torch.Tensor], shard: int, shard_size: int) -> torch.Tensor:
    """This shard's rows of each gradient, flattened and concatenated (rows divisible)."""
    pieces = [g.reshape(shard_size, -1)[shard].reshape(-1) for g in grads]
    return torch.cat(pieces)


class BaseFSDP2ModuleTests:
    """The ``FSDPModule`` methods against a reference ([Note: FSDP2 module references]); one cell
    per check bundles several methods, each promise failing with its own message."""

    pytestmark = pytest.mark.world_size(2)  # each cell's, where it names none

    offloads: ClassVar[tuple[str, ...]] = ("no_offload", "cpu_offload")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        training.parametrize(metafunc, offload=self.offloads)

    @check(
        "fsdp2_module.gradient_sync",
        "gradient accumulation with sync and reshard-after-backward set per module: no "
        "reduce-scatter from a module whose sync is off, reduced gradients from the others, "
        "kept parameters not re-gathered, the next micro-batch runs after "
        "set_is_last_backward(False); matches the reference",
        features=(Feature.FSDP2_API,),
        case="offload: 'no_offload' or 'cpu_offload'",
        case_of="offload",
        api=(
            *calls("FSDPModule.set_requires_gradient_sync", "recurse=False"),
            *calls("FSDPModule.set_reshard_after_backward", "recurse=False"),
            "FSDPModule.set_is_last_backward()",
        ),
    )
    def test_gradient_sync_per_module(self, fsdp_adapter: Any, dist: Any, offload: str):
        ns = fsdp_adapter.declarations.api["fsdp2"]
        options = {}
        if offload == "cpu_offload":
            options["offload_policy"] = ns.CPUOffloadPolicy(pin_memory=accelerator_available())
        label = f"adapter {fsdp_adapter.name!r}, LoopModule, {offload}"
        run = _Run(fsdp_adapter, dist, label, **options)
        root, units = run.units["root"], run.units
        with run.observing():
            for step in range(2):
                kept: tuple[str, ...] = ()
                for micro in range(MICRO_BATCHES):
                    last = micro == MICRO_BATCHES - 1
                    root.set_is_last_backward(last)
                    if step == 0:  # sync off for the root's own parameters and blocks.1 only,
                        # the root alone keeping its parameters after backward
                        root.set_requires_gradient_sync(last, recurse=False)
                        units["blocks.1"].set_requires_gradient_sync(last, recurse=False)
                        root.set_reshard_after_backward(last, recurse=False)
                        off = ("root", "blocks.1")
                    else:  # the recursive forms, on the root: no sync, everything kept
                        root.set_requires_gradient_sync(last)
                        root.set_reshard_after_backward(last)
                        off = tuple(units)
                    run.micro_batch(step, micro, MICRO_BATCHES)
                    _check_accumulation(run, step, micro, () if last else off, kept)
                    kept = () if last else off if step else ("root",)
                    where = f"step {step} micro {micro}, after backward"
                    run.check_layouts(where, unsharded=kept)
                run.step(step)

    @check(
        "fsdp2_module.hsdp_all_reduce",
        "HSDP on a 2 x 2 mesh: set_requires_all_reduce(False) reduce-scatters without "
        "all-reducing, set_requires_gradient_sync(False) does neither, and the last "
        "micro-batch all-reduces the accumulated sum; the all-reduce "
        "hook gets the all-reduced gradient; the gradient divide factor and sum-only "
        "reductions give sum / factor and the mean; matches the reference",
        features=(Feature.FSDP2_API,),
        api=(
            *calls("FSDPModule.set_requires_all_reduce", "recurse=False"),
            "FSDPModule.set_all_reduce_hook()",
            "FSDPModule.set_gradient_divide_factor()",
            "FSDPModule.set_requires_gradient_sync()",
        ),
    )
    @pytest.mark.world_size(4)
    def test_hsdp_all_reduce(self, fsdp_adapter: Any, dist: Any):
        label = f"adapter {fsdp_adapter.name!r}, LoopModule, HSDP on a 2 x 2 mesh"
        run = _Run(fsdp_adapter, dist, label, mesh=device_mesh(dist, (2, 2), HSDP_DIMS))
        root, units = run.units["root"], run.units
        shard, replicate = (run.mesh.get_group(dim) for dim in (1, 0))
        hooked: list[torch.Tensor] = []
        units["blocks.1"].set_all_reduce_hook(lambda output: hooked.append(output.clone()))
        units["blocks.2"].set_gradient_divide_factor(2.0)  # the shard size: an average there
        units["blocks.0"].set_force_sum_reduction_for_comms(True)
        run.scale = {"blocks.2": dist.world_size / 2.0}
        children = [unit for unit in units if unit != "root"]
        with run.observing():
            for step, mode in enumerate(("deferred", "deferred_root", "no_sync")):
                for micro in range(MICRO_BATCHES):
                    last = micro == MICRO_BATCHES - 1
                    if mode == "no_sync":  # neither reduce-scatter nor all-reduce but the last
                        root.set_requires_gradient_sync(last)
                    else:
                        root.set_requires_all_reduce(last, recurse=mode == "deferred")
                    hooked.clear()
                    run.micro_batch(step, micro, MICRO_BATCHES)
                    phase = f"step {step} micro {micro} backward"
                    scattering = units if last or mode != "no_sync" else []
                    reducing = units if last else children if mode == "deferred_root" else []
                    for op, group, among in (
                        (Op.REDUCE_SCATTER, shard, scattering),
                        (Op.ALL_REDUCE, replicate, reducing),
                    ):
                        why = f"{op} in {list(among) or 'no unit'} ({mode})"
                        run.check_count(phase, op, min(1, len(among)), len(among), why, [group])
                    run.check_grads(phase, units=reducing)
                    if "blocks.1" in reducing:  # the hook runs after each all-reduce
                        grads = run.micro_grads if mode == "deferred_root" else run.grads
                        _check_hook(run, phase, hooked, grads, dist.rank % 2)
                run.step(step)

    @check(
        "fsdp2_module.reduction",
        "custom reduce-scatter used with its own buffers, sum-only reductions and divide "
        "factors give sum / factor (a one-rank shard too), reduce-scatter on a separate group "
        "where enabled, zero gradients reduced for parameters unused on a rank where enabled, "
        "any input-buffer cap trains the same; matches the reference",
        features=(Feature.FSDP2_API,),
        api=(
            "FSDPModule.set_custom_reduce_scatter()",
            "FSDPModule.set_force_sum_reduction_for_comms()",
            "FSDPModule.set_gradient_divide_factor()",
            "FSDPModule.set_reduce_scatter_divide_factor()",
            *calls("FSDPModule.set_separate_reduce_scatter_group", "enable=False", "recurse=False"),
            *calls("FSDPModule.set_reduce_scatter_unused_params", "recurse=False"),
            *calls("FSDPModule.set_reduce_scatter_max_input_buffers", "recurse=False"),
        ),
    )
    def test_reduction(self, fsdp_adapter: Any, dist: Any):
        label = f"adapter {fsdp_adapter.name!r}, LoopModule with a branch"
        # (2, 1): whole parameters, all-reduced
        replicated = device_mesh(dist, (dist.world_size, 1), HSDP_DIMS)
        run = _Run(fsdp_adapter, dist, label, branch=True, meshes={"blocks.2": replicated})
        root, units = run.units["root"], run.units
        comm = _Comm(run, "head")
        units["head"].set_custom_reduce_scatter(comm)
        for unit, factor in (("head", 4.0), ("blocks.0", 1.0), ("blocks.2", 4.0)):
            if unit == "blocks.0":
                with warnings.catch_warnings():  # the deprecated name of the same method
                    warnings.simplefilter("ignore", FutureWarning)
                    units[unit].set_reduce_scatter_divide_factor(factor)
            else:
                units[unit].set_gradient_divide_factor(factor)
            run.scale[unit] = dist.world_size / factor
        for unit in ("head", "blocks.0"):  # gloo has no PREMUL_SUM: scale before or after
            units[unit].set_force_sum_reduction_for_comms(True)
        cap = root.set_reduce_scatter_max_input_buffers
        for bad, error in ((0, ValueError), (True, TypeError)):
            misuse = f"set_reduce_scatter_max_input_buffers({bad!r})"
            run.check_raises(error, lambda bad=bad: cap(bad), misuse)
        root.set_reduce_scatter_max_input_buffers(2)
        units["blocks.1"].set_reduce_scatter_max_input_buffers(3, recurse=False)
        shared = run.mesh.get_group(0)
        with run.observing():
            for step in range(3):
                if step == 0:  # every unit on a separate group; blocks.1's bias unused on rank 1
                    root.set_separate_reduce_scatter_group()
                    root.set_reduce_scatter_unused_params(True)
                    dropped = _drop_bias(run, "blocks.1", dist.rank == 1)
                    separate = (1, len(units) - 1)  # blocks.2 has a one-rank shard: none
                elif step == 1:  # the root alone; the branch (a child) used nowhere
                    for hook in dropped:
                        hook.remove()
                    root.set_separate_reduce_scatter_group(False)
                    root.set_separate_reduce_scatter_group(True, recurse=False)
                    root.set_reduce_scatter_unused_params(False)
                    root.set_reduce_scatter_unused_params(True, recurse=False)
                    run.set_branch(False)
                    separate = (1, 1)
                else:
                    root.set_separate_reduce_scatter_group(enable=False)
                    run.set_branch(True)
                    separate = (0, 0)
                calls = len(comm.calls)
                run.micro_batch(step)
                phase = f"step {step} micro 0 backward"
                run.check_grads(phase)
                _check_separate_group(run, phase, shared, separate)
                _check_comm(run, phase, comm, comm.calls[calls:], tdist.ReduceOp.SUM)
                run.step(step)

    @check(
        "fsdp2_module.unshard_reshard",
        "unshard() and unshard(async_op=True) + wait() register the full parameters and "
        "forward gathers them no more; reshard() frees them; reshard_after_forward changed "
        "after wrapping (the root's too) holds; no all-gather in backward for a module with "
        "unshard_in_backward False; reset_iter_state after a failed forward or backward "
        "reshards everything and training goes on as the reference",
        features=(Feature.FSDP2_API,),
        api=(
            *calls("FSDPModule.unshard", "async_op=True"),
            "UnshardHandle.wait()",
            "FSDPModule.reshard()",
            *calls("FSDPModule.set_reshard_after_forward", "recurse=False"),
            "FSDPModule.set_unshard_in_backward()",
            "FSDPModule.reset_iter_state()",
        ),
    )
    def test_unshard_reshard(self, fsdp_adapter: Any, dist: Any):
        run = _Run(fsdp_adapter, dist, f"adapter {fsdp_adapter.name!r}, LoopModule")
        root, units = run.units["root"], run.units
        children = [unit for unit in units if unit != "root"]
        # before the first forward: the root alone reshards after forward, and is not
        # unsharded in backward (the trunk's input needs no gradient, so no weight is needed)
        root.set_reshard_after_forward(False)
        root.set_reshard_after_forward(True, recurse=False)
        root.set_unshard_in_backward(False)
        handle = units["blocks.1"].unshard(async_op=True)
        if not isinstance(handle, run.ns.UnshardHandle):
            run.fail(f"unshard(async_op=True) returned {handle!r}", "no UnshardHandle returned")
        handle.wait()
        _check_unsharded(run, "blocks.1", "after unshard(async_op=True) and wait()")
        units["blocks.2"].unshard()
        _check_unsharded(run, "blocks.2", "after unshard()")
        full = run.own("blocks.2")
        units["blocks.2"].reshard()
        run.check_layouts("after blocks.2.reshard()", unsharded=("blocks.1",))
        kept = [tuple(p.shape) for p in full if p.untyped_storage().size() > 0]
        if kept:
            message = f"after blocks.2.reshard() the unsharded parameters {kept} still hold memory"
            run.fail(message, "unsharded storage not freed", offenders=len(kept))
        units["blocks.2"].unshard(async_op=True)  # not waited for: its pre-forward waits
        with run.observing():
            for step in range(3):
                if step == 1:
                    root.set_reshard_after_forward(True)
                if step == 2:
                    _interrupted(run, "forward")
                    _interrupted(run, "backward")
                    what = "reset_iter_state() on a module that is not the root"
                    run.check_raises(RuntimeError, units["blocks.1"].reset_iter_state, what)
                after = ("blocks.1", "blocks.2") if step == 0 else ()
                kept = children if step == 0 else ()
                why = f"{list(after) or 'no unit'} unsharded before this forward"
                layouts = functools.partial(run.check_layouts, unsharded=kept)
                run.micro_batch(step, after_forward=layouts)
                phase = f"step {step} micro 0"
                run.check_count(f"{phase} forward", Op.ALL_GATHER, 0, len(units) - len(after), why)
                gathering = len(units) - 1 - len(kept)
                why = f"the root's unshard_in_backward is False, {list(kept)} kept after forward"
                run.check_count(f"{phase} backward", Op.ALL_GATHER, 0, gathering, why)
                run.check_layouts(f"{phase}, after backward")
                run.check_grads(f"{phase}, after backward")
                run.step(step)

    @check(
        "fsdp2_module.prefetch",
        "explicit forward and backward prefetch lists two deep all-gather those modules, in "
        "list order, before the prefetching module computes; a mis-targeted backward prefetch "
        "leaves no stale parameters; custom all-gathers carry every all-gather with their own "
        "buffers; roots sharing one comm context; matches the reference",
        features=(Feature.FSDP2_API,),
        api=(
            "FSDPModule.set_modules_to_forward_prefetch()",
            "FSDPModule.set_modules_to_backward_prefetch()",
            "FSDPModule.set_custom_all_gather()",
            "share_comm_ctx()",
        ),
    )
    def test_prefetch(self, fsdp_adapter: Any, dist: Any):
        label = f"adapter {fsdp_adapter.name!r}, LoopModule as three roots"
        run = _Run(fsdp_adapter, dist, label, roots=("trunk", "blocks", "head"))
        units, ns = run.units, run.ns
        stranger = nn.Linear(2, 2)  # not an FSDPModule
        misuse = "share_comm_ctx with a module that is not an FSDPModule"
        run.check_raises(ValueError, lambda: ns.share_comm_ctx([units["trunk"], stranger]), misuse)
        ns.share_comm_ctx([units["trunk"], units["blocks"], units["head"]])
        comms = {unit: _Comm(run, unit) for unit in units if run.own(unit)}
        for unit, comm in comms.items():
            units[unit].set_custom_all_gather(comm)
        block = [units[name] for name in BLOCKS]
        misuse = "set_modules_to_forward_prefetch with a module that is not an FSDPModule"
        prefetch = block[0].set_modules_to_forward_prefetch
        run.check_raises(ValueError, lambda: prefetch([stranger]), misuse)
        block[0].set_modules_to_forward_prefetch([block[1], block[2]])
        block[2].set_modules_to_backward_prefetch([block[1], block[0]])
        block[0].set_modules_to_backward_prefetch([block[2]])  # mis-targeted: its backward is over
        for name in BLOCKS:
            units[name].register_forward_pre_hook(
                lambda *_, name=name: _event(run, "compute", name)
            )
            units[name].register_forward_hook(lambda *a, name=name: _on_backward(run, name, a[2]))
        with run.observing():
            for step in range(3):
                run.micro_batch(step)
                phase = f"step {step} micro 0"
                _check_comms_carry_all_gathers(run, phase, comms)
                forward, backward = BLOCKS[1:], (BLOCKS[1], BLOCKS[0])
                _check_order(run, f"{phase} forward", BLOCKS[:1], forward, "compute blocks.0")
                _check_order(run, f"{phase} backward", (), backward, "backward blocks.2")
                run.check_grads(f"{phase}, after backward")
                run.step(step)


def _check_accumulation(run: _Run, step: int, micro: int, off: tuple, kept: tuple) -> None:
    """One micro-batch of ``test_gradient_sync_per_module``: no reduce-scatter from the units
    whose sync is `off`, reduced gradients in the others, and no all-gather in forward of the
    units `kept` unsharded by the previous backward."""
    where = f"step {step} micro {micro}"
    synced = [unit for unit in run.units if unit not in off]
    why = f"sync is off for {list(off) or 'no unit'}"
    low = 1 if synced else 0
    run.check_count(f"{where} backward", Op.REDUCE_SCATTER, low, len(synced), why)
    gathering = len(run.units) - len(kept)
    why = f"{list(kept) or 'no unit'} kept unsharded after the previous backward"
    run.check_count(f"{where} forward", Op.ALL_GATHER, 0, gathering, why)
    run.check_grads(f"{where}, after backward", units=synced)


def _check_hook(
    run: _Run, phase: str, hooked: list, grads: dict[str, torch.Tensor], shard: int
) -> None:
    """The all-reduce hook of blocks.1 ran in `phase`, its last call on the all-reduced
    gradient: this rank's shard of `grads` of blocks.1."""
    names = [name for name in grads if run.owner[name] == "blocks.1"]
    wanted = _flat_shard([grads[name] for name in names], shard, 2)
    failure = "all-reduce hook not called with the reduced gradient"
    if not hooked:
        run.fail(f"{phase}: blocks.1's all-reduce hook was not called", failure, max_gap=math.inf)
    message = (
        f"{phase}: the all-reduce hook of blocks.1 got a tensor of {hooked[-1].numel()} elements "
        "differing from this rank's shard of the all-reduced gradient"
    )
    run.check_gap(message, failure, hooked[-1].reshape(-1), wanted, TOL)


class _Interrupted(Exception):
    """Raised by a test hook to abort a forward or backward midway."""


def _interrupted(run: _Run, during: str) -> None:
    """A forward (or backward) aborted inside blocks.1, then ``reset_iter_state()`` on the root:
    every unit sharded again; the failed iteration's gradients are dropped (``zero_grad``)."""

    def abort(*_: Any) -> None:
        raise _Interrupted

    def arm(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        output.register_hook(abort)

    block = run.units["blocks.1"]
    handle = block.register_forward_pre_hook(abort) if during == "forward" else None
    handle = handle or block.register_forward_hook(arm)
    try:
        run.driver.loss(99).backward()
    except _Interrupted:
        pass
    finally:
        handle.remove()
    run.units["root"].reset_iter_state()
    run.driver.zero_grad()
    run.check_layouts(f"after reset_iter_state() following a failed {during}")


def _drop_bias(run: _Run, unit: str, drop: bool) -> list[Any]:
    """Where `drop`, the Linear of block `unit` computes without its bias in both models (the
    bias gets no gradient on this rank); the hook handles."""

    def without_bias(module: nn.Module, args: Any, output: torch.Tensor) -> Any:
        return torch.nn.functional.linear(args[0], module.weight) if drop else None

    models = (run.model, run.reference.zoo_model)
    return [model.get_submodule(unit)[0].register_forward_hook(without_bias) for model in models]


def _check_unsharded(run: _Run, unit: str, where: str) -> None:
    """`unit` registers its unsharded parameters, equal to the reference's full ones."""
    layout = run.layout(unit)
    if layout != "unsharded":
        message = f"{where}: the parameters of {unit} are {layout}, not unsharded"
        run.fail(message, NOT_IN_LAYOUT, offenders=1, seen=layout)
    reference = dict(run.reference.zoo_model.get_submodule(unit).named_parameters())
    held = dict(run.units[unit].named_parameters())
    message = f"{run.label}: {where}: the parameters of {unit}"
    training.check_same_values(message, PARAMETERS_DIFFER, held, reference, TOL)


def _check_separate_group(run: _Run, phase: str, shared: Any, bounds: tuple[int, int]) -> None:
    """The reduce-scatters of `phase` off the all-gather group `shared` number within `bounds`,
    each on a group of the same ranks."""
    others = [
        group
        for where, op, group in run.collectives
        if where == phase and op == Op.REDUCE_SCATTER and group is not shared
    ]
    ranks = tdist.get_process_group_ranks(shared)
    strangers = [g for g in others if tdist.get_process_group_ranks(g) != ranks]
    low, high = bounds
    if strangers or not low <= len(others) <= high:
        message = (
            f"{phase}: {len(others)} reduce-scatter(s) on a group other than the all-gather "
            f"group (over ranks {[tdist.get_process_group_ranks(g) for g in others]}); the "
            f"separate reduce-scatter group enabled promises {low} to {high}, over {ranks}"
        )
        excess = max(len(others) - high, low - len(others), len(strangers))
        run.fail(message, PATTERN_BROKEN, excess=excess)


def _check_comm(run: _Run, phase: str, comm: _Comm, calls: list, op: Any) -> None:
    """`comm` (a custom collective) ran in `phase`, with reduce op `op`, on its own buffers."""
    wrong = [(str(used), ours) for used, ours in calls if used != op or not ours]
    if not calls or wrong:
        message = f"{phase}: the custom collective of {comm.label} ran {len(calls)} time(s); "
        message += f"calls with another op than {op} or buffers not from its allocate(): {wrong}"
        run.fail(message, CUSTOM_COMM_UNUSED, offenders=len(wrong) + (not calls))


def _event(run: _Run, what: str, label: str) -> None:
    run.events.append((run.phase, what, label))


def _on_backward(run: _Run, label: str, output: torch.Tensor) -> None:
    output.register_hook(lambda grad: _event(run, "backward", label))


def _check_comms_carry_all_gathers(run: _Run, phase: str, comms: dict[str, _Comm]) -> None:
    """`phase` all-gathered through the units' custom all-gathers, every all-gather did, each on
    buffers from its comm's ``allocate``."""
    foreign = {unit: sum(not ours for _, ours in comm.calls) for unit, comm in comms.items()}
    through = [e for e in run.events if str(e[0]).startswith(phase) and e[1] == Op.ALL_GATHER]
    if run.outside_comm or any(foreign.values()) or not through:
        message = (
            f"{phase}: {run.outside_comm} all-gather(s) issued outside the custom all-gathers "
            f"set on every unit, {len(through)} through them; calls on buffers not from their "
            f"allocate(): {foreign}"
        )
        offenders = run.outside_comm + sum(foreign.values()) + (not through)
        run.fail(message, CUSTOM_COMM_UNUSED, offenders=offenders)


def _check_order(run: _Run, phase: str, first: tuple, listed: tuple, marker: str) -> None:
    """In `phase`, the all-gathers of `first`, then of `listed` in list order, all before
    `marker` (``"compute <unit>"``: its forward starts; ``"backward <unit>"``: its backward)."""
    seen = [f"{what} {label}" for where, what, label in run.events if where == phase]
    positions = [
        seen.index(item) if item in seen else len(seen)
        for item in [*(f"all_gather {unit}" for unit in (*first, *listed)), marker]
    ]
    if positions != sorted(positions) or len(set(positions)) < len(positions):
        message = f"{phase}: the prefetch list {list(listed)} promises their all-gathers in that "
        message += f"order before {marker!r}; seen: {seen}"
        offenders = sum(p >= positions[-1] for p in positions[:-1])
        run.fail(message, "prefetch out of the promised order", offenders=offenders)


class TestFSDP2Module(BaseFSDP2ModuleTests): ...
