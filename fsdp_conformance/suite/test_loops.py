"""The training loops real FSDP users run, each checked against DDP doing the same thing
(``loops.*``; tolerances: [Note: loop tolerances]): gradient accumulation, clipping, frozen
parameters, activation checkpointing, forward variants, checkpoint/resume.

[Note: loop tolerances]
Parity is bit-exact (fp32, world size 2) wherever FSDP does DDP's arithmetic in DDP's order:
accumulation under no_sync (one reduction of the local sum, as DDP's no_sync), frozen
parameters, activation checkpointing, forward variants, checkpoint/resume (measured on torch
2.13.0 for impl, torch FSDP1 and FSDP2). Clipping is not: the global norm sums squares in
another order (per shard, then across ranks), so the norm and the clip coefficient differ from
DDP's by a few ulps. Norms are compared with ``rtol = 1e-5`` (float32 sum of a few hundred
squares: at most ~2e-5, typically ~1e-6), parameters after ``CLIP_STEPS`` SGD steps with
``atol = rtol = 1e-5`` (a step moves a parameter by at most ``lr * max_norm`` = 0.01; momentum
adds up to 10 steps' worth). Synchronising every micro-batch is not bit-exact either: DDP
reduces the accumulated sum, FSDP each micro-batch's gradient and adds the averages: ``atol =
rtol = 1e-6`` (measured 3.5e-10). Two forwards before one backward get the same tolerance: an
implementation reducing once per parameter access (SimpleFSDP) adds two reduced gradients
where DDP reduces their sum.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from fsdp_conformance.adapters import Adapter, Feature, UnsupportedFeatureError
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.constants import Op
from fsdp_conformance.models import CheckpointedModule
from fsdp_conformance.observe.comm_trace import CommTrace
from fsdp_conformance.observe.states import IllegalTrainingState, TrainingStateRecorder

from . import training
from .declare import check
from .training import (
    Driver,
    LoopCase,
    assert_trained,
    average_gradients,
    build,
    by_clean_name,
    ddp_driver,
    events_per_label,
    fsdp_driver,
    micro_input,
    parametrize,
    trainable_labels,
    unsharded,
)

CLIP_NORM_RTOL = 1e-5  # [Note: loop tolerances]
CLIP_PARAM_TOL = 1e-5
CLIP_STEPS = 3
SYNC_EVERY_TOL = 1e-6
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")


class BaseGradientAccumulationTests:
    """``MICRO_BATCHES`` micro-batches per step, all but the last inside the adapter's
    ``no_sync``, or synchronising each, against DDP; the comm trace shows no reduction inside
    ``no_sync`` and, when synchronising, every trainable instance reduced at most once per
    all-gather of it ([Note: counts as bounds] in comm_checks.py)."""

    MICRO_BATCHES: ClassVar[int] = 3
    STEPS: ClassVar[int] = 2
    models: ClassVar[tuple[str, ...]] = ("nested", "loops")
    strategies: ClassVar[tuple[str, ...]] = STRATEGIES
    syncs: ClassVar[tuple[str, ...]] = ("no_sync", "sync_every")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        parametrize(metafunc, model_name=self.models, strategy=self.strategies, sync=self.syncs)

    @check(
        "loops.grad_accumulation",
        "gradient accumulation (micro-batches under no_sync, or synchronising each) matches DDP",
        api=("FullyShardedDataParallel.no_sync()",),  # torch-fsdp1: the root's no_sync()
        case="suite.training.LoopCase",
        case_of=lambda model_name, strategy, sync: LoopCase(model_name, strategy, sync),
    )
    @pytest.mark.world_size(2)
    def test_accumulation_matches_ddp(
        self, fsdp_adapter: Any, dist: Any, model_name: str, strategy: str, sync: str
    ):
        sync_every = sync == "sync_every"
        if not sync_every:
            adapter_features.skip_unless(fsdp_adapter, Feature.GRADIENT_ACCUMULATION)
        options = {"micro_batches": self.MICRO_BATCHES, "sync_every": sync_every}
        driver = fsdp_driver(fsdp_adapter, model_name, dist, {"sharding_strategy": strategy})
        losses = driver.run(self.STEPS, **options)
        reference = ddp_driver(model_name, dist)
        label = (
            f"adapter {fsdp_adapter.name!r}, {model_name}, {strategy}, {self.MICRO_BATCHES} "
            f"micro-batches per step, {'sync on every micro-batch' if sync_every else 'no_sync'}"
        )
        tol = SYNC_EVERY_TOL if sync_every else 0.0  # [Note: loop tolerances]
        expected = (reference.run(self.STEPS, **options), reference.params())
        assert_trained(label, (losses, driver.params()), expected, self.STEPS, tol)

    @check(
        "loops.grad_accumulation_comm",
        "no gradient reduction while sync is off; when it is on, every trainable instance "
        "reduces, at most once per parameter gathered in its forward",
        features=("gradient_accumulation", "comm_trace"),
        case="suite.training.LoopCase",
        case_of=lambda strategy: LoopCase("loops", strategy, "no_sync"),
    )
    @pytest.mark.world_size(2)
    def test_no_reduction_while_accumulating(self, fsdp_adapter: Any, dist: Any, strategy: str):
        driver = fsdp_driver(fsdp_adapter, "loops", dist, {"sharding_strategy": strategy})
        trace = CommTrace(fsdp_adapter, driver.model)
        with trace:
            phase = lambda step, micro: trace.phase(f"step {step} micro {micro}")
            driver.run(self.STEPS, micro_batches=self.MICRO_BATCHES, sync_every=False, phase=phase)
        labels = trainable_labels(fsdp_adapter, driver.model, trace)
        expected = {label for label, trains in labels.items() if trains}
        failures = []
        for step in range(self.STEPS):
            for micro in range(self.MICRO_BATCHES):
                phase = f"step {step} micro {micro}"
                counts = events_per_label(trace, phase)
                gathers = events_per_label(trace, phase, (Op.ALL_GATHER,))
                if micro < self.MICRO_BATCHES - 1:
                    if counts:
                        failures.append(f"{phase} (inside no_sync): gradient reductions {counts}")
                elif set(counts) != expected or any(
                    n > max(1, gathers.get(label, 0)) for label, n in counts.items()
                ):
                    failures.append(
                        f"{phase} (synchronising): gradient reductions {counts}; expected "
                        f"each of {sorted(expected)} reduced, at most once per all-gather "
                        f"of it ({gathers}; [Note: counts as bounds] in comm_checks.py)"
                    )
        assert not failures, (
            f"adapter {fsdp_adapter.name!r}, loops, {strategy}: gradient accumulation broke "
            "no_sync's promise:\n  " + "\n  ".join(failures) + "\ntrace:\n" + trace.render()
        )


# model -> max_norm: below every step's unclipped global norm (asserted), so clipping scales
CLIP_MAX_NORM: dict[str, float] = {"loops_gains": 1.0, "loops_gains_no_shard": 1.0, "nested": 0.5}


def _clipping_case(model_name: str, strategy: str, norm_type: float) -> LoopCase:
    return LoopCase(model_name, strategy, "inf" if math.isinf(norm_type) else f"norm{norm_type:g}")


class BaseGradientClippingTests:
    """``adapter.clip_grad_norm_`` returns DDP's total norm on every step, above ``max_norm``,
    and trains as DDP; ``loops_gains``' gradients are orders of magnitude apart, so a norm
    missing a shard or an instance is far off. Measured: norms within 2e-7 (relative),
    parameters within 3e-8 (impl, FSDP1, FSDP2; torch 2.13.0)."""

    models: ClassVar[tuple[str, ...]] = ("loops_gains", "loops_gains_no_shard", "nested")
    strategies: ClassVar[tuple[str, ...]] = STRATEGIES
    norm_types: ClassVar[tuple[float, ...]] = (2.0, math.inf)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        parametrize(
            metafunc, model_name=self.models, strategy=self.strategies, norm_type=self.norm_types
        )

    @check(
        "loops.clipping",
        "clip_grad_norm_ returns DDP's global norm (2, inf), really clips, and trains as DDP",
        api=(  # torch-fsdp1: the root's clip_grad_norm_(max_norm, norm_type)
            "FullyShardedDataParallel.clip_grad_norm_()",
            "FullyShardedDataParallel.clip_grad_norm_(max_norm)",
            "FullyShardedDataParallel.clip_grad_norm_(norm_type)",
        ),
        features=("clip_grad_norm",),
        case="suite.training.LoopCase",
        case_of=_clipping_case,
    )
    @pytest.mark.world_size(2)
    def test_clipping_matches_ddp(
        self, fsdp_adapter: Any, dist: Any, model_name: str, strategy: str, norm_type: float
    ):
        max_norm = CLIP_MAX_NORM[model_name]
        driver = fsdp_driver(fsdp_adapter, model_name, dist, {"sharding_strategy": strategy})
        losses, norms, params = _clip_run(driver, max_norm, norm_type)
        reference = ddp_driver(model_name, dist)
        ref_losses, ref_norms, ref_params = _clip_run(reference, max_norm, norm_type)
        label = f"adapter {fsdp_adapter.name!r}, {model_name}, {strategy}, norm_type={norm_type}"
        assert bool((ref_norms > max_norm).all()), (
            f"{label}: DDP's unclipped norms {ref_norms.tolist()} are not all above max_norm="
            f"{max_norm}; the check would not exercise clipping (suite bug: lower CLIP_MAX_NORM)"
        )
        assert bool((norms > max_norm).all()), (
            f"{label}: clip_grad_norm_ returned norms {norms.tolist()}, not all above "
            f"max_norm={max_norm} although DDP's are {ref_norms.tolist()}"
        )
        message = (
            f"{label}: total norms returned by clip_grad_norm_ differ from DDP + "
            f"torch.nn.utils.clip_grad_norm_ (rtol={CLIP_NORM_RTOL:g})"
        )
        detail = f"FSDP norms {norms.tolist()}, DDP norms {ref_norms.tolist()}"
        training.assert_close(message, norms, ref_norms, 0.0, CLIP_NORM_RTOL, detail=detail)
        expected = (ref_losses, ref_params)
        assert_trained(label, (losses, params), expected, CLIP_STEPS, CLIP_PARAM_TOL)


def _clip_run(driver: Driver, max_norm: float, norm_type: float) -> tuple[Any, Any, dict]:
    """(losses, the norms clip returned, full parameters) of ``CLIP_STEPS`` steps."""
    norms = []

    def clip(step: int) -> None:
        norms.append(torch.as_tensor(driver.clip(max_norm, norm_type)).detach().float().cpu())

    losses = driver.run(CLIP_STEPS, after_backward=clip)
    return losses, torch.stack(norms), driver.params()


# model -> the parameter names frozen in it (block 0 of models/loops.py)
FROZEN = {
    "loops_frozen": ("blocks.0.0.weight", "blocks.0.0.bias"),
    "loops_frozen_mixed": ("blocks.0.0.weight",),
}


class BaseFrozenParameterTests:
    """``loops_frozen`` freezes a whole wrapped block, ``loops_frozen_mixed`` only its weight,
    next to the trainable bias in one instance (torch FSDP1 needs ``use_orig_params=True``).
    Frozen parameters stay bit-identical, the others match DDP; a whole frozen instance
    reduces no gradient (comm trace)."""

    models: ClassVar[tuple[str, ...]] = ("loops_frozen", "loops_frozen_mixed")
    strategies: ClassVar[tuple[str, ...]] = STRATEGIES

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        parametrize(metafunc, model_name=self.models, strategy=self.strategies)

    @check(
        "loops.frozen",
        "frozen parameters stay bit-identical (none reduced), the rest trains as DDP",
        case="suite.training.LoopCase",
        case_of=lambda model_name, strategy: LoopCase(model_name, strategy, "frozen"),
        api=("FullyShardedDataParallel(use_orig_params=True)",),
    )
    @pytest.mark.world_size(2)
    def test_frozen_parameters(self, fsdp_adapter: Any, dist: Any, model_name: str, strategy: str):
        config: dict[str, Any] = {"sharding_strategy": strategy}
        supports = adapter_features.supports
        if model_name == "loops_frozen_mixed" and supports(fsdp_adapter, Feature.USE_ORIG_PARAMS):
            config["use_orig_params"] = True
        traced = model_name == "loops_frozen" and supports(fsdp_adapter, Feature.COMM_TRACE)
        driver = fsdp_driver(fsdp_adapter, model_name, dist, config)
        initial = driver.params()
        trace = CommTrace(fsdp_adapter, driver.model) if traced else None
        phase = trace.phase("training") if trace else contextlib.nullcontext()
        with trace or contextlib.nullcontext(), phase:
            losses = driver.run(3)
        reference = ddp_driver(model_name, dist)
        reference_losses = reference.run(3)
        label = f"adapter {fsdp_adapter.name!r}, {model_name}, {strategy}"
        after = driver.params()
        for name in FROZEN[model_name]:
            assert torch.equal(after[name], initial[name]), (
                f"{label}: frozen parameter {name!r} (requires_grad=False) changed in training "
                f"by {(after[name] - initial[name]).abs().max().item():.3g}"
            )
        assert_trained(label, (losses, after), (reference_losses, reference.params()), 3)
        if trace is not None:
            labels = trainable_labels(fsdp_adapter, driver.model, trace)
            frozen = [name for name, trains in labels.items() if not trains]
            assert frozen, f"{label}: no instance without trainable parameters was found"
            counts = events_per_label(trace, "training")
            reduced = {name: counts[name] for name in frozen if counts.get(name)}
            assert not reduced, (
                f"{label}: gradients were reduced for the fully frozen instance(s) {reduced} "
                f"(reductions per instance over 3 steps: {counts})"
            )


class BaseActivationCheckpointingTests:
    """Non-reentrant ``torch.utils.checkpoint`` ``inside`` each wrapped block (a nested
    instance is recomputed) or ``outside`` each instance (its forward re-entered in its
    backward): matches DDP bit for bit, every block recomputed (its forward ran twice per
    step), training states legal at every hook, the recompute included."""

    models: ClassVar[tuple[str, ...]] = ("nested", "transformer")
    strategies: ClassVar[tuple[str, ...]] = STRATEGIES
    placements: ClassVar[tuple[str, ...]] = ("inside", "outside")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        parametrize(
            metafunc, model_name=self.models, strategy=self.strategies, placement=self.placements
        )

    @check(
        "loops.activation_checkpointing",
        "activation checkpointing in wrapped blocks: recomputes, legal states, matches DDP",
        features=("activation_checkpointing",),
        case="suite.training.LoopCase",
        case_of=lambda model_name, strategy, placement: LoopCase(model_name, strategy, placement),
    )
    @pytest.mark.world_size(2)
    def test_activation_checkpointing(
        self, fsdp_adapter: Any, dist: Any, model_name: str, strategy: str, placement: str
    ):
        config = {"sharding_strategy": strategy}
        root, zoo_model = build(fsdp_adapter, model_name, dist, config, checkpointing=placement)
        blocks = [m for m in root.modules() if isinstance(m, CheckpointedModule)]
        # the checkpointed module itself: checkpoint calls it in forward and in the recompute
        inner_modules = [block._checkpoint_wrapped_module for block in blocks]
        calls: collections.Counter[nn.Module] = collections.Counter()
        for module in inner_modules:
            module.register_forward_pre_hook(lambda module, _: calls.update([module]))
        steps = training.STEPS
        with TrainingStateRecorder(fsdp_adapter, root) as recorder:
            after_step = lambda _: recorder.after_step()
            losses = training.train(
                root, zoo_model, dist.device, steps, fsdp_adapter, after_step=after_step
            )
        label = (
            f"adapter {fsdp_adapter.name!r}, {model_name} with activation checkpointing "
            f"{placement} the FSDP instances, {strategy}"
        )
        recorder.assert_legal()
        # a nested block also runs in each recompute of the block around it: at least twice
        lacking = [type(m).__name__ for m in inner_modules if calls[m] < 2 * steps]
        assert blocks and not lacking, (
            f"{label}: checkpointed blocks {lacking} ran fewer than {2 * steps} times in {steps} "
            "steps: the recompute did not happen"
        )
        # by the names of the model without checkpointing (what DDP trained)
        params = by_clean_name(fsdp_adapter, fsdp_adapter.full_params(root).items())
        training.assert_same_training(
            label, training.TrainingResult(losses, params), training.reference_run(model_name, dist)
        )


def _variant_case(variant: str, strategy: str) -> LoopCase:
    return LoopCase("loops_branch" if variant == "unused_branch" else "loops", strategy, variant)


class BaseForwardVariantsTests:
    """4 steps matching the reference with legal training states: a wrapped branch used in
    steps 0 and 2 only (``unused_branch``, vs DDP ``find_unused_parameters=True``); two forwards
    before one backward (``two_forwards``, vs gradients averaged by hand, within
    ``SYNC_EVERY_TOL``); a ``torch.no_grad()`` forward after each step (``eval_forward``: equal
    outputs, no non-root instance left unsharded with FULL_SHARD)."""

    STEPS: ClassVar[int] = 4
    variants: ClassVar[tuple[str, ...]] = ("unused_branch", "two_forwards", "eval_forward")
    strategies: ClassVar[tuple[str, ...]] = STRATEGIES

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        parametrize(metafunc, variant=self.variants, strategy=self.strategies)

    @check(
        "loops.forward_variants",
        "unused branch, two forwards per backward, no_grad eval: match DDP, legal, resharded",
        features=("forward_variants",),
        case="suite.training.LoopCase",
        case_of=_variant_case,
    )
    @pytest.mark.world_size(2)
    def test_forward_variant(self, fsdp_adapter: Any, dist: Any, variant: str, strategy: str):
        model_name = "loops_branch" if variant == "unused_branch" else "loops"
        driver = fsdp_driver(fsdp_adapter, model_name, dist, {"sharding_strategy": strategy})
        root = driver.model
        label = f"adapter {fsdp_adapter.name!r}, {model_name}, {strategy}, {variant}"
        recorder = TrainingStateRecorder(fsdp_adapter, root)
        resident: list[str] = []

        def after_eval(step: int) -> None:
            if strategy == "FULL_SHARD":
                resident.extend(unsharded(fsdp_adapter, root, step, skip_root=True))

        def after_step(step: int) -> None:
            try:
                recorder.after_step()  # raises on any violation so far
            except IllegalTrainingState:
                if variant != "two_forwards":
                    raise  # two_forwards: filtered below, then asserted

        with recorder:
            fsdp = _variant_run(driver, dist, variant, self.STEPS, after_step, after_eval)
        if variant == "two_forwards":
            # each forward's part of the graph runs its own backward through the instance:
            # pre- and post-backward may run once per forward (torch FSDP2 does)
            recorder.violations[:] = [
                v
                for v in recorder.violations
                if not (v.previous == "BACKWARD_POST" and v.seen == "BACKWARD_PRE")
            ]
        recorder.assert_legal()
        if variant == "two_forwards":
            options = {"ddp": False}
        else:
            options = {"find_unused_parameters": variant == "unused_branch"}
        expected = _variant_run(ddp_driver(model_name, dist, **options), dist, variant, self.STEPS)
        if variant == "eval_forward":
            assert not resident, (
                f"{label}: after the evaluation forward under torch.no_grad() these non-root "
                f"instances still hold their unsharded parameters: {resident}"
            )
            message = f"{label}: evaluation outputs differ from the reference's (bit-exact)"
            training.assert_close(message, fsdp[2], expected[2], 0.0, 0.0)
        # two forwards may reduce once per forward, as sync_every does ([Note: loop tolerances])
        tol = SYNC_EVERY_TOL if variant == "two_forwards" else 0.0
        assert_trained(label, fsdp[:2], expected[:2], self.STEPS, tol)


def _variant_run(
    driver: Driver,
    dist: Any,
    variant: str,
    steps: int,
    after_step: Callable[[int], None] | None = None,
    after_eval: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """(losses, full parameters, evaluation outputs) of `variant`; the reference (no adapter)
    averages the gradients of ``two_forwards`` by hand."""
    zoo_model, evals = driver.zoo_model, []

    def loss(step: int, index: int) -> torch.Tensor:
        if variant == "unused_branch":
            zoo_model.use_branch = step % 2 == 0
        value = driver.loss(index)
        return value + driver.loss(index + 10) if variant == "two_forwards" else value

    def after_backward(step: int) -> None:
        if driver.adapter is None and variant == "two_forwards":
            average_gradients(zoo_model, dist.group)

    def then(step: int) -> None:
        if after_step is not None:
            after_step(step)
        if variant == "eval_forward":
            inputs = micro_input(zoo_model, dist.device, 100 + step)
            evals.append(driver.eval_forward(*inputs).float())
            if after_eval is not None:
                after_eval(step)

    losses = driver.run(steps, loss=loss, after_backward=after_backward, after_step=then)
    return losses, driver.params(), torch.stack(evals) if evals else torch.zeros(0)


@dataclasses.dataclass(frozen=True)
class ResumeCase:
    """Save at `save_world` ranks after `n` steps, load at `load_world`, train `m` more."""

    save_world: int
    load_world: int
    model: str = "loops"
    n: int = 2
    m: int = 2

    @property
    def id(self) -> str:
        return f"{self.model}-ws{self.save_world}to{self.load_world}"


RESUME_CASES = (
    ResumeCase(2, 2),
    ResumeCase(2, 1),
    ResumeCase(1, 2),
    ResumeCase(2, 2, model="nested"),
)


class BaseCheckpointResumeTests:
    """n Adam steps, ``adapter.save_checkpoint``, a fresh model, ``adapter.load_checkpoint``
    (same world size, 2 -> 1, 1 -> 2), m more steps: the load restores the saved parameters,
    and the m steps equal DDP's (so a lost optimizer state fails too)."""

    cases: ClassVar[tuple[ResumeCase, ...]] = RESUME_CASES

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        parametrize(metafunc, case=self.cases)

    @check(
        "loops.checkpoint_resume",
        "save/load of model and optimizer (same and other world size) resumes exactly",
        features=("checkpoint_resume",),
        case="suite.test_loops.ResumeCase",
        case_of="case",
    )
    @pytest.mark.world_size(2)
    def test_checkpoint_resume(self, fsdp_adapter: Any, dist: Any, case: ResumeCase):
        # on every rank alike, before a world the other rank waits out (no one-rank skip)
        for method in ("save_checkpoint", "load_checkpoint"):
            if getattr(type(fsdp_adapter), method) is getattr(Adapter, method):
                raise UnsupportedFeatureError(
                    fsdp_adapter.name,
                    Feature.CHECKPOINT_RESUME,
                    f"the adapter does not override Adapter.{method}",
                )
        label = (
            f"adapter {fsdp_adapter.name!r}, {case.model}, saved at world size {case.save_world}, "
            f"loaded at {case.load_world}"
        )
        with _shared_directory(dist) as directory:
            worlds = _worlds(dist)
            fsdp = _resume(dist, case, worlds, fsdp_adapter, directory)
            reference = _resume(dist, case, worlds)
        if fsdp is None:  # this rank is not in the load world
            return
        loaded, saved, losses, params = fsdp
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), (
                f"{label}: right after load_checkpoint, full parameter {name!r} differs from the "
                f"saved one by {(loaded[name] - value).abs().max().item():.3g} (the load did not "
                "restore the model)"
            )
        label += f", the {case.m} steps after the load"
        assert_trained(label, (losses, params), reference[2:4], case.n + case.m)


@contextlib.contextmanager
def _shared_directory(dist: Any) -> Iterator[str]:
    """A fresh directory every rank sees (made and removed by rank 0)."""
    import shutil
    import tempfile

    path = _from_rank_0(tempfile.mkdtemp(prefix="fsdp_resume_") if dist.rank == 0 else None, dist)
    try:
        yield path
    finally:
        if dist.rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def _from_rank_0(value: Any, dist: Any) -> Any:
    """`value` of the test's rank 0, on every rank."""
    import torch.distributed as tdist

    box = [value]
    tdist.broadcast_object_list(box, group_src=0, group=dist.group)
    return box[0]


def _worlds(dist: Any) -> dict[int, Any]:
    """World size -> its process group: 2 = the test's group, 1 = global rank 0 alone."""
    import torch.distributed as tdist

    return {2: dist.group, 1: tdist.new_group([tdist.get_process_group_ranks(dist.group)[0]])}


def _resume(
    dist: Any, case: ResumeCase, worlds: dict[int, Any], adapter: Any = None, directory: str = ""
) -> tuple | None:
    """n Adam steps at the save world, saved (the adapter's checkpoint, or the DDP reference's
    state dicts) and loaded at the load world, m more steps: (loaded, saved, losses, full
    parameters); None outside the load world."""

    def driver(world: int) -> Driver:
        if adapter is None:
            return ddp_driver(
                case.model, dist, group=worlds[world], ddp=world > 1, optimizer_name="adam"
            )
        return fsdp_driver(adapter, case.model, dist, group=worlds[world], optimizer_name="adam")

    state: Any = None
    if case.save_world == 2 or dist.rank == 0:
        saving = driver(case.save_world)
        saving.run(case.n)
        if adapter is None:
            state = (saving.zoo_model.state_dict(), saving.optimizer.state_dict())
        else:
            state = saving.params()
            adapter.save_checkpoint(saving.model, saving.optimizer, directory)
        del saving
    state = _from_rank_0(state, dist)
    if case.load_world == 1 and dist.rank != 0:
        return None
    loading = driver(case.load_world)
    if adapter is None:
        loading.zoo_model.load_state_dict(state[0])
        loading.optimizer.load_state_dict(state[1])
    else:
        adapter.load_checkpoint(loading.model, loading.optimizer, directory)
    loaded = loading.params()
    losses = loading.run(case.m, start=case.n)
    return loaded, state, losses, loading.params()


class TestGradientAccumulation(BaseGradientAccumulationTests): ...


class TestGradientClipping(BaseGradientClippingTests): ...


class TestFrozenParameters(BaseFrozenParameterTests): ...


class TestActivationCheckpointing(BaseActivationCheckpointingTests): ...


class TestForwardVariants(BaseForwardVariantsTests): ...


class TestCheckpointResume(BaseCheckpointResumeTests): ...
