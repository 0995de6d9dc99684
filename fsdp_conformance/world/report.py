"""Turning the ranks' outcomes of one test into one verdict and one readable message."""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdp_conformance.world.protocol import (
    ABORTED,
    DIED,
    FAILED,
    HUNG,
    PASSED,
    SKIPPED,
    XFAILED,
    RankOutcome,
)

# Order in which problems are reported: the cause first, its consequences after.
_SEVERITY = {DIED: 0, FAILED: 1, HUNG: 2, ABORTED: 3}


@dataclasses.dataclass
class Verdict:
    """The test's result as pytest / unittest should report it."""

    # PASSED, FAILED, SKIPPED or XFAILED
    status: str
    # failure report, skip / xfail reason; "" when passed
    message: str = ""
    # report properties recorded in the ranks: the lowest rank's that recorded any (every rank
    # runs the same body; a rank's own failure still decides `status`)
    properties: list[tuple[str, Any]] = dataclasses.field(default_factory=list)


def summarize(outcomes: dict[int, RankOutcome], world_size: int, mismatch: str = "") -> Verdict:
    """Combine per-rank outcomes: any failure fails, then xfail, then skip, else pass.

    A failure names every rank's outcome (failed, died, hung, aborted, skipped with its
    reason, passed); ``mismatch`` (ranks that entered different collectives as the same one,
    see ``world/collectives.py``) leads the report when given.
    """
    missing = [r for r in range(world_size) if r not in outcomes]
    for rank in missing:  # defensive: a rank that reported nothing is a harness bug
        outcomes[rank] = RankOutcome(rank, HUNG, message="reported no result")
    recorded = next(
        (o.properties for o in sorted(outcomes.values(), key=lambda o: o.rank) if o.properties),
        [],
    )
    verdict = _summarize(outcomes, world_size, mismatch)
    verdict.properties = list(recorded)
    return verdict


def _summarize(outcomes: dict[int, RankOutcome], world_size: int, mismatch: str) -> Verdict:
    problems = sorted(
        (o for o in outcomes.values() if o.status in _SEVERITY),
        key=lambda o: (_SEVERITY[o.status], o.rank),
    )
    if problems:
        message = _failure_message(problems, outcomes, world_size)
        return Verdict(FAILED, f"{mismatch}\n{message}" if mismatch else message)
    for status in (XFAILED, SKIPPED):
        ranks = [o for o in sorted(outcomes.values(), key=lambda o: o.rank) if o.status == status]
        if ranks:
            return Verdict(status, ranks[0].message)
    return Verdict(PASSED)


def _headline(outcome: RankOutcome, world_size: int) -> str:
    who = f"rank {outcome.rank} of {world_size}"
    if outcome.status == DIED:
        return f"{who} died: {outcome.message.removeprefix(f'rank {outcome.rank} ')}"
    if outcome.status == HUNG:
        return f"{who} hung: {outcome.message}"
    if outcome.status == ABORTED:
        return f"{who} aborted: {outcome.message}"
    return f"{who} failed: {outcome.message}"


def _failure_message(
    problems: list[RankOutcome], outcomes: dict[int, RankOutcome], world_size: int
) -> str:
    lines = [_headline(o, world_size) for o in problems]
    for outcome in sorted(outcomes.values(), key=lambda o: o.rank):
        if outcome.status in (SKIPPED, XFAILED):
            lines.append(f"rank {outcome.rank} of {world_size} {outcome.status}: {outcome.message}")
    passed = sorted(o.rank for o in outcomes.values() if o.status == PASSED)
    if passed:
        lines.append(f"ranks that passed: {', '.join(map(str, passed))}")
    shown: dict[str, int] = {}  # traceback text -> first rank that showed it
    for outcome in problems:
        details = outcome.traceback.rstrip()
        if not details:
            continue
        if details in shown:
            lines.append(
                f"\n===== rank {outcome.rank}: same traceback as rank {shown[details]} ====="
            )
            continue
        shown[details] = outcome.rank
        title = "stack dump" if outcome.status == HUNG else "traceback"
        lines.append(f"\n===== rank {outcome.rank} {title} =====\n{details}")
    return "\n".join(lines)
