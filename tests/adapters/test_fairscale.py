"""The fairscale adapter on 2 CPU ranks: parity, residency under the lagging device, routing.

A few cells only (CI-cheap); the whole suite runs against it with ``--fsdp-impl fairscale``.
Two suite cells run through pytester with outside adapters built on it: a subclass under its own
name inherits the declared memory-bound deviation (an expected failure), and a declaration on a
variant that meets the bound fails the cell.
Without fairscale every test here skips with the install hint.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fsdp_conformance.adapters import Declarations, get_adapter
from fsdp_conformance.adapters.deviations import deviation_reason
from fsdp_conformance.adapters.fairscale import FAIRSCALE_DEVIATIONS, FairscaleAdapter
from fsdp_conformance.suite import training
from fsdp_conformance.suite.memory_bound import (
    LAYERS,
    BoundCase,
    check_residency,
    measure_residency,
)

pytest_plugins = ["pytester"]

fairscale = pytest.importorskip(
    "fairscale", reason="fairscale is not installed: pip install 'fsdp-conformance[fairscale]'"
)
fsdp_module = pytest.importorskip("fairscale.nn.data_parallel.fully_sharded_data_parallel")


def _untouched() -> bool:
    """fairscale's module global ``torch`` and ``Tensor.record_stream`` are as imported.

    Only meaningful with one rank per process: in thread mode the other rank may be inside a
    routed call (the tests asking this are pinned to process mode).
    """
    return fsdp_module.torch is torch and "record_stream" not in vars(torch.Tensor)


@pytest.mark.world_size(2)
@pytest.mark.fsdp_mode("process")
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_nested_model_matches_ddp(dist, strategy):
    adapter = get_adapter("fairscale")
    config = {"sharding_strategy": strategy}
    result = training.fsdp_run(adapter, "nested", dist, config)
    reference = training.reference_run("nested", dist)
    training.assert_same_training(f"fairscale {strategy}", result, reference, 0.0, 0.0)
    # nothing of the routing outlives the calls that needed it
    assert _untouched()


@pytest.mark.world_size(2)
def test_unflattened_parameters_match_ddp(dist):
    adapter = FairscaleAdapter(flatten_parameters=False)
    result = training.fsdp_run(adapter, "nested", dist, {})
    reference = training.reference_run("nested", dist)
    training.assert_same_training("fairscale, flatten_parameters=False", result, reference, 0, 0)
    with pytest.raises(TypeError, match="flatten_parameters='no'"):
        FairscaleAdapter(flatten_parameters="no")


class _StaleDeclaration(FairscaleAdapter):
    """PR 972's variant (meets the bound) still declaring the released memory_bound deviation."""

    def __init__(self) -> None:
        super().__init__(sync_after_free=True)

    @property
    def declarations(self) -> Declarations:
        return dataclasses.replace(super().declarations, known_deviations=FAIRSCALE_DEVIATIONS)


def _peaks(tracker) -> list[tuple[int, int]]:
    return [
        (tracker.peak(iteration, "forward").resident, tracker.peak(iteration, "backward").resident)
        for iteration in (1, 2, 3)
    ]


# measured: fairscale 0.4.13 as released, FULL_SHARD, LAYERS wrapped Linears, forward/backward
RELEASED_PEAKS = {"strict": [(6, 12), (18, 24), (30, 36)], "drained": [(6, 12)] * 3}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("lag", ["strict", "drained"])
def test_released_fairscale_exceeds_the_bound_and_sync_after_free_meets_it(dist, lag):
    from fsdp_conformance.suite.verdict import cell

    case = BoundCase(lag, "FULL_SHARD", None, False, True)
    released = get_adapter("fairscale")
    # fairscale 0.4.13 as released: limit_all_gathers=True adds nothing, nothing ever blocks the
    # CPU on the device, so every instance of an iteration stays resident
    tracker = measure_residency(released, dist.group, case.wrap_config, lag)
    assert LAYERS == 6 and _peaks(tracker) == RELEASED_PEAKS[lag], tracker.peak_table()
    # ... declared, so the suite's check is an expected failure carrying the reason
    xfails = pytest.raises(pytest.xfail.Exception, match="memory_bound.*PR 972")
    with xfails, cell(released, "memory_bound", case):
        check_residency(tracker, case, "fairscale")

    # fairscale PR 972's synchronize after free: within the bound, and no deviation declared
    variant = FairscaleAdapter(sync_after_free=True)
    assert variant.name == "fairscale-sync-after-free"
    assert deviation_reason(variant, "memory_bound", case) is None
    tracker = measure_residency(variant, dist.group, case.wrap_config, lag)
    assert _peaks(tracker) == [(1, 1)] * 3, tracker.peak_table()
    with cell(variant, "memory_bound", case):
        check_residency(tracker, case, "fairscale-sync-after-free")
    # a declared deviation that does not happen fails the (strict) check
    stale = _StaleDeclaration()
    fails = pytest.raises(AssertionError, match="declares a known deviation for 'memory_bound'")
    with fails, cell(stale, "memory_bound", case):
        check_residency(tracker, case, "stale")
    # without limit_all_gathers the variant is fairscale as released
    unlimited = BoundCase(lag, limit_all_gathers=False)
    tracker = measure_residency(variant, dist.group, unlimited.wrap_config, lag)
    assert _peaks(tracker) == RELEASED_PEAKS[lag], tracker.peak_table()


def test_sync_after_free_is_validated_and_not_a_builtin_name():
    from fsdp_conformance.adapters import BUILTIN_ADAPTERS

    with pytest.raises(TypeError, match=r"FairscaleAdapter\(sync_after_free=1\)"):
        FairscaleAdapter(sync_after_free=1)
    assert "fairscale-sync-after-free" not in BUILTIN_ADAPTERS
    assert FairscaleAdapter().sync_after_free is False


@pytest.mark.world_size(2)
def test_without_the_adapter_fairscale_fails_on_cpu(dist):
    # the measured fact the routing exists for (fails if a fairscale release lifts it)
    from fairscale.internal.parallel import ProcessGroupName
    from fairscale.nn.data_parallel import FullyShardedDataParallel

    model = FullyShardedDataParallel(
        nn.Linear(4, 4),
        process_group=dist.group,
        # not fairscale's process-wide group cache (see test_no_process_group_...)
        process_group_reduce_scatter=ProcessGroupName.default,
        compute_device=torch.device("cpu"),
    )
    with pytest.raises(KeyError, match="all_gather"):
        model(torch.ones(2, 4))


@pytest.mark.world_size(2)
@pytest.mark.fsdp_mode("process")
def test_routing_is_undone_when_a_routed_call_raises(dist):
    adapter = get_adapter("fairscale")
    model = adapter.wrap(nn.Linear(4, 4), process_group=dist.group)
    with pytest.raises(RuntimeError, match="mat1 and mat2|shapes cannot be multiplied"):
        model(torch.ones(2, 5))
    assert _untouched()
    model(torch.ones(2, 4)).sum().backward()  # the instance still works afterwards
    assert _untouched()


@pytest.mark.world_size(2)
@pytest.mark.fsdp_mode("process")
def test_bf16_policy_meets_half_cast_inputs(dist):
    """The fuzz.generated bfloat16 deviation: the root casts float32 inputs with .half()
    whatever compute_dtype is, with and without a bias (two error messages)."""
    adapter = get_adapter("fairscale")
    (deviation,) = [
        d
        for d in adapter.declarations.known_deviations
        if d.check == "fuzz.generated" and "bfloat16 policy" in d.reason
    ]
    for bias in (False, True):
        model = adapter.wrap(
            nn.Linear(4, 1, bias=bias),
            process_group=dist.group,
            mixed_precision={"param_dtype": torch.bfloat16},
        )
        with pytest.raises(RuntimeError, match=deviation.match):
            model(torch.ones(2, 4))


@pytest.mark.world_size(2)
def test_no_process_group_of_fairscale_cache_is_used(dist):
    from fairscale.internal import parallel

    adapter = get_adapter("fairscale")
    cache = getattr(parallel.get_process_group_cached, "_global_group_cache", None)
    before = dict(cache) if cache is not None else None
    model = adapter.wrap(nn.Sequential(adapter.wrap(nn.Linear(4, 4)), nn.Linear(4, 4)))
    model(torch.ones(2, 4)).sum().backward()
    assert {instance.process_group for instance in adapter.instances(model)} == {
        torch.distributed.distributed_c10d._get_default_group()
    }
    assert all(
        instance.process_group_reduce_scatter is instance.process_group
        for instance in adapter.instances(model)
    )
    if before is not None:
        assert parallel.get_process_group_cached._global_group_cache == before


def test_moved_internals_raise_a_clear_error(monkeypatch):
    from fsdp_conformance.adapters import _fairscale_device

    monkeypatch.delattr(fsdp_module.FullyShardedDataParallel, "_free_full_params")
    with pytest.raises(RuntimeError, match=r"internals moved \(_free_full_params.*0\.4\.13"):
        _fairscale_device.check_internals()


def test_deviation_reproductions_reproduce(tmp_path):
    """docs/fairscale.md's reproduction script is examples/fairscale_deviations.py and it runs."""
    root = Path(__file__).resolve().parents[2]
    script = (root / "examples" / "fairscale_deviations.py").read_text()
    docs = (root / "docs" / "fairscale.md").read_text()
    block = re.search(
        r"<!-- example: fairscale_deviations.py -->\n```python\n(.*?)```", docs, re.DOTALL
    )
    assert block and block.group(1) == script, "docs/fairscale.md and the example script differ"
    run = subprocess.run(
        [sys.executable, "-W", "ignore", str(root / "examples" / "fairscale_deviations.py")],
        check=False, capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    # gloo of torch 2.8 prints "[Gloo] Rank 0 is connected to ..." to the same stdout
    printed = [line for line in run.stdout.splitlines() if line and not line.startswith("[Gloo]")]
    lines = {line[:32].strip(): line[32:].strip() for line in printed}
    assert "Half and BFloat16" in lines["parity.bf16 (root)"], lines
    assert "Float and Half" in lines["parity.bf16 (inner instance)"], lines
    for check in ("misuse.wrap_twice", "exec_order.divergent"):
        assert lines[check] == "no error", lines
    assert lines["misuse.forward_inside_summon"] == "AssertionError: ''", lines
    assert lines["memory_bound"] == ", ".join(
        f"{iteration} {phase} {peak}"
        for iteration, peaks in enumerate(RELEASED_PEAKS["strict"], start=1)
        for phase, peak in zip(("forward", "backward"), peaks)
    ), lines
    # every check the script reproduces is declared, and every declared check is reproduced --
    # the training-loop deviations by the reproduction in their reason, which the
    # suite's loop checks run (fsdp_conformance.suite.test_loops, their declared match)
    deviations = get_adapter("fairscale").declarations.known_deviations
    # (and the generated-model deviations: test_generated_model_deviations_reproduce below; the
    # tied parameter's and the nested instance's: the two tests at the end)
    loops = [
        deviation
        for deviation in deviations
        if deviation.check.startswith("loops.")
        or deviation.check
        in ("fuzz.generated", "wrap.shared_across_instances", "forward.other_method")
    ]
    assert all("Reproduction:" in d.reason and (d.match or d.envelope) for d in loops), loops
    # the .half() input cast of parity.bf16 met by a bf16 policy: the parity.bf16 lines above
    bf16 = [d for d in deviations if d.check in ("precision.dtypes", "wrap.configs_isolated")]
    assert len(bf16) == 2 and all("parity.bf16" in d.reason and d.match for d in bf16), bf16
    declared = {d.check for d in deviations if d not in loops and d not in bf16}
    assert declared == {label.split(" ")[0] for label in lines}, (declared, lines)


OUTSIDE_ADAPTERS = '''
import dataclasses

from fsdp_conformance.adapters.fairscale import FAIRSCALE_DEVIATIONS, FairscaleAdapter


class MyFairscale(FairscaleAdapter):
    """fairscale as released under another name: it inherits the declared deviations."""

    name = "my-fairscale"


class StaleDeclaration(FairscaleAdapter):
    """PR 972's variant (meets the bound) still declaring the released memory_bound deviation."""

    def __init__(self):
        super().__init__(sync_after_free=True)

    @property
    def declarations(self):
        return dataclasses.replace(super().declarations, known_deviations=FAIRSCALE_DEVIATIONS)
'''


@pytest.mark.parametrize(
    ("attr", "outcome", "message"),
    [
        ("MyFairscale", "xfailed", "known deviation of adapter 'my-fairscale' (memory_bound)"),
        ("StaleDeclaration", "failed", "declares a known deviation for 'memory_bound'"),
    ],
)
def test_memory_bound_cell_is_a_strict_declared_deviation(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, attr, outcome, message
) -> None:
    pytester.makepyfile(outside_fairscale=OUTSIDE_ADAPTERS)
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rfx", "-n", "0",
        "--pyargs", "fsdp_conformance.suite.test_memory_bound",
        "--fsdp-impl", f"outside_fairscale:{attr}",
        "-k", "test_limited_all_gathers_stay_within_bound and strict",
    )  # fmt: skip
    outcomes = result.parseoutcomes()
    assert outcomes.get(outcome) == 1 and "passed" not in outcomes, result.stdout.str()
    result.stdout.fnmatch_lines([f"*{message}*"])


@pytest.mark.world_size(2)
def test_generated_model_deviations_reproduce(dist):
    """The minimal reproductions of fairscale's own fuzz.generated deviations (the other two
    are the loops.* deviations, which the loop checks run): a dataclass output gets no
    pre-backward hook; a one-element flat parameter accumulates wrongly over two synchronised
    backwards. When a fairscale release fixes one, this fails and the declaration must go."""
    import dataclasses

    adapter = get_adapter("fairscale")

    @dataclasses.dataclass
    class Out:
        y: torch.Tensor

    class ReturnsDataclass(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> Out:
            return Out(self.lin(x))

    root = adapter.wrap(ReturnsDataclass(), root=True)
    with pytest.raises((ValueError, RuntimeError), match="expected to be in states|allocated"):
        root(torch.rand(2, 4)).y.sum().backward()

    def one_element_model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 2))

    def two_backwards_one_step(model: nn.Module) -> None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for micro in range(2):
            x = torch.full((1, 1), float(dist.rank + 2 * micro + 1))
            (model(x).pow(2).mean() / 2).backward()
        optimizer.step()

    reference_model = one_element_model()
    two_backwards_one_step(
        nn.parallel.DistributedDataParallel(reference_model, process_group=dist.group)
    )
    model = one_element_model()
    model[1] = adapter.wrap(model[1], root=False)
    root = adapter.wrap(model, root=True)
    two_backwards_one_step(root)
    actual, expected = adapter.full_params(root)["0.weight"], reference_model[0].weight.detach()
    assert not torch.allclose(actual, expected, atol=1e-6), (actual, expected)


@pytest.mark.world_size(2)
def test_shared_parameter_across_instances_is_untied(dist):
    """The declared wrap.shared_across_instances deviation: one step unties the tied weight."""
    from fsdp_conformance.suite.training import build

    adapter = get_adapter("fairscale")
    root, zoo_model = build(adapter, "tied_instances", dist, {})
    optimizer = torch.optim.SGD(root.parameters(), lr=0.1)
    inputs = zoo_model.get_input(dist.device)
    zoo_model.get_loss(inputs, root(*inputs)).backward()
    optimizer.step()
    params = adapter.full_params(root)
    assert not torch.equal(params["embed.weight"], params["head.weight"])


@pytest.mark.world_size(2)
def test_nested_instance_called_alone_stays_in_backward_post(dist):
    """The declared forward.other_method deviation (a nested instance called alone)."""
    from fsdp_conformance.suite.training import build
    from fsdp_conformance.training_states import InstanceState

    adapter = get_adapter("fairscale")
    root, zoo_model = build(adapter, "loops", dist, {"sharding_strategy": "FULL_SHARD"})
    root(zoo_model.get_input(dist.device)[0]).sum().backward()
    zoo_model.head(torch.rand(4, 16)).sum().backward()
    assert adapter.training_state(zoo_model.head) == InstanceState.BACKWARD_POST
