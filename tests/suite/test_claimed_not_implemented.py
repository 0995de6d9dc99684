"""One rule for a feature an adapter claims but never implemented: the cell FAILS with one line
naming the adapter, the member to override and the feature to declare unsupported instead; the
same adapter declaring the feature unsupported gets "not applicable".

Both ways a base default says so are covered: a missing primitive (``_assert_state``, raising
``FeatureNotImplementedError``) and an ``UnsupportedFeatureError`` "override Adapter.X" (the checkpoint
check's test for ``save_checkpoint``).
"""

from __future__ import annotations

import textwrap

import pytest

pytest_plugins = ["pytester"]

ADAPTERS = textwrap.dedent(
    '''
    import dataclasses

    import pytest

    from fsdp_conformance.adapters import Adapter, Feature
    from fsdp_conformance.adapters.impl import ImplAdapter
    from fsdp_conformance.suite import BaseCheckpointResumeTests, BaseTrainingStateTests
    from fsdp_conformance.suite.test_loops import ResumeCase


    class ClaimsButLacks(ImplAdapter):
        """impl with the base defaults of two members whose features it still claims."""

        name = "claims-but-lacks"
        _assert_state = None  # a hook set to None is missing
        save_checkpoint = Adapter.save_checkpoint
        load_checkpoint = Adapter.load_checkpoint


    class DeclaresItLacks(ClaimsButLacks):
        name = "declares-it-lacks"
        declarations = dataclasses.replace(
            ImplAdapter.declarations,
            unsupported={
                **ImplAdapter.declarations.unsupported,
                Feature.ASSERT_STATE: "no state assertion",
                Feature.CHECKPOINT_RESUME: "no checkpoints",
            },
        )


    @pytest.fixture(params=["ClaimsButLacks", "DeclaresItLacks"])
    def fsdp_impl(request):
        return f"test_claims:{request.param}"


    class TestStates(BaseTrainingStateTests):
        pass


    class TestResume(BaseCheckpointResumeTests):
        cases = (ResumeCase(2, 2),)
    '''
)


def test_claimed_feature_without_its_member_fails_declared_one_is_not_applicable(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_claims=ADAPTERS)
    pytester.syspathinsert()
    result = pytester.runpytest_subprocess(
        # thread mode: a failing cell does not restart rank processes (not the subject here)
        "-p", "no:cacheprovider", "-p", "no:xdist", "-rfs", "--fsdp-mode=thread",
        "-k", "test_assert_state or test_checkpoint_resume",
    )  # fmt: skip
    result.assert_outcomes(failed=2, skipped=2)
    failed = [line for line in result.stdout.lines if line.startswith("FAILED")]
    skipped = [line for line in result.stdout.lines if line.startswith("SKIPPED")]
    assert len(failed) == 2 and len(skipped) == 2, result.stdout.str()
    assert all("ClaimsButLacks" in line for line in failed), failed
    for member, feature in (
        ("Adapter.save_checkpoint", "checkpoint_resume"),
        ("Adapter._assert_state", "assert_state"),
    ):
        assert (
            f"adapter 'claims-but-lacks' claims feature {feature!r} but does not implement it: "
            f"override {member}, or declare {feature!r} in Declarations.unsupported instead"
        ) in result.stdout.str()
    for line in skipped:
        assert "adapter 'declares-it-lacks' does not support" in line, line
