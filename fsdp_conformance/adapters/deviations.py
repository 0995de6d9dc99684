"""Known deviations: behaviour of an implementation that a check would fail, declared by its adapter.

An adapter lists what its implementation is known to do differently from what a check demands
(``Adapter.known_deviations``, a tuple of ``Deviation``); the check then reports an *expected
failure* carrying the reason instead of a failure. Declaring it on the adapter (not on the
command line name) means a subclass, or an adapter that delegates to another
(``Adapter.delegates_to``), keeps the deviations of the adapter it builds on.

[Note: check ids]
``Deviation.check`` is one of ``CHECK_IDS``: a dotted id per check of the suite. The case object
``applies`` receives is the check's own parameter (None where the check has none):

  memory_bound                  BaseMemoryBoundTests.test_limited_all_gathers_stay_within_bound
                                and test_shard_grad_op_keeps_backward_within_bound (BoundCase)
  exec_order.divergent          BaseExecOrderTests.test_divergent_exec_order_raises
  misuse.wrap_twice             BaseBadInputTests.test_wrapping_a_module_twice
  misuse.mixed_devices          BaseBadInputTests.test_parameters_on_mixed_devices
  misuse.forward_inside_summon  BaseBadInputTests.test_forward_inside_summon_full_params
  misuse.summon_during_forward  BaseBadInputTests.test_summon_full_params_during_forward
  misuse.sync_module_states_shapes
                                BaseBadInputTests.test_sync_module_states_with_different_shapes
  parity.ddp                    BaseDDPParityTests.test_matches_ddp (ParityCase)
  parity.bf16                   BaseDDPParityTests.test_mixed_precision_matches_fp32_ddp
                                (ParityCase)
  parity.summon_full_params     BaseSummonFullParamsTests.test_summon_full_params (writeback bool)
  parity.state_dict             BaseStateDictTests.test_state_dict_round_trip (model name)
  parity.default_state_dict     BaseStateDictTests.test_default_state_dict_round_trip (model name)
  states.legal                  BaseTrainingStateTests.test_states_are_legal_at_every_hook
                                (ParityCase)
  states.assert_state           BaseTrainingStateTests.test_assert_state
  comm.counts                   BaseCollectiveCountTests.test_counts_per_phase (strategy)
  comm.no_sync                  BaseCollectiveCountTests.test_no_reduction_inside_no_sync
                                (strategy)
  comm.prefetch_happens         BasePrefetchOrderTests.test_prefetch_happens (the config dict)
  overlap                       BaseOverlapTests' checks (None)

How a declared deviation is judged (``expect_deviation``): when the check fails, the test is an
expected failure whose reason names the failure and the deviation. When it passes, a *strict*
check fails ("declared deviation did not occur: remove it"), so a stale declaration is noticed;
the misuse and exec-order checks are not strict (an implementation that refuses the misuse after
all is simply conforming).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

# check id -> the test it names (see [Note: check ids])
CHECK_IDS: dict[str, str] = {
    "memory_bound": "two-instance memory bound of limit_all_gathers",
    "exec_order.divergent": "ranks running instances in different orders get a clear error",
    "misuse.wrap_twice": "wrapping a module that an instance already wraps is refused",
    "misuse.mixed_devices": "wrapping parameters on cpu and meta is refused",
    "misuse.forward_inside_summon": "a forward inside summon_full_params is refused",
    "misuse.summon_during_forward": "summon_full_params inside forward is refused",
    "misuse.sync_module_states_shapes": "sync_module_states with differing shapes is refused",
    "parity.ddp": "training matches DDP",
    "parity.bf16": "bf16 mixed precision matches fp32 DDP within tolerance",
    "parity.summon_full_params": "summon_full_params writeback / no writeback",
    "parity.state_dict": "state_dict / load_state_dict round trip",
    # issue 19
    "parity.default_state_dict": "the wrapped module's default state_dict() round trip",
    "states.legal": "legal training-state transitions at every hook",
    "states.assert_state": "the implementation's own state assertion",
    "comm.counts": "collectives per phase",
    "comm.no_sync": "no gradient reduction inside no_sync",
    "comm.prefetch_happens": "configured prefetches happen",
    "overlap": "communication overlaps computation",
}
# checks whose declared deviation may also pass (see [Note: check ids])
NOT_STRICT = frozenset(check for check in CHECK_IDS if check.startswith(("misuse.", "exec_order.")))


@dataclasses.dataclass(frozen=True)
class Deviation:
    """A check the implementation is known to fail, and why.

    Args:
        check: the check id, one of ``CHECK_IDS`` (e.g. ``"misuse.wrap_twice"``).
        reason: why, with a minimal reproduction and the version it was measured on.
        applies: ``applies(case) -> bool`` selects the check's cases it covers (the case object
            of [Note: check ids]); None covers every case.
    """

    check: str
    reason: str
    applies: Callable[[Any], bool] | None = None

    def __post_init__(self) -> None:
        if self.check not in CHECK_IDS:
            raise ValueError(
                f"Deviation(check={self.check!r}): unknown check id; use one of "
                f"{', '.join(sorted(CHECK_IDS))}"
            )
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError(
                f"Deviation(check={self.check!r}): give a non-empty reason (why, with a minimal "
                "reproduction)"
            )
        if self.applies is not None and not callable(self.applies):
            raise ValueError(
                f"Deviation(check={self.check!r}): applies={self.applies!r} must be None or a "
                "callable(case) -> bool"
            )

    def matches(self, check: str, case: Any = None) -> bool:
        """Whether this deviation covers ``check`` for ``case``."""
        return self.check == check and (self.applies is None or bool(self.applies(case)))


def find_deviation(deviations: Iterable[Deviation], check: str, case: Any = None) -> str | None:
    """The reason of the first of ``deviations`` covering ``check`` / ``case``, or None.

    Raises:
        ValueError: ``check`` is not a known check id.
    """
    if check not in CHECK_IDS:
        raise ValueError(f"unknown check id {check!r}; use one of {', '.join(sorted(CHECK_IDS))}")
    for deviation in deviations:
        if not isinstance(deviation, Deviation):
            raise TypeError(
                f"known_deviations holds {deviation!r}, not a Deviation; declare "
                "Deviation(check, reason, applies) entries"
            )
        if deviation.matches(check, case):
            return deviation.reason
    return None


@contextlib.contextmanager
def expect_deviation(
    adapter: Any, check: str, case: Any = None, fallback: str | None = None
) -> Iterator[None]:
    """Run a check's assertions; a declared deviation turns their failure into an xfail.

    Without a deviation for ``check`` / ``case`` the block runs unchanged. With one, a failure
    (any exception; skips pass through) becomes ``pytest.xfail`` naming the failure and the
    reason; a block that passes fails when the check is strict ([Note: check ids]).

    Args:
        adapter: the adapter under test (its ``deviation(check, case)`` is consulted).
        check: the check id.
        case: the check's case object (None where the check has none).
        fallback: the reason to use when the adapter declares none (the suite classes' deprecated
            ``known_deviations`` attributes).
    """
    import pytest

    reason = adapter.deviation(check, case) or fallback
    if reason is None:
        yield
        return
    from .base import UnsupportedFeatureError

    try:
        yield
    except UnsupportedFeatureError:
        raise  # a skip, not the deviation
    except Exception as error:  # noqa: BLE001 -- any failure of the check is the deviation
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        pytest.xfail(
            f"{type(error).__name__}: {first_line} -- known deviation of adapter "
            f"{adapter.name!r} ({check}): {reason}"
        )
    if check not in NOT_STRICT:
        raise AssertionError(
            f"adapter {adapter.name!r} declares a known deviation for {check!r} on this case, "
            f"but the check passed: remove the Deviation (or narrow its applies). "
            f"Declared reason: {reason}"
        )
