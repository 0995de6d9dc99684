"""Suite faults and protocol gaps an outside adapter hit, each reproduced by a small adapter.

- the training-state recorder samples the end of backward after the implementation's own final
  callback, even when that callback is queued after the recorder's (always_wrap);
- ``CommTrace`` compares phases that recorded no event with their expectation;
- ``UnsupportedFeatureError`` raised inside ``_wrap`` (or for a refused config value) is a skip;
- an adapter's ``wrapper_segments`` are removed from parameter and instance labels.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from fsdp_conformance.adapters import InstanceState, clean_param_name
from fsdp_conformance.adapters.impl import ImplAdapter
from fsdp_conformance.observe.comm_trace import CommTrace
from fsdp_conformance.observe.states import TrainingStateRecorder
from fsdp_conformance.suite import comm_checks, training

pytest_plugins = ["pytester"]


class FinalCallbackLast(ImplAdapter):
    """impl, with a root that behaves like fairscale's: BACKWARD_PRE from its pre-backward hook
    (a gradient hook registered in the root's forward) until its own end-of-backward callback."""

    name = "final-callback-last"

    def __init__(self) -> None:
        super().__init__()
        self.root: torch.nn.Module | None = None
        self.root_state_name = "IDLE"

    def emulate_root(self, root: torch.nn.Module) -> None:
        self.root = root
        root.register_forward_pre_hook(lambda module, args: self._set("FORWARD"))
        root.register_forward_hook(self._post_forward)

    def _set(self, state: str) -> None:
        self.root_state_name = state

    def _post_forward(self, module: torch.nn.Module, args: object, output: torch.Tensor) -> None:
        self._set("IDLE")
        output.register_hook(self._pre_backward)

    def _pre_backward(self, grad: torch.Tensor) -> None:
        self._set("BACKWARD_PRE")
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._set("IDLE"))

    def training_state(self, instance: torch.nn.Module) -> InstanceState:
        if instance is self.root:
            return InstanceState[self.root_state_name]
        return super().training_state(instance)


class OneQueueRecorder(TrainingStateRecorder):
    """The recorder before the fix: the end-of-backward sample queued once, from the first
    pre-backward sample."""

    def _end_of_backward(self) -> None:
        self._sample_end_of_backward()


def _violations(recorder_type: type, dist: object) -> list[str]:
    adapter = FinalCallbackLast()
    root, zoo_model = training.build(adapter, "always_wrap", dist, {})
    adapter.emulate_root(root)
    with recorder_type(adapter, root) as recorder:
        training.train(
            root, zoo_model, dist.device, steps=2, after_step=lambda step: recorder.sample("step")
        )
    return [str(violation) for violation in recorder.violations]


@pytest.mark.world_size(2)
def test_recorder_samples_end_of_backward_after_the_implementations_callback(dist) -> None:
    before = _violations(OneQueueRecorder, dist)
    assert any("'<root>'" in v and "IDLE after BACKWARD_PRE" in v for v in before), before
    assert _violations(TrainingStateRecorder, dist) == []


class SilentAfterFirstReduction(ImplAdapter):
    """A mutant that stops communicating (reports nothing) after its first gradient reduction."""

    name = "silent-after-first-reduction"

    def _observe(self, callback, instances):
        reduced = []

        def muted(op, instance, info):
            if not reduced:
                callback(op, instance, info)
            if op in ("reduce_scatter", "all_reduce"):
                reduced.append(op)

        return super()._observe(muted, instances)


@pytest.mark.world_size(2)
def test_counts_compare_phases_without_events(dist) -> None:
    adapter = SilentAfterFirstReduction()
    config = {"sharding_strategy": "SHARD_GRAD_OP"}
    trace, root = comm_checks.trace_training(adapter, "nested", dist, config, compute=False)
    assert "iteration 2 forward" in trace.phases and not trace.select("iteration 2 forward")
    with pytest.raises(AssertionError, match="iteration 2 forward: 0 all-gathers, expected"):
        comm_checks.assert_counts(trace, "SHARD_GRAD_OP", len(adapter.instances(root)), "mutant")


def test_phases_lists_entered_phases_in_order() -> None:
    trace = CommTrace.__new__(CommTrace)
    trace.events, trace._entered, trace._phase = [], {}, "outside"
    with trace.phase("a"), trace.phase("b"):
        pass
    assert trace.phases == ["a", "b"]


def test_wrapper_segments_are_removed() -> None:
    name = "_fsdp_wrapped_module.layers._fpw_module.0._fpw_module.weight"
    assert clean_param_name(name, ("_fpw_module",)) == "layers.0.weight"
    assert clean_param_name("x_fpw_module.w", ("_fpw_module",)) == "x_fpw_module.w"
    with pytest.raises(ValueError, match="without dots"):
        clean_param_name(name, ("a.b",))


_REFUSING = """
import dataclasses

import pytest

from fsdp_conformance.adapters import UnsupportedFeatureError
from fsdp_conformance.adapters.impl import ImplAdapter


class Refusing(ImplAdapter):
    name = "refusing"
    declarations = dataclasses.replace(
        ImplAdapter.declarations,
        unsupported_values={("limit_all_gathers", False): "the limiter cannot be turned off"},
    )

    def _wrap(self, module, process_group, config):
        if config.get("sharding_strategy") == "NO_SHARD":
            raise UnsupportedFeatureError(self.name, "no_shard", "found out at wrap time")
        return super()._wrap(module, process_group, config)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("config", [
    {"sharding_strategy": "NO_SHARD"}, {"limit_all_gathers": False}, {"limit_all_gathers": True},
])
def test_wrap(dist, config):
    import torch

    Refusing().wrap(torch.nn.Linear(4, 4), **config)
"""


def test_unsupported_inside_wrap_is_a_skip(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_refusing=textwrap.dedent(_REFUSING))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(
        [
            "*adapter 'refusing' does not support 'no_shard': found out at wrap time*",
            "*adapter 'refusing' does not support 'limit_all_gathers=False': the limiter *",
        ]
    )


def test_world_sizes_1_and_4_cover_adapters_without_backward_prefetch() -> None:
    from fsdp_conformance.suite import configs

    cases = configs.parity_cases(("nested",), "pairwise", (1, 4), ("nested",))
    for world_size in (1, 4):
        without_prefetch = {
            case.wrap_config["sharding_strategy"]
            for case in cases
            if case.world_size == world_size and case.wrap_config["backward_prefetch"] is None
        }
        assert without_prefetch == set(configs.SHARDING_STRATEGIES), (world_size, cases)


_CACHING = """
import pytest
import torch.distributed as dist_c10d

from fsdp_conformance.adapters import get_adapter
from fsdp_conformance.adapters.impl import ImplAdapter


class Caching(ImplAdapter):
    name = "caching"

    def __init__(self):
        super().__init__()
        self.groups = []  # groups cached "for the life of the process"
        self.ends = []  # per on_test_end: were the cached groups still alive?

    def on_test_end(self):
        world = dist_c10d.distributed_c10d._world
        self.ends.append(all(group in world.pg_map for group in self.groups))
        self.groups.clear()


pytestmark = [pytest.mark.world_size(2), pytest.mark.fsdp_mode("process")]


def test_first(dist):
    get_adapter("test_caching:Caching").groups.append(dist_c10d.new_group([0, 1]))


def test_second(dist):
    assert get_adapter("test_caching:Caching").ends == [True]
"""


def test_on_test_end_runs_before_groups_are_destroyed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_caching=textwrap.dedent(_CACHING))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "0")
    result.assert_outcomes(passed=2)
