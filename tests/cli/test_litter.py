"""A finished command leaves nothing in the temp directory or the working directory: hypothesis
stores under ``$XDG_CACHE_HOME/fsdp-conformance/hypothesis``, a failed run's pytest log is kept
under ``$XDG_CACHE_HOME/fsdp-conformance/logs`` (interrupted ones: tests/harness/test_signals.py),
``--failed``'s record under ``.../failed``; nor do the README tutorial's commands and the demo.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# An adapter that ignores limit_all_gathers=True: the memory-bound check fails on it
NO_LIMIT = """
from fsdp_conformance.adapters.impl import ImplAdapter


class NoLimitAdapter(ImplAdapter):
    name = "no-limit"

    def _wrap(self, module, process_group, config):
        return super()._wrap(module, process_group, {**config, "limit_all_gathers": False})
"""


def _cli(
    tmp_path: Path, *args: str, module: str = "fsdp_conformance.cli"
) -> tuple[subprocess.CompletedProcess, Path, Path, Path]:
    """Run the CLI (or ``module``) in ``tmp_path/cwd`` with TMPDIR ``tmp_path/tmp`` and cache
    ``tmp_path/cache``."""
    cwd, tmp, cache = tmp_path / "cwd", tmp_path / "tmp", tmp_path / "cache"
    for folder in (cwd, tmp):
        folder.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(TMPDIR=str(tmp), XDG_CACHE_HOME=str(cache))
    env.pop("HYPOTHESIS_STORAGE_DIRECTORY", None)
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    return done, cwd, tmp, cache


def test_fuzz_keeps_hypothesis_files_in_our_cache_not_the_cwd(tmp_path: Path) -> None:
    done, cwd, tmp, cache = _cli(tmp_path, "fuzz", "--examples", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(os.listdir(cwd)) == []  # no .hypothesis/ (and no repro.py: nothing found)
    assert sorted(os.listdir(tmp)) == []
    assert (cache / "fsdp-conformance" / "hypothesis").is_dir()


def test_failed_run_keeps_its_log_in_our_cache_and_nothing_in_tmp(tmp_path: Path) -> None:
    (tmp_path / "cwd").mkdir()
    (tmp_path / "cwd" / "no_limit.py").write_text(NO_LIMIT)
    done, cwd, tmp, cache = _cli(
        tmp_path, "run", "-n", "0", "--impl", "no_limit:NoLimitAdapter",
        "-k", "test_limited_all_gathers_stay_within_bound and strict and None",
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert sorted(os.listdir(tmp)) == []
    assert sorted(p for p in os.listdir(cwd) if p != "__pycache__") == ["no_limit.py"]
    logs = list((cache / "fsdp-conformance" / "logs").iterdir())
    assert len(logs) == 1 and f"pytest output (tracebacks): {logs[0]}" in done.stderr
    assert "memory bound exceeded" in logs[0].read_text()


def test_demo_leaves_nothing_in_tmpdir(tmp_path: Path) -> None:
    # its ranks' optimizer imports torch._dynamo, which made TMPDIR/torchinductor_<user>
    done, cwd, tmp, _ = _cli(tmp_path, module="fsdp_conformance.demo")
    assert done.returncode == 0 and "match DDP" in done.stdout, done.stdout + done.stderr
    assert sorted(os.listdir(tmp)) == [] and sorted(os.listdir(cwd)) == []


def _tutorial_commands() -> list[list[str]]:
    """The ``fsdp-conformance`` commands of the README's tutorial block (``cd examples``)."""
    blocks = re.findall(
        r"```bash\n(cd examples\b.*?)```", (ROOT / "README.md").read_text(), re.DOTALL
    )
    assert len(blocks) == 1, "README.md lost its tutorial block (```bash, cd examples ...)"
    words = [shlex.split(line, comments=True) for line in blocks[0].splitlines()[1:]]
    assert all(command[:1] == ["fsdp-conformance"] for command in words), words
    return [command[1:] for command in words]


def test_readme_tutorial_leaves_nothing_in_the_clone_or_tmpdir(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "examples", tmp_path / "cwd", ignore=shutil.ignore_patterns("__py*"))
    before = sorted(os.listdir(tmp_path / "cwd"))
    commands = _tutorial_commands()
    assert [command[0] for command in commands] == ["coverage", "run", "run"], commands
    for command in commands:
        if command[0] == "run" and "--failed" not in command:  # one cell stands for the suite
            command += ["--cell", "TestCollectiveCounts::test_counts_per_phase[nested-FULL_SHARD]"]
        done, cwd, tmp, cache = _cli(tmp_path, *command)
        assert done.returncode == 0, done.stdout + done.stderr
        assert sorted(set(os.listdir(cwd)) - {"__pycache__"}) == before, command
        assert sorted(os.listdir(tmp)) == [], command
    assert "nothing to re-run" in done.stdout  # the last: --failed after a passing run
    assert list((cache / "fsdp-conformance" / "failed").iterdir())
