"""The one training driver (`suite/training.py`'s `Driver`) without ranks: the order of its step
primitives through an adapter, the loss divisor of micro-batches, and the zero_grad of each
loop that uses it (the parity loop alternates set_to_none, True in step 0; the fuzzer's program
never sets to none; the loop checks always do)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fsdp_conformance.suite import training
from fsdp_conformance.suite.fuzz.compare import run_program
from fsdp_conformance.suite.fuzz.model import build_model
from fsdp_conformance.suite.fuzz.spec import Block, FuzzCase, ModelSpec, Program, Seq, Step

CPU = torch.device("cpu")


class Tiny(nn.Module):
    """A zoo-like model: get_input, get_loss, run_backward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def get_input(self, device: torch.device) -> tuple[torch.Tensor]:
        return (torch.ones(3, 2, device=device),)

    def get_loss(self, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.sum()

    def run_backward(self, loss: torch.Tensor, backward=None) -> None:
        loss.backward() if backward is None else backward(loss)


class RecordingAdapter:
    """The adapter members the driver calls, recording each call."""

    declarations = SimpleNamespace(grad_reduction="mean")

    def __init__(self) -> None:
        self.calls: list[str] = []

    def optimizer(self, model: nn.Module, name: str, **options) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), **options)

    def accumulation_boundary(self, model: nn.Module, boundary: bool) -> None:
        self.calls.append(f"boundary {boundary}")

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        self.calls.append("no_sync")
        yield
        self.calls.append("synced")

    def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
        self.calls.append(f"backward {loss.item():g}")
        loss.backward()


@pytest.fixture
def set_to_none(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Every `set_to_none` that torch's optimizers' zero_grad gets."""
    seen: list[bool] = []
    zero_grad = torch.optim.Optimizer.zero_grad

    def recording(self, set_to_none: bool = True) -> None:
        seen.append(set_to_none)
        zero_grad(self, set_to_none)

    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", recording)
    return seen


def test_micro_batches_through_the_adapter_in_the_users_order():
    adapter = RecordingAdapter()
    model = Tiny()
    driver = training.Driver(model, model, CPU, adapter)
    losses = driver.run(
        1,
        micro_batches=3,
        sync_every=False,
        loss=lambda step, index: torch.tensor(6.0 * (index + 1), requires_grad=True),
    )
    assert losses.tolist() == [2.0, 4.0, 6.0]  # each loss divided by the 3 micro-batches
    assert adapter.calls == [
        "boundary False", "no_sync", "backward 2", "synced",
        "boundary False", "no_sync", "backward 4", "synced",
        "boundary True", "backward 6",
    ]  # fmt: skip


def test_the_parity_loop_alternates_set_to_none_from_true(set_to_none):
    model = Tiny()
    training.train(model, model, CPU, steps=3)
    assert set_to_none == [True, False, True]


def test_the_loop_checks_set_to_none_every_step(set_to_none):
    model = Tiny()
    training.Driver(model, model, CPU).run(3)
    assert set_to_none == [True, True, True]


def test_the_fuzzers_program_never_sets_to_none(set_to_none):
    spec = ModelSpec(2, Seq((Block("linear", 2, 2),)))
    steps = (Step(), Step(micro=(True, True), clip=1.0, eval=True), Step(round_trip=True))
    case = FuzzCase(spec, program=Program(steps))
    model = build_model(spec)
    dist = SimpleNamespace(rank=0, device=CPU)
    trace = run_program(training.Driver(model, model, CPU), case, dist)
    assert set_to_none == [False, False, False]
    names = [name for name, _ in trace.values]
    assert names == [
        "step 0 micro-batch 0 loss",
        "step 1 micro-batch 0 loss",
        "step 1 micro-batch 1 loss",
        "step 1 total grad norm",
        "step 1 eval loss",
        "step 2 micro-batch 0 loss",
    ]
