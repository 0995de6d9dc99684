"""Run one ``FuzzCase`` in a rank: the DDP reference, then the FSDP run through the adapter,
compared ([Note: the property]).

[Note: the property]
The FSDP run and a DDP run of the same program (``find_unused_parameters=True``, SGD with
momentum, the same data) must give the same losses, clip norms and final full parameters,
legal training states at every hook, and no hang. Compared within ``ATOL`` / ``RTOL``: for
arbitrary shapes the optimizer's vectorised kernels round an element differently depending on
its position (1 ulp measured), clipping sums shard norms, FSDP reduces micro-batches one by one;
real bugs move values by 1e-2 and more. ``UnsupportedFeatureError`` anywhere, or any exception
from ``adapter.wrap``, makes the case *unsupported*; a failure the adapter declares for
``fuzz.generated`` is a *deviation*; anything else is a *failure*. Both runs zero gradients
with ``set_to_none=False`` (flat parameters cannot tell zero from none).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import traceback
from typing import Any

import torch
from torch import nn

from fsdp_conformance.adapters import UnsupportedFeatureError
from fsdp_conformance.adapters import deviations as adapter_deviations
from fsdp_conformance.checks import CheckFailure
from fsdp_conformance.suite import training
from fsdp_conformance.suite.training import Driver

from .model import build_model, make_batch, unpack
from .spec import Block, FuzzCase, iter_nodes

# The comparison's tolerance ([Note: the property]); at world size > 2 at least the suite's
ATOL = 1e-6
RTOL = 1e-5
CHECK_ID = "fuzz.generated"
# the failure of a run whose first difference follows a gradient gone None ([Note: the property])
NONE_GRADIENT = "a gradient is None where DDP's is zero"
PRECISION_LAYERS = 4  # the layer count [Note: precision tolerances] derives its bounds for

OK, UNSUPPORTED, DEVIATION, FAIL = "ok", "unsupported", "deviation", "FAIL"


@dataclasses.dataclass
class Outcome:
    """What one rank (or, combined, all ranks) saw for one case."""

    kind: str  # OK, UNSUPPORTED, DEVIATION or FAIL
    message: str = ""  # the first difference / error / refusal / declared reason


@dataclasses.dataclass
class Trace:
    """What a run produced: named scalars in program order, full parameters, and per step
    (before its optimizer step) how many values were recorded, the registered parameters
    holding a gradient and those whose gradient is all zeros."""

    values: list[tuple[str, float]]
    params: dict[str, torch.Tensor]
    steps: list[tuple[int, set[str], set[str]]] = dataclasses.field(default_factory=list)


def run_program(driver: Driver, case: FuzzCase, dist: Any, after_step: Any = None) -> Trace:
    """The case's program through ``driver`` (the DDP reference, or the FSDP root through its
    adapter): the named losses and norms in program order, and the full parameters."""
    values: list[tuple[str, float]] = []
    steps: list[tuple[int, set[str], set[str]]] = []
    program = case.program
    forwards = itertools.count()  # every forward gets its own batch

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        index = next(forwards)
        return make_batch(
            case.model, program.batch, program.data_seed, dist.rank, index, dist.device
        )

    def loss(output: Any) -> torch.Tensor:
        return unpack(output).float().pow(2).mean()

    for step_index, step in enumerate(program.steps):
        driver.zero_grad(set_to_none=False)
        forward = lambda _, it=step_index: loss(driver.model(*batch(), it))
        losses = driver.accumulate(step.micro, forward)
        for micro_index, value in enumerate(losses):
            values.append((f"step {step_index} micro-batch {micro_index} loss", value.item()))
        if step.clip is not None:
            values.append((f"step {step_index} total grad norm", float(driver.clip(step.clip))))
        grads = {name: p.grad for name, p in driver.model.named_parameters() if p.grad is not None}
        zeros = set() if driver.adapter else {n for n, grad in grads.items() if not grad.any()}
        steps.append((len(values), set(grads), zeros))
        driver.step()
        if after_step is not None:
            after_step()
        if step.round_trip:
            driver.round_trip()
        if step.eval:
            output = driver.eval_forward(*batch(), step_index)
            values.append((f"step {step_index} eval loss", loss(output).item()))
    return Trace(values, driver.params(), steps)


def reference_run(case: FuzzCase, dist: Any) -> Trace:
    """The unwrapped model under DDP (the reference)."""
    model = build_model(case.model, dist.device)
    ddp = nn.parallel.DistributedDataParallel(
        model, process_group=dist.group, find_unused_parameters=True
    )
    return run_program(Driver(ddp, model, dist.device), case, dist)


class RefusedAtWrap(Exception):
    """``adapter.wrap`` raised: the implementation refused the model or config at wrap time."""


def fsdp_wrap(adapter: Any, case: FuzzCase, dist: Any) -> tuple[nn.Module, nn.Module]:
    """The case's model wrapped as the plan says (nested instances innermost first, then the
    root): (root, the model); RefusedAtWrap when a wrap raises."""
    config = case.wrap_config
    try:
        model = build_model(case.model, "meta" if case.meta else "cpu")
        for path in sorted(case.plan, key=lambda p: (-p.count("."), p)):
            parent_path, _, attribute = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            wrapped = adapter.wrap(getattr(parent, attribute), root=False, **config)
            if isinstance(parent, nn.ModuleList):
                parent[int(attribute)] = wrapped
            else:
                setattr(parent, attribute, wrapped)
        root = adapter.wrap(model, root=True, **config)
    except UnsupportedFeatureError:
        raise
    except Exception as error:
        raise RefusedAtWrap(f"{type(error).__name__}: {error}") from error
    return (root if dist.device.type == "cpu" else root.to(dist.device)), model


def fsdp_train(adapter: Any, root: nn.Module, model: nn.Module, case: FuzzCase, dist: Any) -> Trace:
    """Train the wrapped ``root`` of ``model`` through ``adapter`` (states recorded where it
    has them); a meta-device case is materialised and loaded with the CPU build's weights
    first."""
    if case.meta:
        adapter.materialize(root, device=dist.device)
        weights = build_model(case.model, dist.device).state_dict()
        adapter.load_state_dict(root, weights)
    driver = Driver(root, model, dist.device, adapter)
    recorder = _recorder(adapter, root)
    with recorder or contextlib.nullcontext():
        trace = run_program(driver, case, dist, recorder and recorder.after_step)
    if recorder is not None:
        recorder.assert_legal()
    return trace


def _recorder(adapter: Any, root: nn.Module) -> Any:
    if not adapter.declarations.instance_states:
        return None
    from fsdp_conformance.observe.states import TrainingStateRecorder

    try:
        instances = adapter.instances(root)
        if instances:
            adapter.training_state(instances[0])
    except NotImplementedError:
        return None
    except ValueError:
        pass  # a parameter-free instance keeps no state; others may
    return TrainingStateRecorder(adapter, root)


def tolerance(case: FuzzCase, world_size: int) -> tuple[float, float]:
    """(atol, rtol) of the comparison ([Note: the property]). With a mixed-precision policy,
    the suite's precision tolerance for its coarsest dtype (suite/test_precision.py [Note:
    precision tolerances]): parameters within ``PARAM_ATOL_PER_EPS * eps``, losses and norms
    ``LOSS_RTOL_PER_EPS * eps``, scaled by layers / ``PRECISION_LAYERS`` for deeper models (a
    twice-called block counts twice, the head once)."""
    from fsdp_conformance.suite.test_parity import tolerance as parity_tolerance
    from fsdp_conformance.suite.test_precision import EPS, LOSS_RTOL_PER_EPS, PARAM_ATOL_PER_EPS

    atol, rtol = parity_tolerance(world_size)
    atol, rtol = max(atol, ATOL), max(rtol, RTOL)
    policy = case.wrap_config.get("mixed_precision", {}).values()
    low = [EPS[dtype] for dtype in policy if dtype in EPS]
    if low:
        layers = 1 + sum(
            (node.kind == "twice") + (node.kind != "act")
            for node in iter_nodes(case.model.body)
            if isinstance(node, Block)
        )
        eps = max(low) * max(1.0, layers / PRECISION_LAYERS)
        atol, rtol = max(atol, PARAM_ATOL_PER_EPS * eps), max(rtol, LOSS_RTOL_PER_EPS * eps)
    return atol, rtol


def first_difference(
    case: FuzzCase, actual: Trace, expected: Trace, world_size: int
) -> CheckFailure | None:
    """The first difference of the FSDP run from the reference ([Note: the property]), or
    None: "parameter names differ from DDP's", ``NONE_GRADIENT`` when it follows a step in
    which a gradient went None where DDP's are zeros, else "training differs from DDP's" with
    ``training.training_gaps`` (losses: every recorded value)."""
    if (names := training.names_failure("", actual.params, expected.params)) is not None:
        return names
    atol, rtol = tolerance(case, world_size)
    found = _difference(case, actual, expected, atol, rtol)
    if found is None:
        return None
    difference, at = found
    if (none_gradient := _none_gradient(actual, expected, at)) is not None:
        return CheckFailure(f"{none_gradient}; then {difference}", NONE_GRADIENT)
    runs = [
        training.TrainingResult(torch.tensor([v for _, v in t.values]), t.params)
        for t in (actual, expected)
    ]
    return CheckFailure(difference, training.TRAINING_DIFFERS, **training.training_gaps(*runs))


def _difference(
    case: FuzzCase, actual: Trace, expected: Trace, atol: float, rtol: float
) -> tuple[str, int] | None:
    """The first difference in words, and the index of the first differing value (the number
    of values when none differs); or None."""
    how = f"atol={atol:g}, rtol={rtol:g}"  # never 0: at least ATOL / RTOL
    close = functools.partial(torch.allclose, atol=atol, rtol=rtol, equal_nan=True)
    for index, ((name, value), (_, reference)) in enumerate(zip(actual.values, expected.values)):
        if not close(torch.tensor(value), torch.tensor(reference)):
            return f"{name}: FSDP {value!r} != DDP {reference!r} ({how})", index
    count = len(actual.values)
    if count != len(expected.values):
        return f"FSDP recorded {count} values, DDP {len(expected.values)}", count
    for name, reference in expected.params.items():
        value = actual.params[name].detach().float().cpu()
        reference = reference.detach().float().cpu()
        if value.shape != reference.shape:
            shapes = f"{tuple(value.shape)} != DDP's {tuple(reference.shape)}"
            return f"parameter {name!r}: shape {shapes}", count
        if not close(value, reference):
            worst = (value - reference).abs().flatten().argmax().item()
            return (
                f"parameter {name!r} after {len(case.program.steps)} steps differs from DDP's "
                f"({how}): max |difference| {(value - reference).abs().max().item():.3g} at flat "
                f"index {worst} (FSDP {value.flatten()[worst].item()!r}, DDP "
                f"{reference.flatten()[worst].item()!r})"
            ), count
    return None


def _none_gradient(actual: Trace, expected: Trace, at: int) -> str | None:
    """In words, the first step whose optimizer step precedes the value at index ``at``, in
    which a registered FSDP parameter that had a gradient has none while DDP's gradients are
    all there, some all zeros (SGD's momentum then moves DDP's parameter, not FSDP's); or
    None."""
    had_fsdp, had_ddp = set(), set()  # the parameters that had a gradient
    for step, (fsdp, ddp) in enumerate(zip(actual.steps, expected.steps)):
        (recorded, fsdp_grads, _), (_, ddp_grads, ddp_zeros) = fsdp, ddp
        if recorded > at:
            break
        vanished = had_fsdp - fsdp_grads
        if vanished and ddp_zeros and had_ddp <= ddp_grads:
            return (
                f"after step {step}'s backward the FSDP parameters {sorted(vanished)} have no "
                f"gradient (None) where DDP's {sorted(ddp_zeros)} are zeros"
            )
        had_fsdp |= fsdp_grads
        had_ddp |= ddp_grads
    return None


def run_case(adapter: Any, case: FuzzCase, dist: Any) -> Outcome:
    """This rank's outcome of ``case`` ([Note: the property]). Collective: every rank calls it.

    The FSDP wrap comes first (a refusal costs no reference run), then the DDP reference (no
    FSDP collective is in flight), then the FSDP training.
    """
    try:
        root, model = fsdp_wrap(adapter, case, dist)
    except (UnsupportedFeatureError, RefusedAtWrap) as refusal:
        return Outcome(UNSUPPORTED, str(refusal))
    try:
        expected = reference_run(case, dist)
    except Exception as raised:  # noqa: BLE001  a case DDP cannot run is the generator's bug
        return Outcome(
            FAIL,
            "the DDP reference run failed (a bug of the generator, not of the "
            "FSDP): " + "".join(traceback.format_exception(raised)).rstrip(),
        )
    try:
        actual = fsdp_train(adapter, root, model, case, dist)
        difference = first_difference(case, actual, expected, dist.world_size)
        if difference is None:
            return Outcome(OK)
        error: BaseException = difference
    except UnsupportedFeatureError as refusal:
        return Outcome(UNSUPPORTED, str(refusal))
    except Exception as raised:  # noqa: BLE001  any other exception is a failure (or declared)
        error = raised
    deviation = adapter_deviations.find_deviation(adapter, CHECK_ID, case, error)
    if deviation is not None:
        lines = str(error).strip().splitlines()
        headline = f"{type(error).__name__}: {lines[0] if lines else ''}"
        return Outcome(DEVIATION, f"{headline} -- declared: {deviation.reason}")
    if isinstance(error, AssertionError) and error.__traceback__ is None:
        return Outcome(FAIL, str(error))
    return Outcome(FAIL, "".join(traceback.format_exception(error)).rstrip())


def probe_capabilities(adapter: Any, dist: Any) -> Any:
    """Collective: the adapter's capabilities, less ``no_sync`` / ``clip_grad_norm_`` when they
    raise ``UnsupportedFeatureError`` on a wrapped ``Linear(2, 2)`` (declared but refused by
    the root), so the generator does not draw cases refused only after a whole run."""
    from fsdp_conformance.adapters import Feature

    from .strategies import Capabilities

    caps = Capabilities.of(adapter, dist.world_size)
    supported = set(caps.supported)
    generator = torch.Generator().manual_seed(0)
    try:
        root = adapter.wrap(nn.Linear(2, 2), root=True)
        root(torch.randn(2, 2, generator=generator).to(dist.device)).sum().backward()
    except Exception:  # noqa: BLE001  the cases themselves will show what fails
        return caps
    probes = (
        (Feature.GRADIENT_ACCUMULATION, lambda: adapter.no_sync(root).__enter__()),
        (Feature.CLIP_GRAD_NORM, lambda: adapter.clip_grad_norm_(root, 1.0)),
    )
    for feature, probe in probes:
        if feature not in supported:
            continue
        try:
            probe()
        except UnsupportedFeatureError:
            supported.discard(feature)
        except Exception:  # noqa: BLE001  not a refusal: keep drawing it, the cases judge it
            pass
    return dataclasses.replace(caps, supported=frozenset(supported))


def combine(outcomes: list[Outcome]) -> Outcome:
    """The verdict of all ranks' outcomes (rank order)."""
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o.kind == FAIL]
    if failed:
        rank, outcome = failed[0]
        others = [r for r, _ in failed[1:]]
        also = f" (also failed: ranks {others})" if others else ""
        return Outcome(FAIL, f"rank {rank} of {len(outcomes)}{also}: {outcome.message}")
    if len({o.kind for o in outcomes}) > 1:
        detail = "; ".join(
            f"rank {r}: {o.kind} {o.message}".strip() for r, o in enumerate(outcomes)
        )
        return Outcome(FAIL, f"the ranks disagree about this case: {detail}")
    return outcomes[0]
