"""The conformance suite as a torchrun job: same verdicts as the spawning mode, a broken
adapter fails naming its rank, and the same across two torchrun agents on localhost."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

from torchrun_jobs import clean_env, finish, junit_outcomes, leftovers, start, torchrun

# World-size-2 checks (summon, state dict; two CUDA checks that skip on CPU) and one
# world-size-1 parity check, which runs on rank 0's one-rank group while rank 1 waits.
SUBSET = (
    "test_summon_full_params and nested-writeback or test_state_dict_round_trip and nested "
    "or test_matches_ddp and nested-ws1-FULL_SHARD-bwd or cuda_allocator"
)
SUITE = ["--pyargs", "fsdp_conformance.suite", "--fsdp-impl", "impl", "--fsdp-timeout", "120"]

BROKEN = textwrap.dedent(
    '''
    import torch.distributed as dist

    from fsdp_conformance.adapters.impl import ImplAdapter


    class WritesBackOnRankOne(ImplAdapter):
        """impl whose summon_full_params(writeback=False) writes back on rank 1 only."""

        name = "writes-back-on-rank-one"

        def _summon_full_params(self, model, writeback):
            return model.summon_full_params(writeback=writeback or dist.get_rank() == 1)


    ADAPTER = WritesBackOnRankOne()
    '''
)


def spawning_outcomes(cwd: Path) -> dict[str, tuple[str, str]]:
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *SUITE, "-k", SUBSET,
               "-n", "0", "--junitxml=spawning.xml"]  # fmt: skip
    agent = finish(start(command, cwd, clean_env(cwd)), time.monotonic())
    assert agent.returncode == 0, agent.output[-3000:]
    return junit_outcomes(cwd / "spawning.xml")


def summary_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if " passed" in line and " in " in line]


def test_suite_subset_matches_the_spawning_mode(tmp_path: Path) -> None:
    expected = spawning_outcomes(tmp_path)
    # ws1 parity runs with backward prefetch and without (2 cells)
    assert sorted(o for o, _ in expected.values()) == ["passed"] * 4 + ["skipped"] * 2
    (agent,) = torchrun([*SUITE, "-k", SUBSET, "--junitxml=launcher.xml"], tmp_path)
    assert agent.returncode == 0, agent.output[-3000:]
    got = junit_outcomes(tmp_path / "launcher.xml")
    assert {name: o for name, (o, _) in got.items()} == {
        name: o for name, (o, _) in expected.items()
    }
    # skips agree, with the spawning mode's reason
    for name, (outcome, message) in got.items():
        if outcome == "skipped":
            assert "needs 1 GPU, 0 available (CPU-only host)" in message, (name, message)
    # only rank 0 reports
    assert len(summary_lines(agent.output)) == 1, agent.output[-3000:]
    assert not leftovers([agent])


def test_broken_adapter_fails_and_rank_zero_names_rank_one(tmp_path: Path) -> None:
    (tmp_path / "broken_impl.py").write_text(BROKEN)
    args = [*SUITE, "--fsdp-impl", "broken_impl:ADAPTER", "-k",
            "test_summon_full_params and nested-", "--junitxml=broken.xml"]  # fmt: skip
    (agent,) = torchrun(args, tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert agent.returncode == 1, agent.output[-3000:]
    outcomes = junit_outcomes(tmp_path / "broken.xml")
    failed = {name: message for name, (o, message) in outcomes.items() if o == "failed"}
    assert list(failed) == [
        "test_parity.TestSummonFullParams::test_summon_full_params[nested-no_writeback]"
    ], outcomes
    message = next(iter(failed.values()))
    # rank 1's own failure (only its sharded parameters changed), with its traceback, in the
    # report of rank 0 (which fails too: the full parameters it gathers changed)
    assert "rank 1 of 2 failed" in message and "===== rank 1 traceback =====" in message
    rank_one = message.split("===== rank 1 traceback =====")[1]
    assert "summon_full_params(writeback=False) changed the sharded parameters" in rank_one
    assert "rank 1 of 2 failed" in agent.output
    assert not leftovers([agent])


def test_two_torchrun_agents_on_localhost(tmp_path: Path) -> None:
    subset = "test_summon_full_params and nested-writeback or test_matches_ddp and nested-ws1-FULL_SHARD-bwd"
    # gloo: two agents on one host emulate two nodes, and on a GPU host nccl would put both on
    # cuda:<local rank 0> (nccl refuses two ranks on one GPU; real nodes have their own GPUs)
    args = [*SUITE, "-k", subset, "-rA", "--fsdp-backend", "gloo"]
    agents = torchrun(args, tmp_path, nnodes=2, nproc=1)
    assert [a.returncode for a in agents] == [0, 0], [a.output[-3000:] for a in agents]
    # one agent hosts rank 0 and prints the report; the other prints none
    reports = [a for a in agents if summary_lines(a.output)]
    assert len(reports) == 1, [a.output[-2000:] for a in agents]
    assert "3 passed" in summary_lines(reports[0].output)[0]  # ws1: with and without prefetch
    assert not leftovers(agents)
