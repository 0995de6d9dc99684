"""The fault matrix: every fault x every mode reports within ``--fsdp-timeout`` + 10 s, names
the right rank(s) and blames no other, leaves no process and no temp file, and the next test
passes. ``docs/reliability.md`` shows the same table; it is rendered from ``EXPECTED`` below
(the data these runs check) and :func:`test_reliability_doc_is_current` fails when it differs.

One inner pytest run per mode (a subprocess): each fault test is followed by a test that must
pass in the recovered ranks.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from conftest import RECORD_PID, assert_no_leftovers, write_test

pytest_plugins = ["pytester"]

TIMEOUT_S = 5
MODES = ("process", "process-fresh", "thread")
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "reliability.md"

# fault -> how it is caused (thread mode: the substitute, where the fault cannot happen to a
# thread without ending the pytest process that hosts every rank thread)
FAULTS = {
    "raise": ("rank 1 raises ValueError", None),
    "os._exit": ("rank 1 calls os._exit(3)", "rank 1 raises SystemExit(3)"),
    "SIGSEGV": ("rank 1 gets SIGSEGV", "rank 1 raises SystemExit(-11)"),
    "SIGKILL": ("rank 0 gets SIGKILL", "rank 0 raises SystemExit(-9)"),
    "skipped collective": ("rank 1 returns without the all_reduce rank 0 enters", None),
    "mismatched collectives": ("rank 0 all_reduce, rank 1 all_gather", None),
    "sleep forever": ("rank 1 sleeps forever", None),
    "skip on one rank": ("rank 1 calls pytest.skip while rank 0 waits in a barrier", None),
}

GRACE = "3 s after the fault (grace for the waiting rank)"
NOW = "at once"
AT_TIMEOUT = f"at the timeout ({TIMEOUT_S} s) + stack dumps"
MISMATCH = (
    "mismatched collectives: rank 0 entered all_reduce (collective #1), rank 1 entered "
    "all_gather (collective #1)"
)
UNMATCHED = "never entered by the others: rank 1 finished the test after 0 collective(s)"
# an expected line with " || " between alternatives: either appears (a waiting gloo rank
# either stays blocked until the grace ends or gets "Connection closed by peer" first)
OR = " || "


def _after_death(waiting: int, dead: int) -> str:
    return (
        f"rank {waiting} of 2 hung: was still running 3 s after rank {dead} died{OR}"
        f"rank {waiting} of 2 aborted: failed in barrier (collective #1) after rank {dead} died"
    )


_P = "process"
_T = "thread"
# (fault, "process" (also process-fresh) or "thread") -> (lines the report shows, when)
EXPECTED: dict[tuple[str, str], tuple[tuple[str, ...], str]] = {
    ("raise", _P): (
        (
            "rank 1 of 2 failed: ValueError: fault in rank 1",
            ("rank 0 of 2 hung: was still running 3 s after rank 1 failed (waiting in barrier "
            "(collective #1))"),
        ),
        GRACE,
    ),
    ("raise", _T): (
        (
            "rank 1 of 2 failed: ValueError: fault in rank 1",
            ("rank 0 of 2 aborted: stopped because rank 1 failed while this rank waited in "
            "barrier (collective #1)"),
        ),
        NOW,
    ),
    ("os._exit", _P): (("rank 1 of 2 died: exited with code 3", _after_death(0, 1)), GRACE),
    ("os._exit", _T): (
        ("rank 1 of 2 failed: SystemExit: 3", "rank 0 of 2 aborted: stopped because rank 1 failed"),
        NOW,
    ),
    ("SIGSEGV", _P): (
        ("rank 1 of 2 died: killed by signal SIGSEGV (11)", _after_death(0, 1)),
        GRACE,
    ),
    ("SIGSEGV", _T): (
        (
            "rank 1 of 2 failed: SystemExit: -11",
            "rank 0 of 2 aborted: stopped because rank 1 failed",
        ),
        NOW,
    ),
    ("SIGKILL", _P): (("rank 0 of 2 died: killed by signal SIGKILL (9)", _after_death(1, 0)), GRACE),
    ("SIGKILL", _T): (
        ("rank 0 of 2 failed: SystemExit: -9", "rank 1 of 2 aborted: stopped because rank 0 failed"),
        NOW,
    ),
    ("skipped collective", _P): (
        (f"rank 0 of 2 hung: waiting in all_reduce (collective #1); {UNMATCHED}",
         "ranks that passed: 1"),
        "3 s after the last rank finished",
    ),
    ("skipped collective", _T): (
        ("rank 0 of 2 hung: ", "in all_reduce (collective #1)", UNMATCHED, "ranks that passed: 1"),
        f"at once, or at the timeout ({TIMEOUT_S} s) when rank 1 ended first",
    ),
    ("mismatched collectives", _P): ((MISMATCH,), "3 s after both ranks entered"),
    ("mismatched collectives", _T): ((MISMATCH,), NOW),
    ("sleep forever", _P): (
        (
            f"rank 1 of 2 hung: did not finish within the timeout of {TIMEOUT_S} s",
            ("rank 0 of 2 hung: waiting in barrier (collective #1) for rank(s) 1, which did not "
            f"finish within the timeout of {TIMEOUT_S} s"),
        ),
        AT_TIMEOUT,
    ),
    ("sleep forever", _T): (
        (
            f"rank 1 of 2 hung: did not finish within the timeout of {TIMEOUT_S} s",
            ("rank 0 of 2 hung: waiting in barrier (collective #1) for rank(s) 1"
            f"{OR}rank 0 of 2 aborted: never started its body"),
        ),
        AT_TIMEOUT,
    ),
    ("skip on one rank", _P): (
        (
            ("rank 0 of 2 hung: was still running 3 s after rank 1 skipped (waiting in barrier "
            "(collective #1))"),
            "rank 1 of 2 skipped: not on rank 1",
        ),
        GRACE,
    ),
    ("skip on one rank", _T): (
        (
            ("rank 0 of 2 aborted: stopped because rank 1 skipped while this rank waited in "
            "barrier (collective #1)"),
            "rank 1 of 2 skipped: not on rank 1",
        ),
        NOW,
    ),
}  # fmt: skip

# the rank(s) at fault in each cell; the others must never be reported failed, died or
# hung by their own doing
CULPRITS = {
    "raise": {1},
    "os._exit": {1},
    "SIGSEGV": {1},
    "SIGKILL": {0},
    "skipped collective": {0, 1},
    "mismatched collectives": {0, 1},
    "sleep forever": {1},
    "skip on one rank": {1},
}

INNER = (
    RECORD_PID
    + """
import signal
import sys
import time

import pytest
import torch
import torch.distributed as tdist


def body_started(dist):
    # when the body began in this rank: the delay to the report is measured from here (a
    # report's duration also counts rank start-up, which the timeout does not cover)
    record_pid()
    name = os.environ["PYTEST_CURRENT_TEST"].split("::")[-1].split(" ")[0]
    with open(os.path.join(os.environ["FAULT_TIMES"], f"{name}-{dist.rank}"), "w") as f:
        f.write(repr(time.time()))


def hard(dist, process_fault, thread_fault):
    if dist.mode == "thread":
        thread_fault()
    else:
        process_fault()


def next_test(dist):
    t = torch.ones(1)
    tdist.all_reduce(t)
    assert t.item() == dist.world_size


def test_01_raise(dist):
    body_started(dist)
    if dist.rank == 1:
        raise ValueError("fault in rank 1")
    tdist.barrier()


def test_01_raise_next(dist):
    next_test(dist)


def test_02_exit(dist):
    body_started(dist)
    if dist.rank == 1:
        hard(dist, lambda: os._exit(3), lambda: sys.exit(3))
    tdist.barrier()


def test_02_exit_next(dist):
    next_test(dist)


def test_03_sigsegv(dist):
    body_started(dist)
    if dist.rank == 1:
        hard(dist, lambda: os.kill(os.getpid(), signal.SIGSEGV), lambda: sys.exit(-11))
    tdist.barrier()


def test_03_sigsegv_next(dist):
    next_test(dist)


def test_04_sigkill(dist):
    body_started(dist)
    if dist.rank == 0:
        hard(dist, lambda: os.kill(os.getpid(), signal.SIGKILL), lambda: sys.exit(-9))
    tdist.barrier()


def test_04_sigkill_next(dist):
    next_test(dist)


def test_05_skipped_collective(dist):
    body_started(dist)
    if dist.rank == 0:
        tdist.all_reduce(torch.ones(1))


def test_05_skipped_collective_next(dist):
    next_test(dist)


def test_06_mismatched_collectives(dist):
    body_started(dist)
    if dist.rank == 0:
        tdist.all_reduce(torch.ones(2))
    else:
        tdist.all_gather([torch.ones(1), torch.ones(1)], torch.ones(1))


def test_06_mismatched_collectives_next(dist):
    next_test(dist)


def test_07_sleep_forever(dist):
    body_started(dist)
    if dist.rank == 1:
        while True:
            time.sleep(0.05)
    tdist.barrier()


def test_07_sleep_forever_next(dist):
    next_test(dist)


def test_08_skip_on_one_rank(dist):
    body_started(dist)
    if dist.rank == 1:
        pytest.skip("not on rank 1")
    tdist.barrier()


def test_08_skip_on_one_rank_next(dist):
    next_test(dist)
"""
)

RECORDER = """
import json
import os
import time


def pytest_runtest_logreport(report):
    if report.when != "call":
        return
    with open(os.environ["FAULT_LOG"], "a") as stream:
        stream.write(json.dumps({
            "name": report.nodeid.split("::")[-1],
            "outcome": report.outcome,
            "end": time.time(),
            "message": str(report.longrepr) if report.failed else "",
        }) + "\\n")
"""

# inner test name -> fault
TESTS = dict(
    zip(
        [
            "test_01_raise",
            "test_02_exit",
            "test_03_sigsegv",
            "test_04_sigkill",
            "test_05_skipped_collective",
            "test_06_mismatched_collectives",
            "test_07_sleep_forever",
            "test_08_skip_on_one_rank",
        ],
        FAULTS,
    )
)


def _kind(mode: str) -> str:
    return _T if mode == "thread" else _P


@pytest.mark.parametrize("mode", MODES)
def test_fault_matrix(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, private_tmpdir, pid_dir, mode: str
) -> None:
    write_test(pytester, "test_inner", INNER)
    pytester.makeconftest(RECORDER)
    log = pytester.path / "reports.jsonl"
    times = pytester.path / "body-times"
    times.mkdir()
    monkeypatch.setenv("FAULT_LOG", str(log))
    monkeypatch.setenv("FAULT_TIMES", str(times))
    # process-fresh starts new ranks for every test anyway: one "next" test at the end
    select = ["-k", "not _next or test_08"] if mode == "process-fresh" else []
    result = pytester.runpytest_subprocess(
        f"--fsdp-mode={mode}", f"--fsdp-timeout={TIMEOUT_S}", "-p", "no:cacheprovider", *select
    )
    reports = {r["name"]: r for r in map(json.loads, log.read_text().splitlines())}
    problems = []
    for test, fault in TESTS.items():
        report = reports[test]
        lines, _ = EXPECTED[(fault, _kind(mode))]
        message = report["message"]
        if report["outcome"] != "failed":
            problems.append(f"{fault}: {report['outcome']}, expected a failure report")
        headlines = message.split("\n\n", 1)[0]
        problems += [
            f"{fault}: missing {line!r} in:\n{headlines}"
            for line in lines
            if not any(alternative in message for alternative in line.split(OR))
        ]
        for rank in {0, 1} - CULPRITS[fault]:
            for blame in ("failed", "died", "hung: did not finish"):
                if f"rank {rank} of 2 {blame}" in message:
                    problems.append(f"{fault}: innocent rank {rank} blamed:\n{headlines}")
        began = [float(p.read_text()) for p in times.glob(f"{test}-*")]
        delay = report["end"] - min(began) if began else float("inf")
        if delay > TIMEOUT_S + 10:
            problems.append(f"{fault}: reported {delay:.1f} s after the body began")
        following = reports.get(f"{test}_next", {"outcome": "passed"})
        if following["outcome"] != "passed":
            problems.append(f"{fault}: the next test {following['outcome']}")
    assert not problems, "\n\n".join(problems)
    result.assert_outcomes(failed=8, passed=1 if mode == "process-fresh" else 8)
    assert_no_leftovers(pid_dir, private_tmpdir, min_pids=1 if mode == "thread" else 2)


def render_table() -> str:
    """The fault catalogue as docs/reliability.md shows it."""
    rows = [
        (
            "| fault | mode | what the user sees (failure report headlines) | reported | "
            "processes left | temp files left |"
        ),
        "|---|---|---|---|---:|---:|",
    ]
    for fault, (cause, thread_cause) in FAULTS.items():
        for mode in MODES:
            lines, when = EXPECTED[(fault, _kind(mode))]
            how = thread_cause if mode == "thread" and thread_cause else cause
            seen = "<br>".join(
                " *or* ".join(f"`{alternative}`" for alternative in line.split(OR))
                for line in lines
            )
            rows.append(f"| {fault}: {how} | {mode} | {seen} | {when} | 0 | 0 |")
    return "\n".join(rows) + "\n"


BEGIN = "<!-- fault table: rendered by tests/harness/test_faults.py; do not edit -->\n"
END = "<!-- end of fault table -->\n"


def test_reliability_doc_is_current() -> None:
    """docs/reliability.md's table is the one these tests check (regenerate it with
    ``python tests/harness/test_faults.py``)."""
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC} lost its table markers"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert table == render_table(), (
        f"{DOC} is out of date: run python tests/harness/test_faults.py to rewrite its table"
    )


def _rewrite_doc() -> None:
    text = DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    DOC.write_text(head + BEGIN + render_table() + END + tail)


if __name__ == "__main__":
    _rewrite_doc()
