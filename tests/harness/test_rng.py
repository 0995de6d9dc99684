"""RNG state per test and per rank: every test starts from the same seeded state in every
mode, whatever ran before it; in thread mode each rank has its own RNG."""

from __future__ import annotations

import json
import random
import threading

import pytest
import torch
from fsdp_conformance.harness.wire import RANK_SEED

from conftest import write_test

try:  # numpy is optional: torch does not require it; its RNG is checked when present
    import numpy
except ImportError:
    numpy = None

pytest_plugins = ["pytester"]

DRAWS = """
import json
import os
import random

import pytest
import torch

try:
    import numpy
except ImportError:
    numpy = None


def draw_and_disturb(dist, index):
    record = {
        "torch": torch.rand(4).tolist(),
        "random": random.random(),
        "numpy": numpy.random.rand(2).tolist() if numpy is not None else None,
    }
    path = os.path.join(os.environ["HARNESS_OUT"], f"{index:02d}-rank{dist.rank}.json")
    with open(path, "w") as out:
        json.dump(record, out)
    # leave the generators somewhere else for the next test
    torch.manual_seed(1000 + index)
    torch.rand(100)
    random.seed(index)
    if numpy is not None:
        numpy.random.seed(index)


@pytest.mark.parametrize("index", range(NUMBER))
def test_draws(dist, index):
    draw_and_disturb(dist, index)
"""


def expected_draws() -> dict:
    torch.manual_seed(RANK_SEED)
    random.seed(RANK_SEED)
    if numpy is not None:
        numpy.random.seed(RANK_SEED)
    return {
        "torch": torch.rand(4).tolist(),
        "random": random.random(),
        "numpy": numpy.random.rand(2).tolist() if numpy is not None else None,
    }


@pytest.mark.parametrize(
    ("mode", "number"), [("process", 10), ("thread", 10), ("process-fresh", 2)]
)
def test_every_test_starts_from_the_same_rng_state(pytester, tmp_path, monkeypatch, mode, number):
    out = tmp_path / "draws"
    out.mkdir()
    monkeypatch.setenv("HARNESS_OUT", str(out))
    write_test(pytester, "test_draws", DRAWS.replace("NUMBER", str(number)))
    pytester.runpytest("-p", "no:cacheprovider", f"--fsdp-mode={mode}").assert_outcomes(
        passed=number
    )
    records = {p.name: json.loads(p.read_text()) for p in out.iterdir()}
    assert len(records) == 2 * number
    expected = expected_draws()
    assert {name: r for name, r in records.items() if r != expected} == {}


PER_RANK = """
import pytest
import torch
import torch.distributed as tdist
import torch.nn as nn

pytestmark = pytest.mark.fsdp_mode("thread")


def gather(dist, tensor):
    out = [torch.zeros_like(tensor) for _ in range(dist.world_size)]
    tdist.all_gather(out, tensor)
    return out


def test_ranks_seeded_differently_draw_differently(dist):
    torch.manual_seed(dist.rank)
    dist.barrier()  # the other rank seeds in between
    mine = torch.rand(8)
    assert torch.equal(mine, torch.rand(8, generator=torch.Generator().manual_seed(dist.rank)))
    everyone = gather(dist, mine)
    assert not torch.equal(everyone[0], everyone[1])


@pytest.mark.parametrize("attempt", range(3))
def test_parity_style_seed_then_build(dist, attempt):
    # the DDP-parity pattern: seed, build the same model in every rank, compare
    torch.manual_seed(0)
    dist.barrier()
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    dist.barrier()
    data = torch.rand(4, 64)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()] + [data.flatten()])
    everyone = gather(dist, flat)
    assert torch.equal(everyone[0], everyone[1])
"""


def test_thread_mode_gives_every_rank_its_own_rng(pytester):
    write_test(pytester, "test_per_rank", PER_RANK)
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=4)


def test_without_isolation_threads_race_on_the_shared_generator():
    """Control for the test above: plain threads with the same body draw different numbers,
    because torch's default generator is shared by the threads of a process."""
    barrier = threading.Barrier(2)
    draws: dict[int, torch.Tensor] = {}

    def rank(index: int) -> None:
        torch.manual_seed(0)
        barrier.wait()
        draws[index] = torch.rand(64)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not torch.equal(draws[0], draws[1])
