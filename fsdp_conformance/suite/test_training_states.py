"""Legal training states at every hook, IDLE after each step, `_assert_state` (``--pyargs``)."""

from __future__ import annotations

from fsdp_conformance.suite.states import BaseTrainingStateTests


class TestTrainingStates(BaseTrainingStateTests):
    pass
