"""Mixed precision as users configure it, and the sharded gradient scaler (docs/suite.md,
"Precision"): the dtypes observed in forward, reductions, shards, gradients, buffers and the
state dict, training within tolerance of float32 DDP, float32 accumulation over many
micro-batches (``precision.dtypes``); an inf gradient on one rank skips the step on every rank
(``precision.grad_scaler``).

[Note: precision tolerances]
With eps = 2**-8 (bf16) or 2**-11 (fp16), a gradient computed in param_dtype is off by a few
eps per layer; over ``STEPS`` SGD+momentum steps (lr 0.01, |g| <= 3, ~4 layers) a parameter
drifts below ~0.01 (bf16) / ~1.5e-3 (fp16): ``PARAM_ATOL`` = 2.4 eps; losses relative 16 eps.
Measured (torch 2.13.0, CPU; impl, FSDP1, FSDP2): parameters 3.8e-4 / 1.2e-5, losses 1.8e-3
/ 4.4e-4. Accumulation: N identical micro-batches with the loss divided by N (a power of two)
give exactly g / N each, and a float32 sum of them is exact, so the error against float32 DDP
may grow by at most ``GROWTH`` = 1.25x from 1 to N micro-batches; measured 1.00000x, while a
bfloat16 running sum rounds N times: 4.5x (FSDP1 no_sync as released), 7.1x (impl adding
reduced gradients in bf16).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as torch_dist
from torch import nn

from fsdp_conformance.adapters import Feature
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.checks import CheckFailure
from fsdp_conformance.constants import REDUCE_OPS
from fsdp_conformance.observe.comm_trace import observing_collectives

from . import training
from .declare import check
from .training import LoopCase

MODEL = "loops_buffer"
# the accumulation model: one instance around it (no fp32 buffer meeting bf16 activations)
ACCUMULATION_MODEL = "loops"
STEPS = 3
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
PARAM_ATOL_PER_EPS = 8 * 0.3
LOSS_RTOL_PER_EPS = 16
GROWTH = 1.25
ACCUMULATION_LR = 1.0  # one plain SGD step: the parameter change is the gradient
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _policy(name: str) -> tuple[torch.dtype, torch.dtype, torch.dtype | None]:
    """(param_dtype, reduce_dtype, output_dtype) of a name such as ``"bf16-reduce-fp32"`` or
    ``"bf16-output-fp32"`` (reduce_dtype defaults to param_dtype, output_dtype to None)."""
    param, *pairs = name.split("-")
    fields = dict(zip(pairs[::2], pairs[1::2], strict=True))
    output = fields.get("output")
    return _DTYPES[param], _DTYPES[fields.get("reduce", param)], output and _DTYPES[output]


@contextlib.contextmanager
def recording_forward_dtypes(model: nn.Module) -> Iterator[dict[str, set[torch.dtype]]]:
    """What the wrapped modules see in forward: "input", "weight" (every ``nn.Linear``) and
    "buffer" (the floating-point buffers of every module that has them) -> dtypes seen."""
    seen: dict[str, set[torch.dtype]] = {"input": set(), "weight": set(), "buffer": set()}

    def linear_hook(module: nn.Module, args: tuple) -> None:
        seen["input"].add(args[0].dtype)
        seen["weight"].add(module.weight.dtype)

    def buffer_hook(module: nn.Module, args: tuple) -> None:
        seen["buffer"].update(b.dtype for b in _float_buffers(module))

    handles = []
    for module in model.modules():
        if isinstance(module, nn.Linear):
            handles.append(module.register_forward_pre_hook(linear_hook))
        if _float_buffers(module):
            handles.append(module.register_forward_pre_hook(buffer_hook))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _float_buffers(module: nn.Module) -> list[torch.Tensor]:
    return [b for b in module._buffers.values() if b is not None and b.is_floating_point()]


def _params_and_grads(root: nn.Module) -> dict[str, torch.dtype]:
    """Dtype of every registered (sharded) parameter and of its gradient."""
    dtypes = {}
    for name, param in root.named_parameters():
        dtypes[name] = param.dtype
        if param.grad is not None:
            dtypes[f"{name}.grad"] = param.grad.dtype
    return dtypes


def _relative_error(actual: dict, expected: dict, before: dict) -> float:
    """max |(actual - before) - (expected - before)| / max |expected - before| over all
    parameters: the error of the applied update relative to the reference's."""
    error = max((actual[n] - expected[n]).abs().max().item() for n in expected)
    scale = max((expected[n] - before[n]).abs().max().item() for n in expected)
    return error / scale


def _accumulation_case(accumulation: str) -> LoopCase:
    sync, _, policy = accumulation.partition(":")
    return LoopCase(ACCUMULATION_MODEL, "FULL_SHARD", f"{sync} {policy}")


class BasePrecisionTests:
    """Mixed precision dtypes and accumulation, the sharded gradient scaler (see the module
    docstring)."""

    # the mixed precision policies of test_dtypes: "<param>[-reduce-<dtype>][-output-<dtype>]"
    policies: ClassVar[tuple[str, ...]] = (
        "bf16-reduce-fp32",
        "bf16",
        "fp16-reduce-fp32",
        "bf16-output-fp32",
    )
    # accumulation: (sync mode, policy); under no_sync FSDP2 accumulates in reduce_dtype (its
    # documentation), so reduce_dtype is float32 there
    accumulations: ClassVar[tuple[str, ...]] = ("no_sync:bf16-reduce-fp32", "sync_every:bf16")
    MICRO_BATCHES: ClassVar[int] = 32

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        training.parametrize(metafunc, policy=self.policies, accumulation=self.accumulations)

    @check(
        "precision.dtypes",
        "mixed precision observed: forward in param_dtype, reductions in reduce_dtype, fp32 "
        "shards and gradients, buffers and their state dict in the promised dtype, fp32 "
        "accumulation over many micro-batches, training within tolerance of fp32 DDP",
        features=("mixed_precision", "mixed_precision_policy"),
        case="suite.training.LoopCase",
        case_of=lambda policy: LoopCase(MODEL, "FULL_SHARD", policy),
        api=(
            "FullyShardedDataParallel(mixed_precision)",
            "MixedPrecision(param_dtype)",
            "MixedPrecision(reduce_dtype)",
            "MixedPrecision(buffer_dtype)",
        ),
    )
    @pytest.mark.world_size(2)
    def test_dtypes(self, fsdp_adapter: Any, dist: Any, policy: str):
        adapter = fsdp_adapter
        param_dtype, reduce_dtype, output_dtype = _policy(policy)
        casts_buffers = adapter_features.supports(adapter, Feature.MIXED_PRECISION_BUFFER_DTYPE)
        mixed = {
            "param_dtype": param_dtype,
            "reduce_dtype": reduce_dtype,
            "buffer_dtype": param_dtype if casts_buffers else None,
            "output_dtype": output_dtype,
        }
        config = {"sharding_strategy": "FULL_SHARD", "mixed_precision": mixed}
        driver = training.fsdp_driver(adapter, MODEL, dist, config)
        root, zoo_model = driver.model, driver.zoo_model
        label = f"adapter {adapter.name!r}, {MODEL}, mixed_precision {policy}"
        failures: list[str] = []
        seen_wrong: dict[str, str] = {}  # the figure: what was seen, per kind of tensor
        losses = []
        state_dtypes: dict[str, torch.dtype] = {}
        for step in range(STEPS):
            driver.zero_grad()
            inputs = training.micro_input(zoo_model, dist.device, step)
            with recording_forward_dtypes(adapter.unwrap(root)) as seen:
                output = root(*inputs)
            loss = zoo_model.get_loss(inputs, output)
            if output_dtype is not None and output.dtype != output_dtype:
                seen_wrong["output"] = str(output.dtype)
                failures.append(
                    f"step {step} forward: the root's output in {output.dtype}, "
                    f"output_dtype is {output_dtype}"
                )
            collectives: list[Any] = []  # what backward issues, DTensor's collectives too
            with observing_collectives(collectives.append):
                driver.backward(loss)
            for key, what, expected in (
                ("input", "inputs of the nn.Linear layers", param_dtype),
                ("weight", "weights of the nn.Linear layers", param_dtype),
                ("buffer", "floating-point buffers", mixed["buffer_dtype"] or torch.float32),
            ):
                if seen[key] != {expected}:
                    seen_wrong[key] = _names(seen[key])
                    failures.append(
                        f"step {step} forward: {what} in {_names(seen[key])}, expected {expected}"
                    )
            reduced = [
                (c.op, dtype) for c in collectives if c.op in REDUCE_OPS for dtype in c.dtypes
            ]
            wrong = sorted({f"{op} in {dtype}" for op, dtype in reduced if dtype != reduce_dtype})
            if not reduced or wrong:
                seen_wrong["reduction"] = ", ".join(wrong) or "none observed"
                failures.append(
                    f"step {step} backward: gradient reductions "
                    f"{wrong or 'none observed'}, expected every one in {reduce_dtype}"
                )
            low = {n: d for n, d in _params_and_grads(root).items() if d != torch.float32}
            if low:
                seen_wrong["sharded"] = _names(set(low.values()))
                failures.append(f"step {step}: sharded parameters / gradients not float32: {low}")
            driver.step()
            losses.append(loss.detach().float())
            if step == 0:
                state = training.by_clean_name(adapter, adapter.state_dict(root).items())
                state_dtypes = {k: v.dtype for k, v in state.items() if isinstance(v, torch.Tensor)}
        reference = training.ddp_driver(MODEL, dist)
        buffers = {name: b.dtype for name, b in reference.zoo_model.named_buffers()}
        wrong_state = {
            name: state_dtypes.get(name, "missing")
            for name, dtype in buffers.items()
            if state_dtypes.get(name) != dtype
        }
        if wrong_state:
            seen_wrong["state_dict"] = ", ".join(sorted(set(map(str, wrong_state.values()))))
            failures.append(
                f"the state dict holds buffers {wrong_state}; the unwrapped module has "
                f"them in {sorted(set(map(str, buffers.values())))}"
            )
        if failures:
            message = f"{label}:\n  " + "\n  ".join(failures)
            raise CheckFailure(message, "dtypes differ from the policy", **seen_wrong)
        reference_losses = reference.run(STEPS)
        eps = EPS[param_dtype]
        training.assert_same_training(
            f"{label}, against float32 DDP",
            training.TrainingResult(torch.stack(losses), driver.params()),
            training.TrainingResult(reference_losses, reference.params()),
            atol=PARAM_ATOL_PER_EPS * eps,
            loss_rtol=LOSS_RTOL_PER_EPS * eps,
        )

    @check("precision.dtypes", case_of=_accumulation_case)
    @pytest.mark.world_size(2)
    def test_accumulation(self, fsdp_adapter: Any, dist: Any, accumulation: str):
        sync, _, policy = accumulation.partition(":")
        if sync == "no_sync":
            adapter_features.skip_unless(fsdp_adapter, Feature.GRADIENT_ACCUMULATION)
        param_dtype, reduce_dtype, _ = _policy(policy)
        mixed = {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype}
        config = {"sharding_strategy": "FULL_SHARD", "mixed_precision": mixed}
        # the reference: float32 DDP, one micro-batch (N identical micro-batches with the
        # loss divided by N have the same gradient; see [Note: precision tolerances])
        reference = training.ddp_driver(ACCUMULATION_MODEL, dist)
        reference.optimizer = torch.optim.SGD(reference.model.parameters(), lr=ACCUMULATION_LR)
        reference.run(1)
        expected = reference.params()
        errors = {}
        for micro_batches in (1, self.MICRO_BATCHES):
            # one instance around the whole model: 32 micro-batches cost 32 all-gathers
            zoo_model = training.ddp_driver(ACCUMULATION_MODEL, dist, ddp=False).zoo_model
            root = fsdp_adapter.wrap(zoo_model, process_group=dist.group, root=True, **config)
            driver = training.Driver(root, zoo_model, dist.device, fsdp_adapter)
            before = driver.params()
            driver.optimizer = fsdp_adapter.optimizer(root, "sgd", lr=ACCUMULATION_LR)
            sync_every = sync == "sync_every"
            driver.run(1, micro_batches=micro_batches, sync_every=sync_every, same_input=True)
            errors[micro_batches] = _relative_error(driver.params(), expected, before)
        one, many = errors[1], errors[self.MICRO_BATCHES]
        if many > GROWTH * one:
            raise CheckFailure(
                f"adapter {fsdp_adapter.name!r}, {ACCUMULATION_MODEL}, mixed_precision "
                f"{policy}, {'no_sync' if sync == 'no_sync' else 'sync on every micro-batch'}: "
                f"the gradient accumulated over {self.MICRO_BATCHES} micro-batches is "
                f"{many:.3g} (relative) away from float32 DDP's, {many / one:.3g}x the error of "
                f"one micro-batch ({one:.3g}; at most {GROWTH}x): gradients accumulate in a low "
                "precision, not in float32",
                "gradients accumulate in a low precision",
                growth=many / one,
            )

    @check(
        "precision.grad_scaler",
        "the implementation's grad scaler with an inf gradient on one rank: every rank skips the "
        "step, the scale shrinks identically, parameters equal DDP + GradScaler's",
        features=("grad_scaler",),
        case="suite.training.LoopCase",
        case_of=lambda: LoopCase(MODEL, "FULL_SHARD", "inf"),
    )
    @pytest.mark.world_size(2)
    def test_grad_scaler(self, fsdp_adapter: Any, dist: Any):
        adapter = fsdp_adapter
        driver = training.fsdp_driver(adapter, MODEL, dist, {"sharding_strategy": "FULL_SHARD"})
        optimizer = driver.optimizer  # before the scaler, as users make them
        scaler = adapter.grad_scaler(driver.model, **SCALER_OPTIONS)
        fsdp = _scaled_run(driver, optimizer, scaler, adapter.unwrap(driver.model), dist)
        reference = training.ddp_driver(MODEL, dist)
        scaler = torch.amp.GradScaler(dist.device.type, **SCALER_OPTIONS)
        ddp_run = _scaled_run(reference, reference.optimizer, scaler, reference.zoo_model, dist)
        label = f"adapter {adapter.name!r}, {MODEL}, an inf gradient on rank 1 in step 1"
        scales = _per_rank(fsdp["scales"], dist)
        assert all(s == scales[0] for s in scales), (
            f"{label}: the scale differs across ranks after each step: {scales}"
        )
        assert fsdp["scales"] == ddp_run["scales"], (
            f"{label}: scales after each step {fsdp['scales']}, DDP + GradScaler's "
            f"{ddp_run['scales']} (the inf step must halve the scale)"
        )
        skipped = _per_rank(fsdp["skipped"], dist)
        assert all(s == [INF_STEP] for s in skipped), (
            f"{label}: steps that left the parameters unchanged, per rank: {skipped}; "
            f"expected only step {INF_STEP} on every rank"
        )
        training.assert_params(label, fsdp["params"], ddp_run["params"], SCALER_STEPS)


SCALER_OPTIONS = {"init_scale": 2.0**10, "growth_interval": 1000}
SCALER_STEPS = 3
INF_STEP = 1


def _scaled_run(driver: Any, optimizer: Any, scaler: Any, module: nn.Module, dist: Any) -> dict:
    """SCALER_STEPS steps with `scaler`; in step INF_STEP rank 1 sets one element of the first
    nn.Linear's weight gradient to inf (a hook on the weight the module computes with, so
    after the reduction the inf lives in one rank's gradient shard only)."""
    linear = next(m for m in module.modules() if isinstance(m, nn.Linear))
    scales, skipped = [], []
    for step in range(SCALER_STEPS):
        optimizer.zero_grad()
        handles = []
        if step == INF_STEP and dist.rank == 1:

            def inject(grad: torch.Tensor) -> torch.Tensor:
                grad = grad.clone()
                grad.view(-1)[0] = float("inf")
                return grad

            def pre_hook(mod: nn.Module, args: tuple, handles: list = handles) -> None:
                handles.append(mod.weight.register_hook(inject))

            handles.append(linear.register_forward_pre_hook(pre_hook))
        driver.backward(scaler.scale(driver.loss(step)))
        for handle in handles:
            handle.remove()
        before = training.local_shards(driver.model)
        scaler.step(optimizer)
        scaler.update()
        after = training.local_shards(driver.model)
        if all(torch.equal(before[name], after[name]) for name in before):
            skipped.append(step)
        scales.append(float(scaler.get_scale()))
    return {"scales": scales, "skipped": skipped, "params": driver.params()}


def _per_rank(value: Any, dist: Any) -> list[Any]:
    values = [None] * dist.world_size
    torch_dist.all_gather_object(values, value, group=dist.group)
    return values


def _names(dtypes: set[torch.dtype]) -> str:
    return ", ".join(sorted(str(d) for d in dtypes)) or "nothing (no forward seen)"


class TestPrecision(BasePrecisionTests): ...
