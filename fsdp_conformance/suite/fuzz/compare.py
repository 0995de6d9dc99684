"""Run one ``FuzzCase`` in a rank: the DDP reference, then the FSDP run through the adapter,
compared ([Note: the property]).

[Note: the property]
On N ranks, the FSDP run of a case and a DDP run of the same program (the unwrapped model under
``DistributedDataParallel(find_unused_parameters=True)``, torch's SGD with momentum, the same
per-rank data) must give
- the same losses (every micro-batch's, every evaluation forward's) and, where the program
  clips, the same total gradient norms;
- the same full parameters after the last step (``adapter.full_params``, tied ones under each
  name);
- legal training states at every hook (``TrainingStateRecorder``) when the adapter has
  per-instance states;
and no rank may hang (the harness's timeout bounds every example).
Compared within ``ATOL`` / ``RTOL``, not bit-exact as the suite's parity check on its zoo:
for arbitrary shapes the same update is not bit-identical -- the optimizer's vectorised kernels
round an element differently depending on its position in the tensor, and a flat parameter
moves every element (measured: 1 ulp, 2.98e-8, in a Linear(5, 4) weight after one step on
impl); clipping sums the norm from shards; a step with several synchronised micro-batches is
reduced per micro-batch by FSDP but as the accumulated ``param.grad`` by DDP. A real bug moves
values by far more (the mutants of tests/fuzz: 1e-2 and more).
A case the implementation refuses -- ``UnsupportedFeatureError`` anywhere (the adapter's wrap,
``no_sync``, ``clip_grad_norm_``, ...), or any exception raised by ``adapter.wrap`` itself (the
implementation's own argument checks, e.g. "mixes parameters with and without requires_grad in
one instance") -- is *unsupported*: a clear error before anything ran, not a failure, not
counted as an example. An exception in forward, backward or the optimizer step is a failure
unless declared.
A failure the adapter declares (``Deviation(check="fuzz.generated", applies=lambda case: ...)``
on ``known_deviations``, case = the ``FuzzCase``) is a *deviation*: counted, not a failure.
Anything else -- a mismatch, any other exception, a rank-dependent outcome -- is a *failure*.

Gradients are zeroed with ``zero_grad(set_to_none=False)`` in both runs: a parameter unused in a
step then gets a zero gradient in both (FSDP1-style flat parameters cannot tell a zero gradient
from none), so SGD's momentum treats it the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
from typing import Any

import torch
from torch import nn

from fsdp_conformance.adapters import UnsupportedFeatureError, clean_param_name
from fsdp_conformance.adapters import deviations as adapter_deviations
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters import loop as adapter_loop
from fsdp_conformance.suite.training import (  # the suite's SGD, both runs
    LR,
    MOMENTUM,
    adapter_backward,
)

from .model import build_model, make_batch, unpack
from .spec import Block, FuzzCase, iter_nodes

# The comparison's tolerance ([Note: the property]); at world size > 2 at least the suite's
ATOL = 1e-6
RTOL = 1e-5
CHECK_ID = "fuzz.generated"
PRECISION_LAYERS = 4  # the layer count [Note: precision tolerances] derives its bounds for

OK, UNSUPPORTED, DEVIATION, FAIL = "ok", "unsupported", "deviation", "FAIL"


@dataclasses.dataclass
class Outcome:
    """What one rank (or, combined, all ranks) saw for one case."""

    kind: str  # OK, UNSUPPORTED, DEVIATION or FAIL
    message: str = ""  # the first difference / error / refusal / declared reason


@dataclasses.dataclass
class Trace:
    """What a run produced: named scalars in program order, full parameters."""

    values: list[tuple[str, float]]
    params: dict[str, torch.Tensor]


def _train(
    model: nn.Module,
    case: FuzzCase,
    dist: Any,
    optimizer: torch.optim.Optimizer,
    no_sync: Any,
    clip: Any,
    backward: Any,
    after_step: Any = None,
    boundary: Any = None,
    round_trip: Any = None,
) -> list[tuple[str, float]]:
    values: list[tuple[str, float]] = []
    program = case.program
    forward = 0
    for step_index, step in enumerate(program.steps):
        optimizer.zero_grad(set_to_none=False)
        for micro_index, sync in enumerate(step.micro):
            x, tokens = make_batch(
                case.model, program.batch, program.data_seed, dist.rank, forward, dist.device
            )
            if boundary is not None and len(step.micro) > 1:
                boundary(micro_index == len(step.micro) - 1)
            context = contextlib.nullcontext() if sync else no_sync()
            with context:
                output = unpack(model(x, tokens, step_index))
                loss = output.float().pow(2).mean() / len(step.micro)
                backward(loss)
            values.append((f"step {step_index} micro-batch {micro_index} loss", loss.item()))
            forward += 1
        if step.clip is not None:
            norm = clip(step.clip)
            values.append((f"step {step_index} total grad norm", float(norm)))
        optimizer.step()
        if after_step is not None:
            after_step()
        if step.round_trip and round_trip is not None:
            round_trip()
        if step.eval:
            x, tokens = make_batch(
                case.model, program.batch, program.data_seed, dist.rank, forward, dist.device
            )
            with torch.no_grad():
                output = unpack(model(x, tokens, step_index))
            values.append((f"step {step_index} eval loss", output.float().pow(2).mean().item()))
            forward += 1
    return values


def reference_run(case: FuzzCase, dist: Any) -> Trace:
    """The unwrapped model under DDP (the reference)."""
    model = build_model(case.model, dist.device)
    ddp = nn.parallel.DistributedDataParallel(
        model, process_group=dist.group, find_unused_parameters=True
    )
    trainable = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=LR, momentum=MOMENTUM)
    values = _train(
        ddp,
        case,
        dist,
        optimizer,
        ddp.no_sync,
        lambda max_norm: torch.nn.utils.clip_grad_norm_(trainable, max_norm),
        lambda loss: loss.backward(),
    )
    params = {
        name: param.detach().clone()
        for name, param in model.named_parameters(remove_duplicate=False)
    }
    return Trace(values, params)


def wrap_case(adapter: Any, case: FuzzCase) -> nn.Module:
    """Build the model and wrap it as the plan says: nested instances innermost first, then the
    root (``root=True``)."""
    model = build_model(case.model, "meta" if case.meta else "cpu")
    config = case.wrap_config
    for path in sorted(case.plan, key=lambda p: (-p.count("."), p)):
        parent_path, _, attribute = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        wrapped = adapter.wrap(getattr(parent, attribute), root=False, **config)
        if isinstance(parent, nn.ModuleList):
            parent[int(attribute)] = wrapped
        else:
            setattr(parent, attribute, wrapped)
    return adapter.wrap(model, root=True, **config)


class RefusedAtWrap(Exception):
    """``adapter.wrap`` raised: the implementation refused the model or config at wrap time."""


def fsdp_wrap(adapter: Any, case: FuzzCase, dist: Any) -> nn.Module:
    """The case's model wrapped through ``adapter`` (RefusedAtWrap when the wrap raises)."""
    try:
        root = wrap_case(adapter, case)
    except UnsupportedFeatureError:
        raise
    except Exception as error:  # noqa: BLE001  any error at wrap time is a refusal
        raise RefusedAtWrap(f"{type(error).__name__}: {error}") from error
    if dist.device.type != "cpu":
        root = root.to(dist.device)
    return root


def fsdp_train(adapter: Any, root: nn.Module, case: FuzzCase, dist: Any) -> Trace:
    """Train the wrapped ``root`` through ``adapter`` (states recorded where it has them); a
    meta-device case is materialised and loaded with the CPU build's weights first."""
    if case.meta:
        adapter_loop.materialize(adapter, root, device=dist.device)
        adapter_loop.load_state_dict(
            adapter, root, build_model(case.model, dist.device).state_dict()
        )
    recorder = _recorder(adapter, root)
    optimizer = adapter_loop.optimizer(adapter, root, "sgd", lr=LR, momentum=MOMENTUM)
    with recorder if recorder is not None else contextlib.nullcontext():
        values = _train(
            root,
            case,
            dist,
            optimizer,
            lambda: adapter_loop.no_sync(adapter, root),
            lambda max_norm: adapter_loop.clip_grad_norm_(adapter, root, max_norm),
            lambda loss: _backward(adapter, root, loss),
            None if recorder is None else recorder.after_step,
            lambda last: adapter_loop.accumulation_boundary(adapter, root, last),
            lambda: adapter_loop.load_state_dict(
                adapter, root, adapter_loop.state_dict(adapter, root)
            ),
        )
    if recorder is not None:
        recorder.assert_legal()
    params = adapter_loop.full_params(adapter, root)
    params = {
        clean_param_name(name, adapter_features.declared(adapter).wrapper_segments): p
        for name, p in params.items()
    }
    return Trace(values, params)


def fsdp_run(adapter: Any, case: FuzzCase, dist: Any) -> Trace:
    """The case wrapped and trained through ``adapter``."""
    return fsdp_train(adapter, fsdp_wrap(adapter, case, dist), case, dist)


def _backward(adapter: Any, root: nn.Module, loss: torch.Tensor) -> None:
    adapter_backward(adapter, root, loss)


def _recorder(adapter: Any, root: nn.Module) -> Any:
    if not adapter_features.declared(adapter).instance_states:
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
    """(atol, rtol) of the comparison ([Note: the property]); with a mixed-precision policy,
    the suite's precision tolerance for the coarsest dtype of it (``EPS``: bf16 2**-8, fp16
    2**-11; [Note: precision tolerances] in suite/test_precision.py): parameters within
    ``PARAM_ATOL_PER_EPS * eps`` absolute, losses and norms ``LOSS_RTOL_PER_EPS * eps``
    relative (one ``allclose`` with both bounds for every value). That derivation is for about
    ``PRECISION_LAYERS`` layers rounding in param_dtype and grows linearly with their number, so
    a generated model with more layers (a twice-called block counts twice, the head once)
    scales it by layers / ``PRECISION_LAYERS``. Measured at seed 0 (torch 2.13.0, CPU): a bf16
    Linear(4, 1) + head exceeds a tenth of the tolerance (loss 1.4% off, the bound 6.25%) on
    impl, torch FSDP1 and FSDP2 alike, and stays within it."""
    from fsdp_conformance.suite.test_parity import tolerance as parity_tolerance
    from fsdp_conformance.suite.test_precision import EPS, LOSS_RTOL_PER_EPS, PARAM_ATOL_PER_EPS

    atol, rtol = parity_tolerance(world_size)
    atol, rtol = max(atol, ATOL), max(rtol, RTOL)
    low = [
        EPS[dtype] for dtype in case.wrap_config.get("mixed_precision", {}).values() if dtype in EPS
    ]
    if low:
        layers = 1 + sum(
            (node.kind == "twice") + (node.kind != "act")
            for node in iter_nodes(case.model.body)
            if isinstance(node, Block)
        )
        eps = max(low) * max(1.0, layers / PRECISION_LAYERS)
        atol, rtol = max(atol, PARAM_ATOL_PER_EPS * eps), max(rtol, LOSS_RTOL_PER_EPS * eps)
    return atol, rtol


def first_difference(case: FuzzCase, actual: Trace, expected: Trace, world_size: int) -> str | None:
    """The first difference of the FSDP run from the reference, in words, or None."""
    atol, rtol = tolerance(case, world_size)
    how = "bit-exact" if atol == rtol == 0 else f"atol={atol:g}, rtol={rtol:g}"
    for (name, value), (_, reference) in zip(actual.values, expected.values):
        if not _close(torch.tensor(value), torch.tensor(reference), atol, rtol):
            return f"{name}: FSDP {value!r} != DDP {reference!r} ({how})"
    if len(actual.values) != len(expected.values):
        return f"FSDP recorded {len(actual.values)} values, DDP {len(expected.values)}"
    missing = sorted(set(expected.params) - set(actual.params))
    extra = sorted(set(actual.params) - set(expected.params))
    if missing or extra:
        return f"full parameter names differ from DDP's: missing {missing}, unexpected {extra}"
    for name, reference in expected.params.items():
        value = actual.params[name].detach().float().cpu()
        reference = reference.detach().float().cpu()
        if value.shape != reference.shape:
            return (
                f"parameter {name!r}: shape {tuple(value.shape)} != DDP's {tuple(reference.shape)}"
            )
        if not _close(value, reference, atol, rtol):
            worst = (value - reference).abs().flatten().argmax().item()
            return (
                f"parameter {name!r} after {len(case.program.steps)} steps differs from DDP's "
                f"({how}): max |difference| {(value - reference).abs().max().item():.3g} at flat "
                f"index {worst} (FSDP {value.flatten()[worst].item()!r}, DDP "
                f"{reference.flatten()[worst].item()!r})"
            )
    return None


def _close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> bool:
    if atol == rtol == 0:
        return torch.equal(actual, expected) or bool(
            torch.isnan(actual).all() and torch.isnan(expected).all()
        )
    return torch.allclose(actual, expected, atol=atol, rtol=rtol, equal_nan=True)


def declared(adapter: Any, case: FuzzCase, error: BaseException) -> str | None:
    """The reason of a deviation the adapter declares for ``CHECK_ID`` covering ``case`` and
    ``error`` (``Deviation.covers``: its ``raises`` and ``match``), or None."""
    deviation = adapter_deviations.find_deviation(adapter, CHECK_ID, case, error)
    return None if deviation is None else deviation.reason


def run_case(adapter: Any, case: FuzzCase, dist: Any) -> Outcome:
    """This rank's outcome of ``case`` ([Note: the property]). Collective: every rank calls it.

    The FSDP wrap comes first (a refusal costs no reference run), then the DDP reference (no
    FSDP collective is in flight), then the FSDP training.
    """
    try:
        root = fsdp_wrap(adapter, case, dist)
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
        actual = fsdp_train(adapter, root, case, dist)
        difference = first_difference(case, actual, expected, dist.world_size)
        if difference is None:
            return Outcome(OK)
        error: BaseException = AssertionError(difference)
    except UnsupportedFeatureError as refusal:
        return Outcome(UNSUPPORTED, str(refusal))
    except Exception as raised:  # noqa: BLE001  any other exception is a failure (or declared)
        error = raised
    reason = declared(adapter, case, error)
    if reason is not None:
        return Outcome(DEVIATION, f"{_headline(error)} -- declared: {reason}")
    if isinstance(error, AssertionError) and error.__traceback__ is None:
        return Outcome(FAIL, str(error))
    return Outcome(FAIL, "".join(traceback.format_exception(error)).rstrip())


def probe_capabilities(adapter: Any, dist: Any) -> Any:
    """Collective: the adapter's declared capabilities, less the training-loop features whose
    method refuses on a wrapped ``Linear(2, 2)`` (``UnsupportedFeatureError`` from ``no_sync`` /
    ``clip_grad_norm_``: an adapter may declare a feature its root cannot do yet), so the
    generator does not draw cases that would only be refused after a whole run."""
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
        (Feature.GRADIENT_ACCUMULATION, lambda: adapter_loop.no_sync(adapter, root).__enter__()),
        (Feature.CLIP_GRAD_NORM, lambda: adapter_loop.clip_grad_norm_(adapter, root, 1.0)),
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


def _headline(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def combine(outcomes: list[Outcome]) -> Outcome:
    """The verdict of all ranks' outcomes (rank order)."""
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o.kind == FAIL]
    if failed:
        rank, outcome = failed[0]
        others = [r for r, _ in failed[1:]]
        also = f" (also failed: ranks {others})" if others else ""
        return Outcome(FAIL, f"rank {rank} of {len(outcomes)}{also}: {outcome.message}")
    kinds = {o.kind for o in outcomes}
    if len(kinds) > 1:
        detail = "; ".join(
            f"rank {r}: {o.kind} {o.message}".strip() for r, o in enumerate(outcomes)
        )
        return Outcome(FAIL, f"the ranks disagree about this case: {detail}")
    return outcomes[0]
