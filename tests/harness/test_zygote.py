"""Rank processes forked by the zygote start as a fresh interpreter would (own session, stdin
from /dev/null, the controller's cwd and environment at spawn); one zygote serves every spawn
with its import-time environment; without a zygote a rank is a fresh interpreter."""

from __future__ import annotations

import json
import os

import pytest

from fsdp_conformance.harness import zygote
from fsdp_conformance.harness.controller import run_function

PROBE = """
import json, os

def probe(dist, out):
    with open(out, "w") as stream:
        json.dump({
            "session_leader": os.getsid(0) == os.getpid(),
            "stdin": os.path.realpath(f"/proc/self/fd/0"),
            "cwd": os.getcwd(),
            "marker": os.environ.get("ZYGOTE_TEST_MARKER"),
            "threads": os.environ.get("OMP_NUM_THREADS"),
            "parent": os.getppid(),
        }, stream)
"""


def _probe(tmp_path, name: str) -> dict:
    out = tmp_path / f"{name}.json"
    result = run_function(
        "zygote_probe",
        "probe",
        {"out": str(out)},
        world_size=1,
        timeout=120,
        impl="impl",
        test_id=name,
        backend="gloo",
    )
    assert result.verdict.status == "passed", result.verdict.message
    return json.loads(out.read_text())


@pytest.fixture
def probe_module(tmp_path, monkeypatch):
    (tmp_path / "zygote_probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)


@pytest.mark.skipif(not zygote.available(), reason="the zygote needs Linux (fork, SCM_RIGHTS)")
def test_forked_rank_starts_like_an_interpreter(tmp_path, monkeypatch, probe_module):
    monkeypatch.setenv("ZYGOTE_TEST_MARKER", "first")
    first = _probe(tmp_path, "first")
    assert first["session_leader"] and first["stdin"] == os.devnull
    assert first["cwd"] == str(tmp_path) and first["marker"] == "first"
    assert first["parent"] != os.getpid()  # forked by a zygote, not started by us
    monkeypatch.setenv("ZYGOTE_TEST_MARKER", "second")  # not read at import time: same zygote
    second = _probe(tmp_path, "second")
    assert second["marker"] == "second" and second["parent"] == first["parent"]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # read when torch starts: a zygote of its own
    other = _probe(tmp_path, "other")
    assert other["threads"] == "2" and other["parent"] not in (first["parent"], os.getpid())


def test_without_a_zygote_a_rank_is_a_fresh_interpreter(tmp_path, monkeypatch, probe_module):
    monkeypatch.setattr(zygote, "available", lambda: False)
    monkeypatch.setenv("ZYGOTE_TEST_MARKER", "fresh")
    fresh = _probe(tmp_path, "fresh")
    assert fresh["parent"] == os.getpid() and fresh["marker"] == "fresh"
    assert fresh["session_leader"] and fresh["stdin"] == os.devnull
