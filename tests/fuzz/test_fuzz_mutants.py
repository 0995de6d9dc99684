"""`fsdp-conformance fuzz` finds broken variants of the reference FSDP (fuzz_mutants.py) that the
fixed zoo does not catch, within 300 examples at seed 0, shrinks them, and the written repro.py
fails standalone on the variant and passes on the real implementation."""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CLI = [sys.executable, "-m", "fsdp_conformance.cli"]


def _run(command: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        command, cwd=HERE, capture_output=True, text=True, timeout=timeout, check=False
    )


def _run_together(*commands: list[str], timeout: float = 600) -> list[subprocess.CompletedProcess]:
    with concurrent.futures.ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda command: _run(command, timeout), commands))


@pytest.mark.parametrize(
    ("mutant", "shrunk_to", "standalone"),
    [
        # a parameter with fewer elements than ranks: LayerNorm(1), a Linear(.., 1) bias ...
        (
            "DROP_SMALL_GRADS",
            r"LayerNorm\(1\)|Linear\(\d+, 1|Embedding\(1, 1\)|Linear\(1, 2\)",
            True,
        ),
        # an instance called twice in one forward: the wrapped `lin` of a `twice` block
        # (found and shrunk; its repro.py runs as the first's does, so it is not run again)
        ("SECOND_USE_NOT_UNSHARDED", r"called twice", False),
        # a nested instance not loaded: after meta-device init it keeps reset_parameters' values
        ("LOAD_SKIPS_NESTED", r"built on the meta device(.|\n)*WRAPPED", False),
        # the optimizer's flat parameters replaced by a load: the round trip between steps
        ("LOAD_REPLACES_FLAT_PARAMS", r"load_state_dict\(state_dict\(\)\)", False),
    ],
)
def test_fuzz_finds_shrinks_and_reproduces(mutant: str, shrunk_to: str, standalone: bool, tmp_path):
    repro = tmp_path / "repro.py"
    found = _run(
        CLI + ["fuzz", "--impl", f"fuzz_mutants:{mutant}", "--examples", "300", "--seed", "0",
               "--out", str(repro)]
    )  # fmt: skip
    output = found.stdout + found.stderr
    assert found.returncode == 1, output
    count = re.search(r"COUNTEREXAMPLE after (\d+) examples", output)
    assert count and int(count.group(1)) <= 300, output
    description = output.split("COUNTEREXAMPLE", 1)[1]
    assert re.search(shrunk_to, description), output
    body_nodes = re.findall(r"^  body\.nodes\.\d+ =", description, flags=re.MULTILINE)
    assert len(body_nodes) <= 4, f"not shrunk:\n{output}"
    assert repro.exists()
    if not standalone:
        return
    # on the variant and on the real implementation, side by side (neither waits for the other)
    fails, fixed = _run_together(
        [sys.executable, str(repro)], [sys.executable, str(repro), "--impl", "impl"]
    )
    assert fails.returncode == 1, fails.stdout + fails.stderr
    assert "FAILS:" in fails.stdout
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "passes" in fixed.stdout
