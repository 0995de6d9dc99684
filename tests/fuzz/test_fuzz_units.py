"""The fuzzer's parts without ranks: generated cases are valid and use only what the adapter
declares, the printed case and repro.py rebuild exactly that case, bad options exit 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from fsdp_conformance.adapters import Feature
from fsdp_conformance.adapters.features import ALL_FEATURES
from fsdp_conformance.suite.fuzz import model as fuzz_model
from fsdp_conformance.suite.fuzz import spec
from fsdp_conformance.suite.fuzz.repro import repro_source
from fsdp_conformance.suite.fuzz.spec import Block, FuzzCase, ModelSpec, Program, Seq, Step
from fsdp_conformance.suite.fuzz.strategies import Capabilities, _innermost, cases

EVERYTHING = Capabilities(frozenset(ALL_FEATURES - {Feature.FROZEN_PARAMETERS_MIXED}), (), 2)
BARE = Capabilities(
    frozenset(
        ALL_FEATURES
        - {
            Feature.GRADIENT_ACCUMULATION,
            Feature.CLIP_GRAD_NORM,
            Feature.FORWARD_VARIANTS,
            Feature.ACTIVATION_CHECKPOINTING,
            Feature.FROZEN_PARAMETERS,
            Feature.FROZEN_PARAMETERS_MIXED,
            Feature.NO_SHARD,
            Feature.USE_ORIG_PARAMS,
        }
    ),
    (("sharding_strategy", "SHARD_GRAD_OP"),),
    2,
)
FAST = settings(max_examples=30, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))  # fmt: skip


@FAST
@given(cases(EVERYTHING))
def test_generated_cases_build_run_and_print(case: FuzzCase):
    model = fuzz_model.build_model(case.model)
    names = {name for name, _ in model.named_modules()}
    assert set(case.plan) <= names  # every planned wrap names a module
    paths = spec.node_paths(case.model.body)
    ties: dict[int, set] = {}
    for path, node in paths:
        if isinstance(node, Block) and node.tie:
            ties.setdefault(node.tie, set()).add(_innermost(set(case.plan), path))
        if isinstance(node, Block) and node.frozen:  # not mixed: each frozen block on its own
            assert path in case.plan
    assert all(len(owners) == 1 for owners in ties.values()), case.plan
    x, tokens = fuzz_model.make_batch(case.model, 2, 0, 0, 0, "cpu")
    fuzz_model.unpack(model(x, tokens, 0)).pow(2).mean().backward()
    for step in case.program.steps:
        assert step.micro[-1] is True  # the step's last micro-batch synchronises
    rebuilt = eval(repr(case), {"__builtins__": {}}, vars(spec))  # noqa: S307
    assert rebuilt == case
    assert "wrap plan" in spec.describe(case)


def test_same_spec_same_weights_without_the_global_rng():
    case_model = ModelSpec(3, Seq((Block("linear", 3, 5), Block("embed", 5, 5, vocab=2))), seed=7)
    torch.manual_seed(1)
    first = fuzz_model.build_model(case_model).state_dict()
    torch.manual_seed(2)
    second = fuzz_model.build_model(case_model).state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)


@FAST
@given(cases(BARE))
def test_only_declared_features_are_drawn(case: FuzzCase):
    used = case.uses()
    assert not used & {"no_sync", "clip", "eval", "branch", "frozen", "checkpoint"}, used
    assert "config:sharding_strategy=SHARD_GRAD_OP" not in used  # a refused value
    assert "config:sharding_strategy=NO_SHARD" not in used  # an unsupported feature
    assert not any(key.startswith("config:use_orig_params") for key in used)


def test_repro_source_rebuilds_the_case():
    case = FuzzCase(
        ModelSpec(
            4,
            Seq((Block("linear", 4, 1, frozen=True), Seq((Block("act", 1, 1, output="dict"),)))),
        ),
        plan=("body.nodes.0",),
        config=(("sharding_strategy", "NO_SHARD"),),
        program=Program((Step((False, True), 0.05, True), Step())),
    )
    namespace: dict = {}
    source = repro_source(case, "impl", 2, 0, "boom")
    exec(compile(source, "repro.py", "exec"), namespace)  # noqa: S102
    assert namespace["CASE"] == case and namespace["IMPL"] == "impl"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--examples", "0"], "--examples 0: must be >= 1"),
        (["--seed", "-1"], "--seed -1: must be >= 0"),
        (["--max-seconds", "0"], "--max-seconds 0: must be > 0"),
        (["--world-size", "0"], "--world-size 0: must be >= 1"),
        (["--impl", "nonsense"], "unknown --impl 'nonsense'"),
        (["--out", os.sep], "is a directory"),
    ],
)
def test_bad_options_exit_2_with_one_line(option: list[str], message: str):
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_conformance.cli", "fuzz", *option],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_uses_names_what_adapter_deviations_select_on():
    branch = Block(kind="branch", width_in=4, width_out=4, output="dataclass")
    inner = Seq(nodes=(Block(kind="linear", width_in=4, width_out=4), branch), checkpoint=True)
    case = FuzzCase(
        model=ModelSpec(width=4, body=Seq(nodes=(inner,)), output="dict"),
        plan=("body.nodes.0.nodes.1",),
        program=Program(steps=(Step(micro=(True, False, True)),), batch=1),
    )
    uses = case.uses()
    # the checkpointed Seq holds an instance; the branch is one and returns a dataclass
    assert {"checkpoint:wrapped", "branch:wrapped", "instance-output:dataclass"} <= uses
    assert "instance-output:dict" in uses  # the root's output
    assert "accumulate:synced" in uses and "no_sync" in uses  # reduced before its last
    unwrapped = FuzzCase(
        model=case.model, plan=(), program=Program(steps=(Step(micro=(False, True)),), batch=1)
    )
    uses = unwrapped.uses()
    assert not {"checkpoint:wrapped", "branch:wrapped", "instance-output:dataclass"} & uses
    assert "accumulate:synced" not in uses  # only the last micro-batch reduces


@pytest.mark.parametrize(
    "token", ["precision:bf16", "precision:fp16", "precision:reduce=fp32",
              "precision:buffer=bf16", "state_dict:round_trip", "init:meta"],
)  # fmt: skip
def test_strategies_reach_the_user_promise_settings(token: str):
    from hypothesis import Phase, find

    reach = settings(FAST, max_examples=1000, phases=[Phase.generate])  # generation: cheap
    case = find(cases(EVERYTHING), lambda case: token in case.uses(), settings=reach)
    assert token in case.uses()
    assert eval(repr(case), {"__builtins__": {}}, vars(spec)) == case  # noqa: S307
    if case.precision:
        mixed = case.wrap_config["mixed_precision"]
        assert all(isinstance(dtype, torch.dtype) for dtype in mixed.values())
        assert "mixed_precision:" in spec.describe(case)


@FAST
@given(
    cases(
        Capabilities(
            EVERYTHING.supported
            - {Feature.MIXED_PRECISION, Feature.FULL_STATE_DICT, Feature.META_INIT},
            (),
            2,
        )
    )
)
def test_user_promise_settings_only_where_declared(case: FuzzCase):
    assert not case.precision and not case.meta
    assert not any(step.round_trip for step in case.program.steps)


def test_meta_build_keeps_ties_and_frozen_blocks():
    tied = Block("linear", 3, 3, tie=3, frozen=False)
    model_spec = ModelSpec(3, Seq((tied, Block("linear", 3, 3, frozen=True), tied)))
    model = fuzz_model.build_model(model_spec, "meta")
    assert all(p.is_meta for p in model.parameters())
    assert model.body.nodes[0].lin.weight is model.body.nodes[2].lin.weight
    assert not model.body.nodes[1].lin.weight.requires_grad


def test_precision_tolerance_is_the_suites_and_grows_with_layers():
    from fsdp_conformance.suite.fuzz.compare import PRECISION_LAYERS, tolerance
    from fsdp_conformance.suite.test_precision import LOSS_RTOL_PER_EPS, PARAM_ATOL_PER_EPS

    def case(blocks: int, precision: tuple = (("param_dtype", "bf16"),)) -> FuzzCase:
        body = Seq(tuple(Block("linear", 4, 4) for _ in range(blocks)))
        return FuzzCase(ModelSpec(4, body), precision=precision)

    eps = 2.0**-8
    assert tolerance(case(1), 2) == (PARAM_ATOL_PER_EPS * eps, LOSS_RTOL_PER_EPS * eps)
    deep = 2 * PRECISION_LAYERS - 1  # + the head: twice the derivation's layers
    assert tolerance(case(deep), 2) == (2 * PARAM_ATOL_PER_EPS * eps, 2 * LOSS_RTOL_PER_EPS * eps)
    assert tolerance(case(deep, ()), 2) == tolerance(case(1, ()), 2)  # float32: unchanged
    fp16 = tolerance(case(1, (("param_dtype", "fp32"), ("reduce_dtype", "fp16"))), 2)
    assert fp16 == (PARAM_ATOL_PER_EPS * 2.0**-11, LOSS_RTOL_PER_EPS * 2.0**-11)
