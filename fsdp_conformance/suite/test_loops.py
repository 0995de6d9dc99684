"""The training loops real FSDP users run, each checked against DDP doing the same thing
(``loops.*``; tolerances: [Note: loop tolerances] in loop_driver.py). Subclass the base
classes like the others; every test body runs in every rank:

- ``BaseGradientAccumulationTests``: k micro-batches without gradient synchronisation, then one
  with it (the adapter's ``no_sync``), and accumulation with synchronisation every micro-batch.
- ``BaseGradientClippingTests``: ``adapter.clip_grad_norm_`` against DDP +
  ``torch.nn.utils.clip_grad_norm_`` (norm types 2 and inf).
- ``BaseFrozenParameterTests``: a whole wrapped block frozen; frozen and trainable parameters
  in one instance.
- ``BaseActivationCheckpointingTests``: non-reentrant ``torch.utils.checkpoint`` inside wrapped
  blocks.
- ``BaseForwardVariantsTests``: a branch unused in some iterations, two forwards before one
  backward, an evaluation forward under ``torch.no_grad()`` between steps.
- ``BaseCheckpointResumeTests``: save with Adam after n steps, load into a freshly wrapped model
  (same world size, 2 -> 1, 1 -> 2), m more steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from fsdp_conformance.adapters import Adapter, Feature, UnsupportedFeatureError, clean_param_name
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters import loop as adapter_loop
from fsdp_conformance.constants import Op
from fsdp_conformance.models import CheckpointedModule
from fsdp_conformance.observe.comm_trace import CommTrace
from fsdp_conformance.observe.states import IllegalTrainingState, TrainingStateRecorder

from . import training, zoo
from .declare import check
from .loop_driver import (
    CLIP_NORM_RTOL,
    CLIP_PARAM_TOL,
    CLIP_STEPS,
    STRATEGIES,
    SYNC_EVERY_TOL,
    Driver,
    LoopCase,
    accumulate_steps,
    assert_losses,
    assert_params,
    average_gradients,
    build,
    build_reference,
    ddp_optimizer,
    fsdp_optimizer,
    micro_input,
    parametrize,
    reductions_per_label,
    steps_from,
    trainable_labels,
)


# ---------------------------------------------------------------------------- 1. accumulation
class BaseGradientAccumulationTests:
    """Gradient accumulation: ``MICRO_BATCHES`` micro-batches per step, all but the last inside
    the adapter's ``no_sync`` (FSDP1/impl/fairscale ``no_sync()``, FSDP2
    ``set_requires_gradient_sync(False)``), against DDP's ``no_sync``; and the same with
    synchronisation on every micro-batch. Losses and full parameters bit-exact; the comm trace
    shows no gradient reduction inside ``no_sync`` and, on every synchronising micro-batch, every
    instance with trainable parameters reduced, at most once per all-gather of it ([Note:
    counts as bounds] in comm_checks.py)."""

    MICRO_BATCHES: ClassVar[int] = 3
    STEPS: ClassVar[int] = 2
    # what the cells run (a subclass may trim them)
    models: ClassVar[tuple[str, ...]] = ("nested", "loops")
    strategies: ClassVar[tuple[str, ...]] = STRATEGIES
    syncs: ClassVar[tuple[str, ...]] = ("no_sync", "sync_every")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        parametrize(metafunc, model_name=self.models, strategy=self.strategies, sync=self.syncs)

    @check(
        "loops.grad_accumulation",
        "gradient accumulation (micro-batches under no_sync, or synchronising each) matches DDP",
        case="suite.loop_driver.LoopCase",
        case_of=lambda model_name, strategy, sync: LoopCase(model_name, strategy, sync),
    )
    @pytest.mark.world_size(2)
    def test_accumulation_matches_ddp(
        self, fsdp_adapter: Any, dist: Any, model_name: str, strategy: str, sync: str
    ):
        adapter = fsdp_adapter
        sync_every = sync == "sync_every"
        if not sync_every:
            adapter_features.skip_unless(adapter, Feature.GRADIENT_ACCUMULATION)
        config = {"sharding_strategy": strategy}
        root, zoo_model = build(adapter, model_name, dist, config)
        driver = Driver(root, zoo_model, adapter)
        optimizer = fsdp_optimizer(adapter, root)
        losses = accumulate_steps(
            driver, optimizer, dist.device, self.STEPS, self.MICRO_BATCHES, sync_every
        )
        ddp, reference_model = build_reference(model_name, dist)
        reference = Driver(ddp, reference_model)
        reference_losses = accumulate_steps(
            reference,
            ddp_optimizer(ddp),
            dist.device,
            self.STEPS,
            self.MICRO_BATCHES,
            sync_every,
        )
        label = (
            f"adapter {adapter.name!r}, {model_name}, {strategy}, {self.MICRO_BATCHES} "
            f"micro-batches per step, {'sync on every micro-batch' if sync_every else 'no_sync'}"
        )
        # sync on every micro-batch: DDP all-reduces the gradient accumulated so far, FSDP
        # reduces each micro-batch's and adds the results ([Note: loop tolerances])
        tol = SYNC_EVERY_TOL if sync_every else 0.0
        assert_losses(label, losses, reference_losses, tol)
        assert_params(label, driver.params(), reference.params(), self.STEPS, tol, tol)

    @check(
        "loops.grad_accumulation_comm",
        "no gradient reduction while sync is off; when it is on, every trainable instance "
        "reduces, at most once per parameter gathered in its forward",
        features=("gradient_accumulation", "comm_trace"),
        case="suite.loop_driver.LoopCase",
        case_of=lambda strategy: LoopCase("loops", strategy, "no_sync"),
    )
    @pytest.mark.world_size(2)
    def test_no_reduction_while_accumulating(self, fsdp_adapter: Any, dist: Any, strategy: str):
        adapter = fsdp_adapter
        adapter_features.skip_unless(adapter, Feature.GRADIENT_ACCUMULATION, Feature.COMM_TRACE)
        root, zoo_model = build(adapter, "loops", dist, {"sharding_strategy": strategy})
        driver = Driver(root, zoo_model, adapter)
        trace = CommTrace(adapter, root)
        with trace:
            accumulate_steps(
                driver,
                fsdp_optimizer(adapter, root),
                dist.device,
                self.STEPS,
                self.MICRO_BATCHES,
                sync_every=False,
                trace=trace,
            )
        expected = {
            label for label, trains in trainable_labels(adapter, root, trace).items() if trains
        }
        failures = []
        for step in range(self.STEPS):
            for micro in range(self.MICRO_BATCHES):
                phase = f"step {step} micro {micro}"
                counts = reductions_per_label(trace, phase)
                gathers = reductions_per_label(trace, phase, (Op.ALL_GATHER,))
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
            f"adapter {adapter.name!r}, loops, {strategy}: gradient accumulation broke no_sync's "
            "promise:\n  " + "\n  ".join(failures) + "\ntrace:\n" + trace.render()
        )


# ---------------------------------------------------------------------------- 2. clipping
# model -> max_norm: below every step's unclipped global norm (asserted), so clipping scales
CLIP_MAX_NORM: dict[str, float] = {"loops_gains": 1.0, "loops_gains_no_shard": 1.0, "nested": 0.5}


def _clipping_case(model_name: str, strategy: str, norm_type: float) -> LoopCase:
    return LoopCase(model_name, strategy, "inf" if math.isinf(norm_type) else f"norm{norm_type:g}")


class BaseGradientClippingTests:
    """Clipping by the global norm: ``adapter.clip_grad_norm_(root, max_norm, norm_type)``
    returns DDP's ``torch.nn.utils.clip_grad_norm_`` total norm (rtol 1e-5) on every step, the
    norm is above ``max_norm`` on every step (clipping really scales), and after
    ``CLIP_STEPS`` SGD steps the full parameters equal DDP's within 1e-5 ([Note: loop
    tolerances]). ``loops_gains``' instances have gradients orders of magnitude apart (block
    gains 1, 40, 0.025), so a norm that misses a shard or an instance is far off;
    ``loops_gains_no_shard`` wraps one block NO_SHARD next to sharded ones. Measured (torch
    2.13.0, CPU): norm relative difference <= 2e-7, parameters <= 3e-8 (impl, FSDP1, FSDP2)."""

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
        features=("clip_grad_norm",),
        case="suite.loop_driver.LoopCase",
        case_of=_clipping_case,
    )
    @pytest.mark.world_size(2)
    def test_clipping_matches_ddp(
        self, fsdp_adapter: Any, dist: Any, model_name: str, strategy: str, norm_type: float
    ):
        adapter = fsdp_adapter
        adapter_features.skip_unless(adapter, Feature.CLIP_GRAD_NORM)
        max_norm = CLIP_MAX_NORM[model_name]
        root, zoo_model = build(adapter, model_name, dist, {"sharding_strategy": strategy})
        fsdp = _clip_run(
            Driver(root, zoo_model, adapter),
            fsdp_optimizer(adapter, root),
            dist.device,
            max_norm,
            norm_type,
        )
        ddp, reference_model = build_reference(model_name, dist)
        ref = _clip_run(
            Driver(ddp, reference_model), ddp_optimizer(ddp), dist.device, max_norm, norm_type
        )
        label = f"adapter {adapter.name!r}, {model_name}, {strategy}, norm_type={norm_type}"
        assert bool((ref[1] > max_norm).all()), (
            f"{label}: DDP's unclipped norms {ref[1].tolist()} are not all above max_norm="
            f"{max_norm}; the check would not exercise clipping (suite bug: lower CLIP_MAX_NORM)"
        )
        assert bool((fsdp[1] > max_norm).all()), (
            f"{label}: clip_grad_norm_ returned norms {fsdp[1].tolist()}, not all above "
            f"max_norm={max_norm} although DDP's are {ref[1].tolist()}"
        )
        training._assert_close(
            f"{label}: total norms returned by clip_grad_norm_ differ from DDP + "
            f"torch.nn.utils.clip_grad_norm_ (rtol={CLIP_NORM_RTOL:g})",
            fsdp[1],
            ref[1],
            0.0,
            CLIP_NORM_RTOL,
            detail=f"FSDP norms {fsdp[1].tolist()}, DDP norms {ref[1].tolist()}",
        )
        assert_losses(label, fsdp[0], ref[0], CLIP_PARAM_TOL)
        assert_params(label, fsdp[2], ref[2], CLIP_STEPS, CLIP_PARAM_TOL, CLIP_PARAM_TOL)


def _clip_run(
    driver: Driver,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    max_norm: float,
    norm_type: float,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    losses, norms = [], []
    for step in range(CLIP_STEPS):
        optimizer.zero_grad()
        inputs = micro_input(driver.zoo_model, device, step)
        loss = driver.zoo_model.get_loss(inputs, driver.model(*inputs))
        driver.backward(loss)
        norms.append(torch.as_tensor(driver.clip(max_norm, norm_type)).detach().float().cpu())
        optimizer.step()
        losses.append(loss.detach().float())
    return torch.stack(losses), torch.stack(norms), driver.params()


# ---------------------------------------------------------------------------- 3. frozen
# model -> the parameter names frozen in it (block 0 of models/loops.py)
FROZEN = {
    "loops_frozen": ("blocks.0.0.weight", "blocks.0.0.bias"),
    "loops_frozen_mixed": ("blocks.0.0.weight",),
}


class BaseFrozenParameterTests:
    """Frozen parameters: ``loops_frozen`` freezes a whole wrapped block (feature
    ``frozen_parameters``), ``loops_frozen_mixed`` only its Linear weight, next to the
    trainable bias in the same instance (``frozen_parameters_mixed``; torch FSDP1 wraps with
    ``use_orig_params=True``, which the adapter then needs). After 3 SGD+momentum steps the
    frozen parameters are bit-identical to their initial values, the others bit-identical to
    DDP's; with a whole frozen instance the comm trace shows no gradient reduction for it."""

    models: ClassVar[tuple[str, ...]] = ("loops_frozen", "loops_frozen_mixed")
    strategies: ClassVar[tuple[str, ...]] = STRATEGIES

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        parametrize(metafunc, model_name=self.models, strategy=self.strategies)

    @check(
        "loops.frozen",
        "frozen parameters stay bit-identical (none reduced), the rest trains as DDP",
        case="suite.loop_driver.LoopCase",
        case_of=lambda model_name, strategy: LoopCase(model_name, strategy, "frozen"),
    )
    @pytest.mark.world_size(2)
    def test_frozen_parameters(self, fsdp_adapter: Any, dist: Any, model_name: str, strategy: str):
        adapter = fsdp_adapter
        config: dict[str, Any] = {"sharding_strategy": strategy}
        if model_name == "loops_frozen_mixed" and adapter_features.supports(
            adapter, Feature.USE_ORIG_PARAMS
        ):
            config["use_orig_params"] = True
        traced = model_name == "loops_frozen" and adapter_features.supports(
            adapter, Feature.COMM_TRACE
        )
        root, zoo_model = build(adapter, model_name, dist, config)
        driver = Driver(root, zoo_model, adapter)
        initial = driver.params()
        trace = CommTrace(adapter, root) if traced else None
        with (
            trace or contextlib.nullcontext(),
            trace.phase("training") if trace else contextlib.nullcontext(),
        ):
            losses = accumulate_steps(
                driver, fsdp_optimizer(adapter, root), dist.device, 3, 1, True
            )
        ddp, reference_model = build_reference(model_name, dist)
        reference = Driver(ddp, reference_model)
        reference_losses = accumulate_steps(reference, ddp_optimizer(ddp), dist.device, 3, 1, True)
        label = f"adapter {adapter.name!r}, {model_name}, {strategy}"
        after = driver.params()
        for name in FROZEN[model_name]:
            assert torch.equal(after[name], initial[name]), (
                f"{label}: frozen parameter {name!r} (requires_grad=False) changed in training "
                f"by {(after[name] - initial[name]).abs().max().item():.3g}"
            )
        assert_losses(label, losses, reference_losses)
        assert_params(label, after, reference.params(), 3)
        if trace is not None:
            frozen = [
                label_
                for label_, trains in trainable_labels(adapter, root, trace).items()
                if not trains
            ]
            assert frozen, f"{label}: no instance without trainable parameters was found"
            counts = reductions_per_label(trace, "training")
            reduced = {name: counts[name] for name in frozen if counts.get(name)}
            assert not reduced, (
                f"{label}: gradients were reduced for the fully frozen instance(s) {reduced} "
                f"(reductions per instance over 3 steps: {counts})"
            )


# ---------------------------------------------------------------------------- 4. activation ckpt
class BaseActivationCheckpointingTests:
    """Non-reentrant ``torch.utils.checkpoint`` in wrapped blocks (``models.loops
    .CheckpointingWrap``): ``inside``, each wrapped block's module runs under checkpoint, so an
    instance nested inside it -- ``nested``'s inner Linear -- is recomputed during backward;
    ``outside``, checkpoint runs around each FSDP instance, whose own forward is then re-entered
    in its backward (BACKWARD_PRE -> FORWARD -> BACKWARD_PRE). 3
    SGD+momentum steps: losses and full parameters bit-exact with DDP (without checkpointing:
    the recompute repeats the same forward); every block really recomputed (its forward ran
    twice per step); the training states legal at every hook, the recompute included
    (``TrainingStateRecorder``: an instance may re-enter FORWARD from BACKWARD_PRE)."""

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
        case="suite.loop_driver.LoopCase",
        case_of=lambda model_name, strategy, placement: LoopCase(model_name, strategy, placement),
    )
    @pytest.mark.world_size(2)
    def test_activation_checkpointing(
        self, fsdp_adapter: Any, dist: Any, model_name: str, strategy: str, placement: str
    ):
        adapter = fsdp_adapter
        adapter_features.skip_unless(adapter, Feature.ACTIVATION_CHECKPOINTING)
        config = {"sharding_strategy": strategy}
        root, zoo_model = build(adapter, model_name, dist, config, checkpointing=placement)
        blocks = [m for m in root.modules() if isinstance(m, CheckpointedModule)]
        # the checkpointed module itself: checkpoint calls it in forward and in the recompute
        inner_modules = [block._checkpoint_wrapped_module for block in blocks]
        calls = {id(module): 0 for module in inner_modules}

        def count(module: nn.Module, args: Any) -> None:
            calls[id(module)] += 1

        handles = [module.register_forward_pre_hook(count) for module in inner_modules]
        recorder = TrainingStateRecorder(adapter, root)
        steps = training.STEPS
        try:
            with recorder:
                losses = training.train(
                    root,
                    zoo_model,
                    dist.device,
                    steps,
                    after_step=lambda _: recorder.after_step(),
                    adapter=adapter,
                )
        finally:
            for handle in handles:
                handle.remove()
        label = (
            f"adapter {adapter.name!r}, {model_name} with activation checkpointing {placement} "
            f"the FSDP instances, {strategy}"
        )
        recorder.assert_legal()
        # a block's module runs in its forward and in its recompute (a nested block also in
        # each recompute of the block around it: at least twice per step)
        lacking = [
            type(module).__name__ for module in inner_modules if calls[id(module)] < 2 * steps
        ]
        assert blocks and not lacking, (
            f"{label}: checkpointed blocks {lacking} ran fewer than {2 * steps} times in {steps} "
            "steps: the recompute did not happen"
        )
        reference = training.reference_run(model_name, dist)
        params = {  # names of the model without checkpointing (what DDP trained)
            clean_param_name(name, adapter_features.declared(adapter).wrapper_segments): value
            for name, value in adapter_loop.full_params(adapter, root).items()
        }
        training.assert_same_training(label, training.TrainingResult(losses, params), reference)


# ---------------------------------------------------------------------------- 5. forward variants
def _variant_case(variant: str, strategy: str) -> LoopCase:
    return LoopCase("loops_branch" if variant == "unused_branch" else "loops", strategy, variant)


class BaseForwardVariantsTests:
    """Forward variants (feature ``forward_variants``), 4 SGD+momentum steps each, bit-exact
    with the reference, training states legal at every hook (``TrainingStateRecorder``):

    - ``unused_branch``: ``loops_branch``'s wrapped branch runs in steps 0 and 2 only (on all
      ranks), against DDP with ``find_unused_parameters=True``;
    - ``two_forwards``: two forwards (two micro-batches) before one backward of the summed
      loss, against the unwrapped model with its gradients all-reduced by hand (DDP refuses a
      second forward before backward), averaged as DDP averages, within ``SYNC_EVERY_TOL``
      (an implementation may reduce once per forward: [Note: loop tolerances]); an instance may
      run its
      backward hooks once per forward here (BACKWARD_POST -> BACKWARD_PRE: torch FSDP2 does);
    - ``eval_forward``: after each step a forward under ``torch.no_grad()``, whose output must
      equal the reference's, and after which no non-root instance may hold its unsharded
      parameters (``adapter.is_unsharded``; FULL_SHARD only: SHARD_GRAD_OP keeps them by
      design)."""

    STEPS: ClassVar[int] = 4
    variants: ClassVar[tuple[str, ...]] = ("unused_branch", "two_forwards", "eval_forward")
    strategies: ClassVar[tuple[str, ...]] = STRATEGIES

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        parametrize(metafunc, variant=self.variants, strategy=self.strategies)

    @check(
        "loops.forward_variants",
        "unused branch, two forwards per backward, no_grad eval: match DDP, legal, resharded",
        features=("forward_variants",),
        case="suite.loop_driver.LoopCase",
        case_of=_variant_case,
    )
    @pytest.mark.world_size(2)
    def test_forward_variant(self, fsdp_adapter: Any, dist: Any, variant: str, strategy: str):
        adapter = fsdp_adapter
        adapter_features.skip_unless(adapter, Feature.FORWARD_VARIANTS)
        model_name = "loops_branch" if variant == "unused_branch" else "loops"
        root, zoo_model = build(adapter, model_name, dist, {"sharding_strategy": strategy})
        label = f"adapter {adapter.name!r}, {model_name}, {strategy}, {variant}"
        recorder = TrainingStateRecorder(adapter, root)
        resident: list[str] = []

        def after_eval(step: int) -> None:
            if strategy != "FULL_SHARD":
                return
            for instance in adapter.instances(root)[1:]:
                if adapter_loop.is_unsharded(adapter, instance):
                    resident.append(f"step {step}: {type(adapter.unwrap(instance)).__name__}")

        def after_step() -> None:
            try:
                recorder.after_step()  # raises on any violation so far
            except IllegalTrainingState:
                if variant != "two_forwards":
                    raise  # two_forwards: filtered below, then asserted

        with recorder:
            fsdp = _variant_run(
                Driver(root, zoo_model, adapter),
                fsdp_optimizer(adapter, root),
                dist,
                variant,
                self.STEPS,
                after_step,
                after_eval,
            )
        if variant == "two_forwards":
            # each forward's part of the graph runs its own backward through the instance, so
            # an implementation may run pre- and post-backward once per forward (torch FSDP2
            # does; FSDP1 and impl run them once): BACKWARD_POST -> BACKWARD_PRE is legal here
            recorder.violations[:] = [
                v
                for v in recorder.violations
                if not (v.previous == "BACKWARD_POST" and v.seen == "BACKWARD_PRE")
            ]
        recorder.assert_legal()
        if variant == "two_forwards":
            model, reference_model = build_reference(model_name, dist, ddp=False)
        else:
            model, reference_model = build_reference(
                model_name, dist, find_unused_parameters=variant == "unused_branch"
            )
        reference = _variant_run(
            Driver(model, reference_model),
            ddp_optimizer(model),
            dist,
            variant,
            self.STEPS,
            lambda: None,
            lambda step: None,
            manual_all_reduce=variant == "two_forwards",
        )
        if variant == "eval_forward":
            assert not resident, (
                f"{label}: after the evaluation forward under torch.no_grad() these non-root "
                f"instances still hold their unsharded parameters: {resident}"
            )
            training._assert_close(
                f"{label}: evaluation outputs differ from the reference's (bit-exact)",
                fsdp[2],
                reference[2],
                0.0,
                0.0,
            )
        # two forwards: an implementation may reduce once per forward (per parameter access)
        # and add the results, as sync_every does ([Note: loop tolerances])
        tol = SYNC_EVERY_TOL if variant == "two_forwards" else 0.0
        assert_losses(label, fsdp[0], reference[0], tol)
        assert_params(label, fsdp[1], reference[1], self.STEPS, tol, tol)


def _variant_run(
    driver: Driver,
    optimizer: torch.optim.Optimizer,
    dist: Any,
    variant: str,
    steps: int,
    after_step: Callable[[], None],
    after_eval: Callable[[int], None],
    manual_all_reduce: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    zoo_model, device = driver.zoo_model, dist.device
    losses, evals = [], []
    for step in range(steps):
        optimizer.zero_grad()
        if variant == "unused_branch":
            zoo_model.use_branch = step % 2 == 0
        inputs = micro_input(zoo_model, device, step)
        loss = zoo_model.get_loss(inputs, driver.model(*inputs))
        if variant == "two_forwards":
            second = micro_input(zoo_model, device, step + 10)
            loss = loss + zoo_model.get_loss(second, driver.model(*second))
        driver.backward(loss)
        if manual_all_reduce:
            average_gradients(zoo_model, dist.group)
        optimizer.step()
        after_step()
        losses.append(loss.detach().float())
        if variant == "eval_forward":
            with torch.no_grad():
                evals.append(driver.model(*micro_input(zoo_model, device, 100 + step)).float())
            after_eval(step)
    return torch.stack(losses), driver.params(), torch.stack(evals) if evals else torch.zeros(0)


# ---------------------------------------------------------------------------- 6. resume
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
    """Checkpoint and resume (feature ``checkpoint_resume``): train n = 2 Adam steps, save model
    and optimizer with ``adapter.save_checkpoint`` (torch FSDP1: sharded state dict and
    ``FSDP.optim_state_dict``; torch FSDP2: ``torch.distributed.checkpoint.state_dict`` + DCP;
    impl: its own ``impl/checkpoint.py``), build and wrap a fresh model with a new optimizer,
    ``adapter.load_checkpoint``, train m = 2 more steps -- at the same world size and resharded
    (2 -> 1, 1 -> 2: the other rank waits). Right after the load the full parameters must be the
    saved ones (a load that restores nothing fails here); the m steps' losses and the final
    parameters must equal DDP's n + m steps bit for bit (DDP's state carried across world sizes
    with torch's own state dicts), so a load that loses the optimizer state fails too."""

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
        adapter = fsdp_adapter
        adapter_features.skip_unless(adapter, Feature.CHECKPOINT_RESUME)
        # on every rank alike, before a world the other rank waits out (no one-rank skip)
        for method in ("save_checkpoint", "load_checkpoint"):
            if getattr(type(adapter), method) is getattr(Adapter, method):
                raise UnsupportedFeatureError(
                    adapter.name,
                    Feature.CHECKPOINT_RESUME,
                    f"the adapter does not override Adapter.{method}",
                )
        label = (
            f"adapter {adapter.name!r}, {case.model}, saved at world size {case.save_world}, "
            f"loaded at {case.load_world}"
        )
        with _shared_directory(dist) as directory, _worlds(dist) as worlds:
            fsdp = _resume_fsdp(adapter, dist, case, directory, worlds)
            reference = _resume_reference(dist, case, worlds)
        if fsdp is None:  # this rank is not in the load world
            return
        loaded, saved, losses, params = fsdp
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), (
                f"{label}: right after load_checkpoint, full parameter {name!r} differs from the "
                f"saved one by {(loaded[name] - value).abs().max().item():.3g} (the load did not "
                "restore the model)"
            )
        assert_losses(f"{label}, the {case.m} steps after the load", losses, reference[0])
        assert_params(label, params, reference[1], case.n + case.m)


@contextlib.contextmanager
def _shared_directory(dist: Any) -> Iterator[str]:
    """A fresh directory every rank sees (made by rank 0, its path sent to the others; removed
    by rank 0 at the end)."""
    import shutil
    import tempfile

    import torch.distributed as tdist

    source = tdist.get_process_group_ranks(dist.group)[0]
    path = [tempfile.mkdtemp(prefix="fsdp_resume_") if dist.rank == 0 else None]
    tdist.broadcast_object_list(path, src=source, group=dist.group)
    try:
        yield path[0]
    finally:
        if dist.rank == 0:
            shutil.rmtree(path[0], ignore_errors=True)


@contextlib.contextmanager
def _worlds(dist: Any) -> Iterator[dict[int, Any]]:
    """World size -> its process group: 2 = the test's group, 1 = global rank 0 alone."""
    import torch.distributed as tdist

    ranks = tdist.get_process_group_ranks(dist.group)
    solo = tdist.new_group([ranks[0]])
    yield {2: dist.group, 1: solo}


def _in(world: int, dist: Any) -> bool:
    return world == 2 or dist.rank == 0


def _resume_fsdp(
    adapter: Any, dist: Any, case: ResumeCase, directory: str, worlds: dict[int, Any]
) -> tuple | None:
    import torch.distributed as tdist

    saved: Any = None
    if _in(case.save_world, dist):
        root, zoo_model = build(adapter, case.model, dist, {}, group=worlds[case.save_world])
        driver = Driver(root, zoo_model, adapter)
        optimizer = fsdp_optimizer(adapter, root, "adam")
        accumulate_steps(driver, optimizer, dist.device, case.n, 1, True)
        saved = driver.params()
        adapter.save_checkpoint(root, optimizer, directory)
        del root, optimizer, driver
    box = [saved]
    tdist.broadcast_object_list(
        box, src=tdist.get_process_group_ranks(dist.group)[0], group=dist.group
    )
    saved = box[0]
    if not _in(case.load_world, dist):
        return None
    root, zoo_model = build(adapter, case.model, dist, {}, group=worlds[case.load_world])
    driver = Driver(root, zoo_model, adapter)
    optimizer = fsdp_optimizer(adapter, root, "adam")
    adapter.load_checkpoint(root, optimizer, directory)
    loaded = driver.params()
    losses = steps_from(driver, optimizer, dist.device, case.n, case.m)
    return loaded, saved, losses, driver.params()


def _resume_reference(dist: Any, case: ResumeCase, worlds: dict[int, Any]):
    """DDP (bare at world size 1): n steps at the save world, its model and Adam state carried
    (torch's state dicts, broadcast from rank 0) into the load world, m more steps."""
    import torch.distributed as tdist

    state: Any = None
    if _in(case.save_world, dist):
        ddp, model = build_reference(
            case.model, dist, group=worlds[case.save_world], ddp=case.save_world > 1
        )
        optimizer = ddp_optimizer(model, "adam")
        steps_from(Driver(ddp, model), optimizer, dist.device, 0, case.n)
        state = (model.state_dict(), optimizer.state_dict())
    box = [state]
    tdist.broadcast_object_list(
        box, src=tdist.get_process_group_ranks(dist.group)[0], group=dist.group
    )
    if not _in(case.load_world, dist):
        return None
    model_state, optimizer_state = box[0]
    model = zoo.build(case.model, worlds[case.load_world], None, dist.device).to(dist.device)
    model.load_state_dict(model_state)
    ddp = (
        nn.parallel.DistributedDataParallel(model, process_group=worlds[case.load_world])
        if case.load_world > 1
        else model
    )
    optimizer = ddp_optimizer(model, "adam")
    optimizer.load_state_dict(optimizer_state)
    losses = steps_from(Driver(ddp, model), optimizer, dist.device, case.n, case.m)
    return losses, Driver(ddp, model).params()


class TestGradientAccumulation(BaseGradientAccumulationTests):
    pass


class TestGradientClipping(BaseGradientClippingTests):
    pass


class TestFrozenParameters(BaseFrozenParameterTests):
    pass


class TestActivationCheckpointing(BaseActivationCheckpointingTests):
    pass


class TestForwardVariants(BaseForwardVariantsTests):
    pass


class TestCheckpointResume(BaseCheckpointResumeTests):
    pass
