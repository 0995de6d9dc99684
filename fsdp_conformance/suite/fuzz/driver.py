"""The fuzzing loop inside one rank set ([Note: one rank set for every example]).

[Note: one rank set for every example]
The whole hypothesis run happens inside one multi-rank call (a ``dist`` test body, or the CLI's
``fuzz_in_rank``): rank 0 runs hypothesis, broadcasts each drawn ``FuzzCase``, every rank runs
it, and the outcomes are gathered to rank 0, which decides for all; the other ranks loop until
rank 0 sends ``None``. An example costs a broadcast and a gather, never a process start, and no
two ranks can disagree about what to run next. hypothesis runs with a fixed seed, no database,
no timing health checks, phases generate + shrink (reproducible from adapter, seed, examples and
world size), and keeps its files out of the working directory (``_hypothesis_storage``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Iterator
from typing import Any

from .compare import DEVIATION, FAIL, UNSUPPORTED, combine, run_case
from .spec import FuzzCase, describe
from .strategies import MAX_NODES, MAX_STEPS, cases

HYPOTHESIS_MISSING = (
    "the fuzzer needs hypothesis, which is not installed: pip install 'fsdp-conformance[test]' "
    "(or pip install hypothesis)"
)


def require_hypothesis() -> None:
    """ImportError with ``HYPOTHESIS_MISSING`` unless hypothesis imports."""
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        raise ImportError(HYPOTHESIS_MISSING) from None


@contextlib.contextmanager
def _hypothesis_storage() -> Iterator[None]:
    """Within the block hypothesis stores under ``HYPOTHESIS_STORAGE_DIRECTORY`` when set, else
    ``fsdp-conformance/hypothesis`` under ``XDG_CACHE_HOME`` (default ``~/.cache``)."""
    from hypothesis import configuration

    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    chosen = os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY")
    previous = vars(configuration).get("__hypothesis_home_directory")
    configuration.set_hypothesis_home_dir(
        chosen or os.path.join(cache, "fsdp-conformance", "hypothesis")
    )
    try:
        yield
    finally:
        configuration.set_hypothesis_home_dir(previous)


class FuzzFailure(AssertionError):
    """A generated case failed the property (the message is the first difference)."""


class _OutOfTime(BaseException):
    """--max-seconds passed before any failure: stop generating (passes through hypothesis)."""


@dataclasses.dataclass
class FuzzResult:
    """What a fuzzing run found (on rank 0)."""

    status: str  # "pass", "fail" or "unsatisfiable" (every drawn case was refused)
    impl: str
    seed: int
    world_size: int
    examples: int = 0  # cases run and judged (pass or declared deviation)
    unsupported: int = 0  # cases the adapter refused
    deviations: int = 0  # cases covered by a declared deviation
    deviation_reasons: list[str] = dataclasses.field(default_factory=list)
    # the most frequent refusals: [first line of the refusal, count], most frequent first
    refusal_reasons: list[list[Any]] = dataclasses.field(default_factory=list)
    elapsed: float = 0.0
    cpu_seconds: float = 0.0  # rank 0's CPU time over the run (load-independent cost)
    found_at: int | None = None  # examples run when the first failure was seen
    shrinks: int = 0  # cases run while shrinking
    time_limited: bool = False  # --max-seconds ended generation or shrinking
    case: str | None = None  # repr of the minimal failing case
    description: str | None = None  # describe() of it
    message: str | None = None  # its first difference

    @property
    def rate(self) -> float:
        """Examples (run and judged) per second."""
        return self.examples / self.elapsed if self.elapsed > 0 else 0.0

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "rate": self.rate}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> FuzzResult:
        data = json.loads(text)
        data.pop("rate", None)
        return cls(**data)

    def summary(self) -> str:
        line = (
            f"{self.examples} examples in {self.elapsed:.1f} s ({self.rate:.2f} examples/s), "
            f"{self.unsupported} refused as unsupported, {self.deviations} declared deviations"
        )
        return line + (" (stopped by --max-seconds)" if self.time_limited else "")


def fuzz(
    adapter: Any,
    dist: Any,
    examples: int = 100,
    seed: int = 0,
    max_seconds: float | None = None,
    progress_file: str | None = None,
    max_steps: int = MAX_STEPS,
    max_nodes: int = MAX_NODES,
) -> FuzzResult:
    """Collective: fuzz ``adapter`` in this rank set ([Note: one rank set for every example]);
    every rank returns rank 0's result."""
    import torch
    import torch.distributed as tdist

    from .compare import probe_capabilities

    threads = torch.get_num_threads()
    # tiny tensors: one intra-op thread per rank (with ranks >= cores, OpenMP workers spin
    # against each other; measured 6.5x faster per case on the 2-CPU VM under load)
    torch.set_num_threads(1)
    try:
        caps = probe_capabilities(adapter, dist)
        if dist.rank != 0:
            _follow(adapter, dist)
            result: list[Any] = [None]
            tdist.broadcast_object_list(result, src=0)
            return result[0]
        try:
            require_hypothesis()
            strategy = cases(caps, max_steps, max_nodes)
            found = _drive(adapter, dist, strategy, examples, seed, max_seconds, progress_file)
        finally:
            tdist.broadcast_object_list([None], src=0)
        tdist.broadcast_object_list([found], src=0)
        return found
    finally:
        torch.set_num_threads(threads)


def _follow(adapter: Any, dist: Any) -> None:
    import torch.distributed as tdist

    while True:
        message: list[Any] = [None]
        tdist.broadcast_object_list(message, src=0)
        if message[0] is None:
            return
        outcome = run_case(adapter, message[0], dist)
        tdist.all_gather_object([None] * dist.world_size, outcome)


@dataclasses.dataclass
class _Search:
    """Rank 0's side of one hypothesis run: the property, and what it has seen so far."""

    adapter: Any
    dist: Any
    result: FuzzResult
    max_seconds: float | None
    progress_file: str | None
    start: float = dataclasses.field(default_factory=time.monotonic)
    # repr(case) -> (message, size), when it failed
    failing: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    minimal: Any = None  # the last case that raised (hypothesis replays the minimum last)
    last_refusal: str = "none"
    counts: dict[str, int] = dataclasses.field(default_factory=dict)  # refusal headline -> count

    def report(self) -> None:
        result = self.result
        result.elapsed = time.monotonic() - self.start
        if self.progress_file is None:
            return
        line = (
            f"examples {result.examples} ({result.unsupported} unsupported, "
            f"{result.deviations} deviations), {result.rate:.2f} examples/s"
        )
        if self.failing:
            line += (
                f", shrinking: {result.shrinks} cases tried, smallest failing case size "
                f"{min(size for _, size in self.failing.values())}"
            )
        with open(self.progress_file + ".tmp", "w", encoding="utf-8") as stream:
            stream.write(line)
        os.replace(self.progress_file + ".tmp", self.progress_file)

    def prop(self, case: FuzzCase) -> None:
        key = repr(case)
        # hypothesis replays the minimal case: do not run it again
        message = self.failing[key][0] if key in self.failing else self.judge(case, key)
        if message is not None:
            self.minimal = case
            raise FuzzFailure(message)  # one raising line: hypothesis sees one bug

    def judge(self, case: FuzzCase, key: str) -> str | None:
        import torch.distributed as tdist

        result, dist = self.result, self.dist
        if self.max_seconds is not None and time.monotonic() - self.start > self.max_seconds:
            result.time_limited = True
            if not self.failing:
                raise _OutOfTime
            return None  # shrinking past the deadline: stop with the smallest failure so far
        tdist.broadcast_object_list([case], src=0)  # the other ranks run it in _follow
        gathered: list[Any] = [None] * dist.world_size
        tdist.all_gather_object(gathered, run_case(self.adapter, case, dist))
        outcome = combine(gathered)
        if self.failing:
            result.shrinks += 1
        if outcome.kind == UNSUPPORTED:
            self.refused(outcome.message)
        if not self.failing:
            result.examples += 1
            if outcome.kind == DEVIATION:
                result.deviations += 1
                reasons = result.deviation_reasons
                if outcome.message not in reasons and len(reasons) < 5:
                    reasons.append(outcome.message)
        self.report()
        if outcome.kind != FAIL:
            return None
        if not self.failing:
            result.found_at = result.examples
        self.failing[key] = (outcome.message, case.size())
        return outcome.message

    def refused(self, message: str) -> None:
        """Count a refused case and reject it (hypothesis draws another)."""
        from hypothesis import reject

        self.result.unsupported += 1
        self.last_refusal = message
        headline = message.strip().splitlines()[0][:200] if message else ""
        self.counts[headline] = self.counts.get(headline, 0) + 1
        ranked = sorted(self.counts.items(), key=lambda kv: -kv[1])[:3]
        self.result.refusal_reasons = [[text, count] for text, count in ranked]
        self.report()
        reject()


def _drive(
    adapter: Any,
    dist: Any,
    strategy: Any,
    examples: int,
    seed: int,
    max_seconds: float | None,
    progress_file: str | None,
) -> FuzzResult:
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as fixed_seed
    from hypothesis.errors import Unsatisfiable

    result = FuzzResult("pass", adapter.name, seed, dist.world_size)
    search = _Search(adapter, dist, result, max_seconds, progress_file)
    cpu_start = time.process_time()
    test = settings(
        max_examples=examples,
        database=None,
        deadline=None,
        derandomize=False,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        verbosity=Verbosity.quiet,
        print_blob=False,
    )(fixed_seed(seed)(given(strategy)(lambda case: search.prop(case))))
    try:
        with _hypothesis_storage():
            test()
    except FuzzFailure:
        case = search.minimal
        result.status = "fail"
        result.case = repr(case)
        result.description = describe(case, dist.world_size)
        result.message = search.failing[repr(case)][0]
    except _OutOfTime:
        pass
    except Unsatisfiable:
        result.status = "unsatisfiable"
        result.message = f"every drawn case was refused; the last refusal: {search.last_refusal}"
    result.cpu_seconds = time.process_time() - cpu_start
    search.report()
    return result


def fuzz_in_rank(
    dist: Any,
    out_file: str,
    examples: int,
    seed: int,
    max_seconds: float | None = None,
    progress_file: str | None = None,
) -> None:
    """``fsdp-conformance fuzz``'s body in every rank; rank 0 writes the FuzzResult as JSON."""
    from fsdp_conformance.adapters import get_adapter

    result = fuzz(get_adapter(dist.impl), dist, examples, seed, max_seconds, progress_file)
    if dist.rank == 0:
        with open(out_file, "w", encoding="utf-8") as stream:
            stream.write(result.to_json())
