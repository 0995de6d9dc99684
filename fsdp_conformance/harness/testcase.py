"""``RankTestCase``: a ``unittest.TestCase`` whose ``test_*`` bodies run in every rank, under
pytest or plain ``python -m unittest`` (``fsdp_conformance.testing.FSDPTest`` is this class).
"""

from __future__ import annotations

import functools
import itertools
import sys
import unittest
from collections.abc import Callable
from typing import Any

from fsdp_conformance.harness import gpus
from fsdp_conformance.harness.wire import FAILED, SKIPPED, XFAILED, TestTarget

# Hide this module's frames from unittest's and pytest's failure tracebacks.
__unittest = True


class RankTestCase(unittest.TestCase):
    """Base class whose ``test_*`` methods run in ``world_size`` ranks.

    Each rank instantiates the class for the test method, runs ``setUp``, the method and
    ``tearDown`` with the default process group initialised; ``self.rank``,
    ``self.world_size``, ``self.dist`` (the :class:`RankContext`) describe the rank.
    Class attributes ``fsdp_mode`` and ``fsdp_timeout`` (None: the session's) override per class.
    """

    fsdp_mode: str | None = None
    fsdp_timeout: float | None = None

    @property
    def world_size(self) -> int:
        """2 on CPU; the number of GPUs when there are at least two."""
        count = gpus.gpu_count()
        return count if count >= 2 and gpus.fake_gpu_count() is None else 2

    @property
    def dist(self) -> Any:
        """The rank's context (``rank``, ``group``, ``device``, ``backend``, ``tmp_path``)."""
        from fsdp_conformance.harness.rank import current_context

        if (ctx := current_context()) is None:
            raise RuntimeError(
                f"{type(self).__name__}.dist / .rank exist only while a test runs in its ranks"
            )
        return ctx

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def process_group(self) -> Any:
        return self.dist.group

    @property
    def device(self) -> Any:
        return self.dist.device

    @property
    def init_method(self) -> str:
        return self.dist.init_method

    def run_subtests(
        self,
        subtest_config: dict[str, list[Any]],
        test_fn: Callable[..., None],
        *test_args: Any,
        **test_kwargs: Any,
    ) -> None:
        """Call ``test_fn(*test_args, **test_kwargs, **combination)`` for every combination of
        ``subtest_config``'s values (name -> values), with a barrier between combinations; a
        failing combination is named in the failure."""
        keys = list(subtest_config)
        for values in itertools.product(*(subtest_config[k] for k in keys)):
            combination = dict(zip(keys, values, strict=True))
            try:
                with self.subTest(**combination):
                    test_fn(*test_args, **test_kwargs, **combination)
            except Exception as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(f"in subtest {combination}")
                raise
            self.dist.barrier()

    def run(self, result: Any = None) -> Any:
        """In the test process, the test method runs in the ranks instead."""
        from fsdp_conformance.harness.rank import current_context

        if current_context() is not None:
            return super().run(result)  # in a rank
        name = self._testMethodName
        had_attr = name in self.__dict__
        previous = self.__dict__.get(name)
        setattr(self, name, functools.partial(_run_in_ranks, self, name))
        # setUp / tearDown run in the ranks, not here
        self.setUp = self.tearDown = lambda: None  # type: ignore[method-assign]
        try:
            return super().run(result)
        finally:
            del self.setUp, self.tearDown
            if had_attr:
                setattr(self, name, previous)
            else:
                delattr(self, name)


def _run_in_ranks(case: RankTestCase, method_name: str) -> None:
    from fsdp_conformance.harness import controller

    runtime = controller.get_runtime()
    cls = type(case)
    request = controller.TestRequest(
        target=TestTarget(
            module_name=cls.__module__,
            module_file=getattr(sys.modules[cls.__module__], "__file__", None),
            class_path=tuple(cls.__qualname__.split(".")),
            function_name=method_name,
            kind="unittest",
        ),
        kwargs={},
        test_id=case.id(),
        world_size=case.world_size,
        mode=case.fsdp_mode or runtime.options.mode,
        timeout=case.fsdp_timeout or runtime.options.timeout,
        function=lambda: cls(method_name).debug(),
    )
    result = runtime.run(request)
    sys.stdout.write(result.output() + "".join(f"fsdp-conformance: {n}\n" for n in result.notes))
    verdict = result.verdict
    if verdict.status in (SKIPPED, XFAILED):
        raise unittest.SkipTest(verdict.message)
    if verdict.status == FAILED:
        if "_pytest" in sys.modules and controller.active_runtime()[1]:
            import pytest

            pytest.fail(verdict.message, pytrace=False)
        raise case.failureException(verdict.message)
