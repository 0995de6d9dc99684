"""Legal training states (the table of ``fsdp_conformance/training_states.py``) at every hook
of 3 training steps and a `summon_full_params`; every instance IDLE after each step."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from fsdp_conformance.adapters import Feature, RootState
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.harness import properties
from fsdp_conformance.observe.states import TrainingStateRecorder

from . import configs, training
from .declare import check

# every kind of sample the recorder must have taken (proof it observed)
REQUIRED_HOOKS = (
    "start",
    "pre_forward",
    "post_forward",
    "pre_backward",
    "end of backward",
    "after optimizer.step",
    "inside summon_full_params",
    "after summon_full_params",
)


class BaseTrainingStateTests:
    """Every instance's state at every hook is legal; IDLE after each step; `_assert_state`."""

    models: ClassVar[tuple[str, ...]] = (
        "nested",
        "always_wrap",
        "transformer",
        "mixture_of_experts",
    )
    # backward prefetch values combined with every sharding strategy
    backward_prefetches: ClassVar[tuple[Any, ...]] = configs.BACKWARD_PREFETCH_CASES

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "state_case" in metafunc.fixturenames:
            # the prefetch values the adapter has (no cell for a value it lacks)
            supported = configs.dimensions_for_impl(metafunc.config.getoption("fsdp_impl", None))
            available = supported["backward_prefetch"]
            prefetches = [
                prefetch for prefetch in self.backward_prefetches if prefetch in available
            ]
            prefetches = prefetches or list(self.backward_prefetches[:1])
            cases = [
                configs.ParityCase(
                    model, 2, (("sharding_strategy", strategy), ("backward_prefetch", prefetch))
                )
                for model in self.models
                for strategy in supported["sharding_strategy"]
                for prefetch in prefetches
            ]
            metafunc.parametrize("state_case", [case.param() for case in cases])

    @check(
        "states.legal",
        "legal training-state transitions at every hook",
        features=("training_states",),
        case="configs.ParityCase",
        case_of="state_case",
    )
    def test_states_are_legal_at_every_hook(
        self, fsdp_adapter: Any, dist: Any, state_case: configs.ParityCase
    ):
        adapter = fsdp_adapter
        root, zoo_model = training.build(adapter, state_case.model, dist, state_case.wrap_config)
        # without the implementation's own summon_full_params the summon hooks are not sampled
        summon = adapter_features.supports(adapter, Feature.SUMMON_FULL_PARAMS)
        with TrainingStateRecorder(adapter, root) as recorder:
            after_step = lambda step: recorder.after_step()
            training.train(root, zoo_model, dist.device, adapter=adapter, after_step=after_step)
            if summon:
                with adapter.summon_full_params(root):
                    recorder.sample("inside summon_full_params")
                recorder.sample("after summon_full_params")
        recorder.assert_legal()
        label = f"adapter {adapter.name!r}, {state_case.describe()}"
        required = REQUIRED_HOOKS if summon else REQUIRED_HOOKS[:-2]
        missing = [hook for hook in required if hook not in recorder.hooks_seen]
        assert not missing, f"{label}: the recorder never sampled at {missing}"
        if not adapter.declarations.instance_states:
            # root states only (Adapter.instance_states = False): check what exists
            _assert_root_states_seen(label, recorder.root_states_seen, summon)
            properties.record_property("fsdp_not_checked", ROOT_ONLY_NOT_CHECKED)
            return
        # instances whose state the adapter cannot read (FSDP1: no parameters) are not listed
        readable = {name: seen for name, seen in recorder.states_seen.items() if seen}
        assert readable, f"{label}: the adapter reported no instance state at all"
        for name, seen in readable.items():
            assert "FORWARD" in seen and seen & {"BACKWARD_PRE", "BACKWARD_POST"}, (
                f"{label}: instance {name!r} was only ever seen in {sorted(seen)}; it must "
                "report FORWARD in its forward and BACKWARD_PRE/BACKWARD_POST in its backward"
            )
            assert not summon or "SUMMON_FULL_PARAMS" in seen, (
                f"{label}: instance {name!r} never reported SUMMON_FULL_PARAMS inside "
                f"summon_full_params (seen: {sorted(seen)})"
            )

    @check(
        "states.assert_state",
        "the implementation's own state assertion",
        features=("assert_state",),
    )
    @pytest.mark.world_size(2)
    def test_assert_state(self, fsdp_adapter: Any, dist: Any):
        adapter = fsdp_adapter
        adapter_features.skip_unless(adapter, Feature.ASSERT_STATE)
        root, zoo_model = training.build(adapter, "nested", dist, {})
        inner = adapter.instances(root)[1]
        outcomes: dict[str, BaseException | None] = {}

        def assert_both(where: str) -> None:
            for state in (RootState.FORWARD_BACKWARD, RootState.IDLE):
                outcomes[f"{state.value} {where}"] = _outcome(adapter, root, state)

        hook = adapter.unwrap(inner).register_forward_pre_hook(lambda *_: assert_both("in forward"))
        try:
            training.train(root, zoo_model, dist.device, steps=1, adapter=adapter)
        finally:
            hook.remove()
        assert_both("after step")
        label = f"adapter {adapter.name!r}: _assert_state on the root"
        for case in ("FORWARD_BACKWARD in forward", "IDLE after step"):
            assert outcomes[case] is None, (
                f"{label}: asserting {case} raised {outcomes[case]!r}; the root is in that state"
            )
        for case in ("IDLE in forward", "FORWARD_BACKWARD after step"):
            assert outcomes[case] is not None, (
                f"{label}: asserting {case} did not raise, but the root is not in that state"
            )


ROOT_ONLY_NOT_CHECKED = (
    "per-instance transitions (FORWARD, BACKWARD_PRE, BACKWARD_POST, SUMMON_FULL_PARAMS per "
    "instance): the adapter declares instance_states = False (root states only)"
)


def _assert_root_states_seen(label: str, seen: set[str], summon: bool) -> None:
    """The root went through forward/backward, summon_full_params (if any) and IDLE."""
    for state, where in (
        ("FORWARD_BACKWARD", "in forward and backward"),
        ("SUMMON_FULL_PARAMS", "inside summon_full_params"),
        ("IDLE", "after optimizer.step"),
    ):
        assert state in seen or (state == "SUMMON_FULL_PARAMS" and not summon), (
            f"{label}: the root never reported {state} {where} (root states seen: "
            f"{sorted(seen)}); not checked: {ROOT_ONLY_NOT_CHECKED}"
        )


def _outcome(adapter: Any, instance: torch.nn.Module, state: RootState) -> BaseException | None:
    """None if `adapter.assert_state(instance, state)` passes, else what it raised."""
    try:
        adapter.assert_state(instance, state)
    except (AssertionError, ValueError, RuntimeError) as error:
        return error
    return None


class TestTrainingStates(BaseTrainingStateTests): ...
