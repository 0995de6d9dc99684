"""The check registry: every check of the conformance suite, declared once.

A *check* is one promise an FSDP implementation makes (training matches DDP, the memory bound
holds, a misuse is refused ...). Each is declared here with its dotted id, its one-line
description, the suite test(s) that implement it (``BaseClass.test_method``), the adapter
features every cell of it needs, and whether a declared deviation of it must occur. Everything
else reads this table: adapters declare deviations by id (``adapters.Deviation``), the suite's
one verdict path (``suite/verdict.py``) looks the check up, the CLI table and docs/checks.md
list it, and a test keeps it and the suite in step (every registered test exists; every suite
test is registered).

A *cell* is one run of a check (one test, one configuration). Its verdict is one of
``VERDICTS``, recorded on the pytest report as user properties (``PROPERTY_*``), so JUnit and
the CLI carry it as data.

Shared layer: imports nothing of this project, and no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

# Verdicts of a cell
PASS = "pass"
DEVIATION = "deviation"  # failed as the adapter declared (a known deviation)
NOT_APPLICABLE = "not applicable"  # the adapter lacks a feature the check needs (a skip)
FAIL = "FAIL"
VERDICTS = (FAIL, DEVIATION, PASS, NOT_APPLICABLE)  # the order a mixed cell lists them

# pytest report properties (``report.user_properties``, JUnit ``<property>``) of a cell
PROPERTY_CHECK = "fsdp_check"  # the check id
PROPERTY_VERDICT = "fsdp_verdict"  # one of VERDICTS
PROPERTY_REASON = "fsdp_reason"  # deviation reason / missing feature / failure, one line
PROPERTY_FEATURE = "fsdp_feature"  # the missing feature of a not-applicable cell
PROPERTY_FAILURE = "fsdp_failure"  # what failed in a deviating cell (the declared failure)


@dataclasses.dataclass(frozen=True)
class Check:
    """One check of the suite."""

    # dotted id, e.g. "parity.ddp" (what Deviation.check names)
    id: str
    # one line: the promise checked
    description: str
    # the suite tests implementing it, "BaseClass.test_method"
    tests: tuple[str, ...]
    # adapter features (adapters.Feature values) every cell of it needs
    features: tuple[str, ...] = ()
    # whether a declared deviation must occur (a passing cell then fails: remove the
    # declaration); False where conforming after all is fine (a misuse refused anyway)
    strict: bool = True
    # what the `case` object handed to Deviation.applies is ("" where the check has none)
    case: str = ""


_CHECKS: tuple[Check, ...] = (
    # ---------------------------------------------------------------- parity with DDP
    Check(
        "parity.ddp",
        "training matches DDP (losses and full parameters)",
        ("BaseDDPParityTests.test_matches_ddp",),
        case="configs.ParityCase",
    ),
    Check(
        "parity.bf16",
        "bf16 mixed precision matches fp32 DDP within tolerance",
        ("BaseDDPParityTests.test_mixed_precision_matches_fp32_ddp",),
        case="configs.ParityCase",
    ),
    Check(
        "parity.summon_full_params",
        "summon_full_params shows the full parameters; writeback writes them back",
        ("BaseSummonFullParamsTests.test_summon_full_params",),
        features=("summon_full_params",),
        case="writeback (bool)",
    ),
    Check(
        "parity.state_dict",
        "state_dict / load_state_dict round trip",
        ("BaseStateDictTests.test_state_dict_round_trip",),
        case="zoo model name",
    ),
    # ---------------------------------------------------------------- training states
    Check(
        "states.legal",
        "legal training-state transitions at every hook",
        ("BaseTrainingStateTests.test_states_are_legal_at_every_hook",),
        features=("training_states",),
        case="configs.ParityCase",
    ),
    Check(
        "states.assert_state",
        "the implementation's own state assertion",
        ("BaseTrainingStateTests.test_assert_state",),
        features=("assert_state",),
    ),
    # ---------------------------------------------------------------- memory bound
    Check(
        "memory_bound",
        "two-instance memory bound of limit_all_gathers (or the implementation's own bound)",
        (
            "BaseMemoryBoundTests.test_limited_all_gathers_stay_within_bound",
            "BaseMemoryBoundTests.test_shard_grad_op_keeps_backward_within_bound",
        ),
        case="memory_bound.BoundCase",
    ),
    Check(
        "memory_bound.unlimited",
        "without the limiter the lagging device keeps every all-gather resident (the bound "
        "check can fail)",
        ("BaseMemoryBoundTests.test_unlimited_all_gathers_exceed_bound",),
        features=("limit_all_gathers_off",),
        case="memory_bound.BoundCase",
    ),
    Check(
        "memory_bound.cuda",
        "the CUDA caching allocator's forward peaks respect the bound (GPU)",
        ("BaseMemoryBoundTests.test_cuda_allocator_peak_within_bound",),
        case="memory_bound.BoundCase",
    ),
    # ---------------------------------------------------------------- communication
    Check(
        "comm.counts",
        "collectives per phase",
        ("BaseCollectiveCountTests.test_counts_per_phase",),
        features=("comm_trace",),
        case="sharding strategy name",
    ),
    Check(
        "comm.no_sync",
        "no gradient reduction inside no_sync",
        ("BaseCollectiveCountTests.test_no_reduction_inside_no_sync",),
        features=("comm_trace",),
        case="sharding strategy name",
    ),
    Check(
        "comm.prefetch_happens",
        "configured prefetches happen",
        ("BasePrefetchOrderTests.test_prefetch_happens",),
        features=("comm_trace",),
        case="the wrap config dict",
    ),
    Check(
        "comm.prefetch_golden",
        "the prefetch order matches the recorded golden",
        ("BasePrefetchOrderTests.test_trace_matches_golden",),
        features=("comm_trace",),
        case="the golden case name",
    ),
    Check(
        "overlap",
        "communication overlaps computation",
        (
            "BaseOverlapTests.test_prefetch_overlaps_communication_cpu",
            "BaseOverlapTests.test_prefetch_overlaps_communication_cuda",
        ),
    ),
    # ---------------------------------------------------------------- misuse
    Check(
        "exec_order.divergent",
        "ranks running instances in different orders get a clear error",
        ("BaseExecOrderTests.test_divergent_exec_order_raises",),
        strict=False,
    ),
    Check(
        "misuse.wrap_twice",
        "wrapping a module that an instance already wraps is refused",
        ("BaseBadInputTests.test_wrapping_a_module_twice",),
        strict=False,
    ),
    Check(
        "misuse.mixed_devices",
        "wrapping parameters on cpu and meta is refused",
        ("BaseBadInputTests.test_parameters_on_mixed_devices",),
        strict=False,
    ),
    Check(
        "misuse.forward_inside_summon",
        "a forward inside summon_full_params is refused",
        ("BaseBadInputTests.test_forward_inside_summon_full_params",),
        features=("summon_full_params",),
        strict=False,
    ),
    Check(
        "misuse.summon_during_forward",
        "summon_full_params inside forward is refused",
        ("BaseBadInputTests.test_summon_full_params_during_forward",),
        features=("summon_full_params",),
        strict=False,
    ),
    Check(
        "misuse.sync_module_states_shapes",
        "sync_module_states with differing shapes is refused",
        ("BaseBadInputTests.test_sync_module_states_with_different_shapes",),
        features=("sync_module_states",),
        strict=False,
    ),
    # ---------------------------------------------------------------- (issue 21: loops.*)
    Check(
        "loops.grad_accumulation",
        "gradient accumulation (micro-batches under no_sync, or synchronising each) matches DDP",
        ("BaseGradientAccumulationTests.test_accumulation_matches_ddp",),
        case="suite.loops.LoopCase",
    ),
    Check(
        "loops.grad_accumulation_comm",
        "no gradient reduction while sync is off; when it is on, every trainable instance "
        "reduces, at most once per parameter gathered in its forward",
        ("BaseGradientAccumulationTests.test_no_reduction_while_accumulating",),
        features=("gradient_accumulation", "comm_trace"),
        case="suite.loops.LoopCase",
    ),
    Check(
        "loops.clipping",
        "clip_grad_norm_ returns DDP's global norm (2, inf), really clips, and trains as DDP",
        ("BaseGradientClippingTests.test_clipping_matches_ddp",),
        features=("clip_grad_norm",),
        case="suite.loops.LoopCase",
    ),
    Check(
        "loops.frozen",
        "frozen parameters stay bit-identical (none reduced), the rest trains as DDP",
        ("BaseFrozenParameterTests.test_frozen_parameters",),
        case="suite.loops.LoopCase",
    ),
    Check(
        "loops.activation_checkpointing",
        "activation checkpointing in wrapped blocks: recomputes, legal states, matches DDP",
        ("BaseActivationCheckpointingTests.test_activation_checkpointing",),
        features=("activation_checkpointing",),
        case="suite.loops.LoopCase",
    ),
    Check(
        "loops.forward_variants",
        "unused branch, two forwards per backward, no_grad eval: match DDP, legal, resharded",
        ("BaseForwardVariantsTests.test_forward_variant",),
        features=("forward_variants",),
        case="suite.loops.LoopCase",
    ),
    Check(
        "loops.checkpoint_resume",
        "save/load of model and optimizer (same and other world size) resumes exactly",
        ("BaseCheckpointResumeTests.test_checkpoint_resume",),
        features=("checkpoint_resume",),
        case="suite.loops.ResumeCase",
    ),
    # ---------------------------------------------------------------- (issue 19)
    Check(
        "parity.default_state_dict",
        "the wrapped module's default state_dict() / load_state_dict() round trip",
        ("BaseStateDictTests.test_default_state_dict_round_trip",),
        case="zoo model name",
    ),
    # ---------------------------------------------------------------- (issue 20: fuzz.*)
    Check(
        "fuzz.generated",
        "generated models, wrap plans, configs and training programs match DDP, with legal "
        "states and no hang (shrunk to a repro.py)",
        ("BaseGeneratedModelTests.test_generated_models_match_ddp",),
        strict=False,
        case="the generated FuzzCase (per case; None for the whole cell)",
    ),
    # ---------------------------------------------------------------- precision.* (precision.dtypes, precision.grad_scaler)
    Check(
        "precision.dtypes",
        "mixed precision observed: forward in param_dtype, reductions in reduce_dtype, fp32 "
        "shards and gradients, buffers and their state dict in the promised dtype, fp32 "
        "accumulation over many micro-batches, training within tolerance of fp32 DDP",
        ("BasePrecisionTests.test_dtypes", "BasePrecisionTests.test_accumulation"),
        features=("mixed_precision", "mixed_precision_policy"),
        case="suite.loops.LoopCase",
    ),
    Check(
        "precision.grad_scaler",
        "the implementation's grad scaler with an inf gradient on one rank: every rank skips "
        "the step, the scale shrinks identically, parameters equal DDP + GradScaler's",
        ("BasePrecisionTests.test_grad_scaler",),
        features=("grad_scaler",),
        case="suite.loops.LoopCase",
    ),
    #
    # ---------------------------------------------------------------- state_dict.full, init.meta
    Check(
        "state_dict.full",
        "the full state dict has the plain module's keys and DDP's values, loads both ways "
        "(strict, assign, via DCP on a subgroup) and trains as DDP",
        (
            "BaseFullStateDictTests.test_full_state_dict",
            "BaseFullStateDictTests.test_mixed_precision_buffers",
            "BaseFullStateDictTests.test_load_plain_state_dict",
            "BaseFullStateDictTests.test_on_a_subgroup",
        ),
        features=("full_state_dict",),
        case="suite.test_state_dict.StateDictCase",
    ),
    Check(
        "init.meta",
        "a meta-device model materialised the implementation's way: nothing left on meta, "
        "nested instances initialised once, then loaded and trained as DDP",
        ("BaseMetaInitTests.test_meta_init",),
        features=("meta_init",),
        case="wrapping: 'nested' (inner first by hand) or 'auto_wrap'",
    ),
    #
    # ---------------------------------------------------------------- sharding.* (sharding.uneven, sharding.hybrid), wrap.shared_across_instances
    Check(
        "sharding.uneven",
        "at world size 3, parameters not divisible by 3, an empty shard and a 1-element "
        "parameter train as DDP (losses, gradient shards, full parameters, full state dict)",
        ("BaseUnevenShardingTests.test_uneven_shards_match_ddp",),
        case="suite.test_sharding.ShardingCase",
    ),
    Check(
        "sharding.hybrid",
        "hybrid sharding on a 2 x 2 mesh trains as DDP at world size 4; gradients "
        "reduce-scattered within the shard group, all-reduced across replicas",
        ("BaseHybridShardingTests.test_hybrid_matches_ddp",),
        features=("hybrid_shard", "comm_trace"),
        case="suite.test_sharding.ShardingCase",
    ),
    Check(
        "wrap.shared_across_instances",
        "one parameter used by two instances (tied embedding and head wrapped apart): a clear "
        "error at wrap naming the parameter, or training that matches DDP",
        ("BaseSharedParamsTests.test_shared_parameter_across_instances",),
        case="suite.loops.LoopCase",
    ),
    #
    # ---------------------------------------------------------------- optim.param_groups, wrap.ignored, forward.other_method
    Check(
        "optim.param_groups",
        "optimizer parameter groups by name (no weight decay on biases and norms, one block at "
        "another learning rate): AdamW matches DDP",
        ("BaseParamGroupTests.test_param_groups_match_ddp",),
        features=("param_groups",),
        case="suite.loops.LoopCase",
    ),
    Check(
        "wrap.ignored",
        "ignored parameters, alone and under an auto-wrap policy: registered whole on every "
        "rank, not reduced, in the state dict under their keys; the rest trains as DDP",
        ("BaseIgnoredParamsTests.test_ignored_params",),
        features=("ignored_params",),
        case="suite.loops.LoopCase",
    ),
    Check(
        "forward.other_method",
        "a registered method other than forward, and a nested instance's forward called alone: "
        "parameters unsharded while used, legal states, resharded after, matches DDP",
        ("BaseForwardMethodTests.test_other_forward_method",),
        case="suite.loops.LoopCase",
    ),
    #
    # ---------------------------------------------------------------- memory.reshard_after_forward, wrap.configs_isolated
    Check(
        "memory.reshard_after_forward",
        "with resharding after forward configured (FULL_SHARD), no unsharded parameter of a "
        "non-root instance stays alive after the model's forward",
        ("BaseReshardAfterForwardTests.test_no_unsharded_parameter_after_forward",),
        case="suite.loops.LoopCase",
    ),
    Check(
        "wrap.configs_isolated",
        "two models wrapped in one process with different configurations (mixed precision, "
        "sharding) each behave by their own and train as DDP",
        ("BaseConfigIsolationTests.test_two_configs_in_one_process",),
        case="the axis that differs: 'mixed_precision' or 'sharding'",
    ),
)

CHECKS: dict[str, Check] = {}
for _check in _CHECKS:
    if _check.id in CHECKS:
        raise RuntimeError(f"check id {_check.id!r} is declared twice in fsdp_conformance.checks")
    CHECKS[_check.id] = _check
del _check


def get_check(check_id: str) -> Check:
    """The registered check `check_id`.

    Raises:
        ValueError: no such check; the message lists the known ids.
    """
    try:
        return CHECKS[check_id]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown check id {check_id!r}; use one of {', '.join(sorted(CHECKS))} "
            "(fsdp_conformance.checks.CHECKS)"
        ) from None


def check_for_test(class_names: Iterable[str], function_name: str) -> Check | None:
    """The check implemented by test `function_name` of a class whose MRO holds one of
    `class_names` (a suite base class or a subclass of it), or None."""
    names = set(class_names)
    for check in CHECKS.values():
        for test in check.tests:
            class_name, _, method = test.rpartition(".")
            if method == function_name and class_name in names:
                return check
    return None


def registered_tests() -> dict[str, str]:
    """``"BaseClass.test_method"`` -> check id, for every registered test."""
    return {test: check.id for check in CHECKS.values() for test in check.tests}


def verdict_of_outcome(
    outcome: str, expected_failure: bool, recorded: dict[str, str], text: str
) -> tuple[str, str]:
    """(verdict, reason) of a cell from pytest's final outcome, keeping what its check recorded.

    When the outcome disagrees with the recorded verdict (a rank failed on its own, the test
    hung, the body never reached its cell), the outcome decides, with `text` (one line of the
    failure or skip) as the reason.

    Args:
        outcome: the report's outcome, "passed", "failed" or "skipped".
        expected_failure: whether the report is an expected failure (``wasxfail``).
        recorded: the ``PROPERTY_*`` values the check recorded (may be empty).
        text: one line of the report's failure / skip / xfail text.
    """
    if outcome == "failed":
        verdict = FAIL
    elif outcome == "skipped":
        verdict = DEVIATION if expected_failure else NOT_APPLICABLE
    elif expected_failure:  # an xfail marker that passed: we never set one, so it is a defect
        return FAIL, f"unexpectedly passed: {text}"
    else:
        verdict = PASS
    if recorded.get(PROPERTY_VERDICT) == verdict:
        return verdict, recorded.get(PROPERTY_REASON, "")
    return verdict, "" if verdict == PASS else " ".join(text.split())


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


@dataclasses.dataclass(frozen=True)
class Result:
    """The verdict of one cell, the one record every reader takes it from: decided by the
    check's cell in a rank (suite/verdict.py) or, for a cell that never reached its check, by
    the plugin from pytest's outcome. It travels as the report properties ``PROPERTY_*``."""

    # the check id ("" when the test is no registered check)
    check: str
    # one of VERDICTS
    verdict: str
    # one line: deviation reason, why not applicable, what failed ("" for a pass)
    reason: str = ""
    # PROPERTY_FAILURE: what failed in a deviating cell (None: not recorded)
    failure: str | None = None
    # PROPERTY_FEATURE: the missing feature of a not-applicable cell (None: not recorded)
    feature: str | None = None

    def properties(self) -> list[tuple[str, str]]:
        """The record as report properties, each value on one line."""
        pairs = [
            (PROPERTY_CHECK, self.check),
            (PROPERTY_VERDICT, self.verdict),
            (PROPERTY_REASON, _one_line(self.reason)),
        ]
        if self.feature is not None:
            pairs.append((PROPERTY_FEATURE, _one_line(self.feature)))
        if self.failure is not None:
            pairs.append((PROPERTY_FAILURE, _one_line(self.failure)))
        return pairs

    @classmethod
    def from_properties(cls, properties: Iterable[tuple[str, object]]) -> Result | None:
        """The record among report properties (the last value of each wins), or None."""
        values = {name: str(value) for name, value in properties}
        if PROPERTY_VERDICT not in values:
            return None
        return cls(
            values.get(PROPERTY_CHECK, ""),
            values[PROPERTY_VERDICT],
            values.get(PROPERTY_REASON, ""),
            values.get(PROPERTY_FAILURE),
            values.get(PROPERTY_FEATURE),
        )

    @classmethod
    def of_report(cls, check: str, report: object, recorded: Result | None = None) -> Result:
        """The record of a pytest report (a ``TestReport`` or ``CollectReport``): ``recorded``
        when the report's outcome agrees with it, else the verdict the outcome implies
        (``verdict_of_outcome``) with the report's one-line failure, skip or xfail text."""
        outcome = str(getattr(report, "outcome", "failed"))
        expected_failure = hasattr(report, "wasxfail")
        kept = dict(recorded.properties()) if recorded is not None else {}
        verdict, reason = verdict_of_outcome(outcome, expected_failure, kept, report_line(report))
        if recorded is not None and recorded.verdict == verdict:
            return recorded
        return cls(check, verdict, reason)

    @property
    def outcome(self) -> str:
        """The CLI's outcome of the cell: pass, fail, xfail or skip."""
        return _OUTCOME_OF_VERDICT[self.verdict]


_OUTCOME_OF_VERDICT = {PASS: "pass", FAIL: "fail", DEVIATION: "xfail", NOT_APPLICABLE: "skip"}


def report_line(report: object) -> str:
    """One line of a pytest report's failure, skip or xfail: the skip reason, the xfail reason,
    or the first line of the crash's message (read from the report's objects)."""
    longrepr = getattr(report, "longrepr", None)
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (file, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    wasxfail = str(getattr(report, "wasxfail", "")).removeprefix("reason: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = wasxfail or (crash.message if crash is not None else str(longrepr or ""))
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def registry_table() -> str:
    """The registry as a Markdown table (docs/checks.md holds it, checked by a test)."""
    lines = [
        "| check id | promise | tests | needs | strict | case (`Deviation.applies`) |",
        "|---|---|---|---|---|---|",
    ]
    for check in CHECKS.values():
        tests = "<br>".join(f"`{test}`" for test in check.tests)
        needs = ", ".join(f"`{feature}`" for feature in check.features) or "—"
        case = check.case or "None"
        strict = "yes" if check.strict else "no"
        lines.append(
            f"| `{check.id}` | {check.description} | {tests} | {needs} | {strict} | {case} |"
        )
    return "\n".join(lines)
