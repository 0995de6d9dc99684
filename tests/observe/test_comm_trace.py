"""CommTrace: labels from the unwrapped model, one event per line, phases, counts (no ranks)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from fsdp_conformance.adapters import Adapter, InstanceState
from fsdp_conformance.observe.comm_trace import CommTrace, instance_labels


class Wrapper(nn.Module):
    """Stands in for an FSDP instance: the wrapped module under `_fsdp_wrapped_module`."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._fsdp_wrapped_module = module
        self.state = InstanceState.IDLE

    def forward(self, *args):
        self.state = InstanceState.FORWARD
        return self._fsdp_wrapped_module(*args)


class FakeAdapter(Adapter):
    """The adapter members CommTrace uses; `emit` plays the implementation."""

    name = "fake"

    def __init__(self) -> None:
        self.callback = None

    def instances(self, model):
        return [module for module in model.modules() if isinstance(module, Wrapper)]

    def unwrap(self, model):
        return model._fsdp_wrapped_module if isinstance(model, Wrapper) else model

    def training_state(self, instance):
        return instance.state

    @contextlib.contextmanager
    def observe(self, callback, instances=None):
        self.callback = callback
        try:
            yield
        finally:
            self.callback = None

    def emit(self, op, instance):
        if self.callback is not None:
            self.callback(op, instance, {})


def model() -> Wrapper:
    inner = Wrapper(nn.Linear(2, 2))
    return Wrapper(nn.Sequential(nn.Linear(2, 2), Wrapper(nn.Sequential(inner, nn.Linear(2, 2)))))


def test_labels_are_module_paths_in_the_unwrapped_model():
    root = model()
    labels = instance_labels(FakeAdapter(), root)
    assert sorted(labels.values()) == ["1", "1.0", "<root>"]


def test_render_one_event_per_line_and_folds_repeated_phases():
    adapter, root = FakeAdapter(), model()
    middle = root._fsdp_wrapped_module[1]
    trace = CommTrace(adapter, root, compute=True)
    with trace:
        for iteration in (1, 2, 3):
            with trace.phase(f"iteration {iteration} forward"):
                adapter.emit("all_gather", root)
                adapter.emit("prefetch", middle)  # not a comm op: dropped
                root(torch.ones(1, 2))
                adapter.emit("free", middle)
            with trace.phase(f"iteration {iteration} backward"):
                adapter.emit("reduce_scatter", root)
                if iteration == 3:
                    adapter.emit("all_reduce", middle)
        adapter.emit("all_gather", root)  # outside any phase
    adapter.emit("all_gather", root)  # after the trace closed: not recorded
    rendered = trace.render()
    assert rendered == (
        "iteration 1 forward:\n"
        "  all_gather <root> IDLE\n"
        "  free 1 FORWARD\n"
        "iteration 1 backward:\n"
        "  reduce_scatter <root> FORWARD\n"
        "iteration 2 forward:\n"
        "  all_gather <root> FORWARD\n"
        "  free 1 FORWARD\n"
        "iteration 2 backward: same as iteration 1 backward\n"
        "iteration 3 forward: same as iteration 2 forward\n"
        "iteration 3 backward:\n"
        "  reduce_scatter <root> FORWARD\n"
        "  all_reduce 1 FORWARD\n"
        "outside:\n"
        "  all_gather <root> FORWARD\n"
    )
    compute = [e.render() for e in trace.select("iteration 1 forward", ["compute"])]
    assert compute == ["compute <root> FORWARD", "compute 1 FORWARD", "compute 1.0 FORWARD"]
    assert trace.count("all_gather") == 4
    assert trace.count(("reduce_scatter", "all_reduce"), "iteration 3 backward") == 2
