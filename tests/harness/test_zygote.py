"""Rank processes forked by the zygote start as a fresh interpreter would (own session, stdin
from /dev/null, the controller's cwd and environment at spawn); one zygote serves every spawn
with its import-time environment; without a zygote a rank is a fresh interpreter."""

from __future__ import annotations

import os

import pytest

from fsdp_conformance.harness import zygote

pytest_plugins = ["pytester"]


@pytest.mark.skipif(not zygote.available(), reason="the zygote needs Linux (fork, SCM_RIGHTS)")
def test_forked_rank_starts_like_an_interpreter(tmp_path, monkeypatch, rank_probe):
    monkeypatch.setenv("ZYGOTE_TEST_MARKER", "first")
    first = rank_probe("first")
    assert first["session_leader"] and first["stdin"] == os.devnull
    assert first["cwd"] == str(tmp_path) and first["env"].get("ZYGOTE_TEST_MARKER") == "first"
    assert first["parent"] != os.getpid()  # forked by a zygote, not started by us
    monkeypatch.setenv("ZYGOTE_TEST_MARKER", "second")  # not read at import time: same zygote
    second = rank_probe("second")
    assert (
        second["env"].get("ZYGOTE_TEST_MARKER") == "second" and second["parent"] == first["parent"]
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # read when torch starts: a zygote of its own
    other = rank_probe("other")
    assert other["env"].get("OMP_NUM_THREADS") == "2" and other["parent"] not in (
        first["parent"],
        os.getpid(),
    )


@pytest.mark.skipif(not zygote.available(), reason="the zygote needs Linux (fork, SCM_RIGHTS)")
def test_a_zygote_imports_the_preloaded_modules_before_it_forks(monkeypatch, rank_probe):
    monkeypatch.setattr(zygote, "_preload", set())
    zygote.preload(["fsdp_conformance.suite.test_exec_order", "no_such_module_here"])
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # an import-time environment of its own
    seen = rank_probe("preloaded")  # (the probe itself imports no suite module)
    assert "fsdp_conformance.suite.test_exec_order" in seen["suite_modules"]


def test_the_plugin_preloads_the_suite_modules_it_collected(pytester):
    pytester.makeconftest(
        """
        def pytest_collection_finish(session):
            from fsdp_conformance.harness import zygote
            print("preload:", sorted(zygote._preload))
        """
    )
    pytester.makepyfile(test_mine="def test_mine(dist): pass")
    result = pytester.runpytest_subprocess(
        "--collect-only", "-q", "test_mine.py", "--pyargs", "fsdp_conformance.suite.test_exec_order"
    )
    result.stdout.fnmatch_lines(["preload: ['fsdp_conformance.suite.test_exec_order']"])


def test_without_a_zygote_a_rank_is_a_fresh_interpreter(tmp_path, monkeypatch, rank_probe):
    monkeypatch.setattr(zygote, "available", lambda: False)
    monkeypatch.setenv("ZYGOTE_TEST_MARKER", "fresh")
    fresh = rank_probe("fresh")
    assert fresh["parent"] == os.getpid() and fresh["env"].get("ZYGOTE_TEST_MARKER") == "fresh"
    assert fresh["session_leader"] and fresh["stdin"] == os.devnull


def test_a_zygote_that_does_not_answer_is_replaced_by_an_interpreter(monkeypatch, rank_probe):
    monkeypatch.setattr(zygote, "SPAWN_TIMEOUT_S", 1.0)
    monkeypatch.setattr(zygote, "_COMMAND", "import time; time.sleep(600)")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # an import-time environment of its own
    seen = rank_probe("hung")
    assert seen["parent"] == os.getpid() and seen["env"]["OMP_NUM_THREADS"] == "3"
