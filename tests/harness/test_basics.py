"""The `dist` fixture contract: every rank runs the body; parametrize, fixtures, classes,
markers and options work; per-test state is reset in reused rank processes."""

from __future__ import annotations

import subprocess
import sys

from conftest import runtime_files, write_test

pytest_plugins = ["pytester"]

CONTRACT = """
import os
import pathlib
import threading

import pytest
import torch
import torch.distributed as tdist

from fsdp_conformance.harness import InRank


def gather_ranks(dist):
    out = [None] * dist.world_size
    tdist.all_gather_object(out, dist.rank)
    return out


@pytest.fixture
def plain_value():
    return {"a": [1, 2, 3]}


@pytest.fixture
def env_from_fixture(monkeypatch):
    monkeypatch.setenv("HARNESS_FIXTURE_ENV", "set-in-parent")


def build_in_rank(prefix, dist):
    return f"{prefix}-{dist.rank}"


@pytest.fixture
def per_rank_value():
    return InRank(build_in_rank, "built")


@pytest.fixture
def lock():
    return threading.Lock()


@pytest.mark.parametrize("x", [1, 2])
@pytest.mark.parametrize("name", ["p", "q"])
def test_parametrized(dist, x, name, plain_value, tmp_path):
    assert gather_ranks(dist) == list(range(dist.world_size))
    assert plain_value == {"a": [1, 2, 3]} and x in (1, 2) and name in "pq"
    assert isinstance(tmp_path, pathlib.Path)


def test_context(dist):
    assert dist.world_size == 2 and dist.backend == "gloo" and dist.mode == "process"
    assert dist.device == torch.device("cpu")
    assert dist.group is tdist.group.WORLD and tdist.get_rank() == dist.rank
    assert dist.impl == "my_fsdp:ADAPTER"
    assert dist.init_method.startswith("file://")
    (dist.tmp_path / f"rank{dist.rank}").write_text("x")
    dist.barrier()
    assert sorted(p.name for p in dist.tmp_path.iterdir()) == ["rank0", "rank1"]
    assert os.environ["RANK"] == str(dist.rank)


def test_tmp_path_is_fresh(dist):
    assert list(dist.tmp_path.iterdir()) == []


@pytest.mark.world_size(3)
def test_world_size_marker(dist):
    assert gather_ranks(dist) == [0, 1, 2]


@pytest.mark.world_size(1)
def test_world_size_one(dist):
    assert dist.world_size == 1


def test_environment_reaches_ranks(dist, env_from_fixture):
    assert os.environ["HARNESS_FIXTURE_ENV"] == "set-in-parent"


def test_in_rank_fixture(dist, per_rank_value):
    assert per_rank_value == f"built-{dist.rank}"


def test_unpicklable_fixture(dist, lock):
    pass


class TestInAClass:
    def test_method(self, dist):
        assert gather_ranks(dist) == [0, 1]

    class TestNested:
        def test_nested(self, dist):
            assert dist.rank in (0, 1)


def test_leaves_state_behind(dist):
    torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    tdist.new_group([0, 1])
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)


def test_state_was_reset(dist):
    from torch.nn.modules import module

    assert not module._global_forward_hooks
    world = tdist.distributed_c10d._world
    assert list(world.pg_map) == [world.default_pg]
    assert torch.get_default_dtype() == torch.float32
    assert torch.is_grad_enabled()


@pytest.fixture
def world_shape(dist):
    return dist.world_size


def test_dist_only_through_a_fixture(world_shape):
    assert tdist.is_initialized() and tdist.get_world_size() == world_shape == 2


def test_dist_outside_the_body(request):
    placeholder = request.getfixturevalue("dist")
    assert placeholder.world_size == 2
    with pytest.raises(AttributeError, match="only available inside the test body"):
        placeholder.rank
"""


def test_dist_fixture_contract(pytester, private_tmpdir):
    write_test(pytester, "test_contract", CONTRACT)
    result = pytester.runpytest("-p", "no:cacheprovider", "--fsdp-impl=my_fsdp:ADAPTER", "-v")
    result.assert_outcomes(passed=16, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_unpicklable_fixture*",
            "*fixture 'lock' (a _thread.lock) cannot be sent to the rank processes*",
        ]
    )
    assert runtime_files(private_tmpdir) == []


def test_default_world_size_option(pytester):
    write_test(
        pytester,
        "test_ws",
        "def test_ws(dist):\n    assert dist.world_size == 3\n",
    )
    pytester.runpytest("-p", "no:cacheprovider", "--fsdp-world-size=3").assert_outcomes(passed=1)


def test_options_and_markers_are_registered(pytester):
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(
        [
            "*fsdp-conformance*",
            "*--fsdp-mode={process,process-fresh,thread}*",
            "*--fsdp-timeout=SECONDS*",
            "*--fsdp-world-size=N*",
            "*--fsdp-impl=NAME*",
            "*--fsdp-backend=NAME*",
        ]
    )
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["*world_size(n)*", "*fsdp_mode(name)*", "*gpus(n)*", "*cuda*"])


def test_plugin_is_import_light():
    code = (
        "import sys, fsdp_conformance.plugin, fsdp_conformance.harness.controller, "
        "fsdp_conformance.harness; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
