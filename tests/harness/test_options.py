"""Options and environment variables are checked when pytest configures the session: one
line naming the option or variable, exit code 4 (usage error), never a plugin-load traceback."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

PASSING = """
def test_plain():
    pass
"""


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--fsdp-timeout=0"], {}, "--fsdp-timeout='0'"),
        (["--fsdp-timeout=-5"], {}, "--fsdp-timeout='-5'"),
        (["--fsdp-timeout=abc"], {}, "--fsdp-timeout='abc'"),
        ([], {"FSDP_CONFORMANCE_TIMEOUT": "abc"}, "FSDP_CONFORMANCE_TIMEOUT='abc'"),
        ([], {"FSDP_CONFORMANCE_TIMEOUT": "0"}, "FSDP_CONFORMANCE_TIMEOUT='0'"),
        ([], {"FSDP_CONFORMANCE_MODE": "fork"}, "FSDP_CONFORMANCE_MODE='fork'"),
        ([], {"FSDP_CONFORMANCE_BACKEND": "glooo"}, "FSDP_CONFORMANCE_BACKEND='glooo'"),
        (["--fsdp-world-size=0"], {}, "--fsdp-world-size='0'"),
    ],
)
def test_bad_value_is_one_usage_line(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    env: dict[str, str],
    named: str,
) -> None:
    pytester.makepyfile(test_inner=PASSING)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    result = pytester.runpytest_subprocess(*args, "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    errors = [line for line in result.stderr.lines if line.startswith("ERROR:")]
    assert len(errors) == 1 and named in errors[0], result.stderr.str()
    assert "Traceback" not in result.stderr.str() + result.stdout.str()


def test_env_values_apply_when_valid(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(
        test_inner="""
def test_options(request):
    from fsdp_conformance.plugin import STATE_KEY

    state = request.config.stash[STATE_KEY]
    assert (state.mode, state.timeout, state.backend) == ("thread", 7.5, "gloo")
"""
    )
    monkeypatch.setenv("FSDP_CONFORMANCE_MODE", "thread")
    monkeypatch.setenv("FSDP_CONFORMANCE_TIMEOUT", "7.5")
    monkeypatch.setenv("FSDP_CONFORMANCE_BACKEND", "gloo")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_bad_timeout_marker_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner="""
import pytest


@pytest.mark.fsdp_timeout(0)
def test_zero(dist):
    pass
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*fsdp_timeout marker=0: the timeout must be*"])
    assert result.ret != pytest.ExitCode.OK
