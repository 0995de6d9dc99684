"""Two suite tests run in one reused rank set keep nothing from each other (README: every test
gets a pristine rank): the two prefetch checks of one case each train and trace their own model.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

# an adapter driving impl that writes, on rank 0, one line per wrap and one per test end
_COUNTING_ADAPTER = """
import os

import torch.distributed as dist

from fsdp_conformance.adapters.impl import ImplAdapter


def _note(word):
    if dist.is_initialized() and dist.get_rank() == 0:
        with open(os.environ["COUNTING_ADAPTER_LOG"], "a") as log:
            log.write(f"{word} {os.getpid()}\\n")


class Counting(ImplAdapter):
    name = "counting-impl"

    def _wrap(self, module, process_group, config):
        _note("wrap")
        return super()._wrap(module, process_group, config)

    def on_test_end(self):
        _note("end")


ADAPTER = Counting()
"""


def test_prefetch_checks_of_one_case_do_not_share_a_trace(pytester: pytest.Pytester, monkeypatch):
    log = pytester.path / "wraps.log"
    monkeypatch.setenv("COUNTING_ADAPTER_LOG", str(log))
    pytester.makepyfile(counting_adapter=_COUNTING_ADAPTER)
    module = "fsdp_conformance.suite.test_prefetch_order::TestPrefetchOrder::"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "no:xdist", "--pyargs",
        module + "test_prefetch_happens[nested-bwd=None-fwd=0]",
        module + "test_trace_matches_golden[nested-bwd=None-fwd=0]",
        "--fsdp-impl", "counting_adapter:ADAPTER", "--fsdp-mode", "process",
    )  # fmt: skip
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("errors", 0) == 0, result.stdout.str()
    lines = log.read_text().split()
    words, pids = lines[0::2], set(lines[1::2])
    assert len(pids) == 1, f"the two tests did not run in one reused rank process: {lines}"
    per_test = "".join(word[0] for word in words).split("e")
    # two tests, each wrapping its own model (the same number of instances), then the tail
    assert per_test[2:] == [""] and per_test[0] == per_test[1] != "", words
