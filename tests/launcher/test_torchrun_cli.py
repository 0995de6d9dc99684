"""``fsdp-conformance run --launcher torchrun``: option checks, the command it builds, and one
real run with the usual matrix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_jobs import JOB_TIMEOUT_S, clean_env

from fsdp_conformance import cli
from fsdp_conformance.cli import torchrun as _cli_torchrun


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--nnodes", "2"], "--nnodes needs --launcher torchrun"),
        (["--rdzv-endpoint", "h:1"], "--rdzv-endpoint needs --launcher torchrun"),
        (["--launcher", "torchrun", "--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint"),
        (["--launcher", "torchrun", "--nnodes", "0"], "--nnodes 0: give at least 1"),
        (["--launcher", "torchrun", "--nproc-per-node", "0"], "--nproc-per-node 0: give"),
        (["--launcher", "torchrun", "--rdzv-endpoint", "node0"], "give HOST:PORT"),
        (["--launcher", "torchrun", "--rdzv-endpoint", "node0:99999"], "give HOST:PORT"),
        (["--launcher", "torchrun", "-n", "3"], "-n 3: the torchrun job runs without"),
        (["--launcher", "torchrun", "--mode", "thread"], "--mode thread: under --launcher"),
    ],
)
def test_bad_launcher_options_are_one_line_exit_2(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["run", *argv]) == 2
    err = capsys.readouterr().err
    assert error in err and err.count("\n") == 1, err


def test_torchrun_command_for_one_and_several_nodes() -> None:
    pytest_command = [sys.executable, "-m", "pytest", "--pyargs", "fsdp_conformance.suite"]
    args = cli.build_parser().parse_args(["run", "--launcher", "torchrun", "--world-size", "4"])
    assert _cli_torchrun.torchrun_command(args, pytest_command) == [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=4",
        "--standalone", "-m", "pytest", "--pyargs", "fsdp_conformance.suite",
        "--fsdp-launcher=torchrun",
    ]  # fmt: skip
    args = cli.build_parser().parse_args(
        [
            "run",
            "--launcher",
            "torchrun",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "8",
            "--rdzv-endpoint",
            "node0:29400",
        ]
    )
    command = _cli_torchrun.torchrun_command(args, pytest_command)
    assert command[3:7] == [
        "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29400"
    ]  # fmt: skip


def test_run_as_a_torchrun_job_prints_the_command_and_the_matrix(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsdp_conformance.cli",
            "run",
            "--launcher",
            "torchrun",
            "--nproc-per-node",
            "2",
            "-k",
            "test_summon_full_params and nested-writeback",
            "--json",
            "matrix.json",
            "--junit",
            "junit.xml",
        ],
        cwd=tmp_path,
        env=clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "-m torch.distributed.run --nnodes=1 --nproc-per-node=2 --standalone -m pytest" in (
        result.stderr
    )
    assert "TestSummonFullParams::test_summon_full_params  (1 configuration: 1 pass)" in (
        result.stdout
    )
    assert "  pass   nested-writeback" in result.stdout
    document = json.loads((tmp_path / "matrix.json").read_text())
    assert document["pytest_exit_code"] == 0
    # rank 0 alone wrote results: one cell, not one per rank
    assert "1 pass, 0 fail (1 cell, 1 check)" in result.stdout
    assert (tmp_path / "junit.xml").read_text().count("<testcase") == 1
