"""From a red cell back to it in seconds: every failing or deviating cell carries the shell line
that re-runs it alone (matrix, Markdown, JSON, JUnit), that line pasted in another directory
runs exactly that cell and fails the same way (a suite cell and the fuzz cell), and
``run --failed`` re-runs only the last run's failures, whose record is kept in the user's cache.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

# Ignores limit_all_gathers=True (the memory-bound cells fail) and zeroes every gradient before
# its reduction (the generated models differ from DDP: the fuzz cell fails); the overlap of
# communication with computation is untouched (its cell passes)
BROKEN = """
from fsdp_conformance.adapters.impl import ImplAdapter


class Broken(ImplAdapter):
    name = "broken"

    def _wrap(self, module, process_group, config):
        from fsdp_conformance.impl.flat_param import FlatParamHandle

        if not hasattr(FlatParamHandle, "original_reduction"):
            FlatParamHandle.original_reduction = FlatParamHandle.start_grad_reduction

            def start_grad_reduction(handle):
                if handle.unsharded.grad is not None:
                    handle.unsharded.grad.zero_()
                return FlatParamHandle.original_reduction(handle)

            FlatParamHandle.start_grad_reduction = start_grad_reduction
        return super()._wrap(module, process_group, {**config, "limit_all_gathers": False})
"""
BOUND = "TestMemoryBound::test_limited_all_gathers_stay_within_bound"
FUZZ = "TestGeneratedModels::test_generated_models_match_ddp"


def _shell(line: str, cwd: Path, cache: Path) -> subprocess.CompletedProcess:
    """``line`` run by bash in ``cwd`` as a user pastes it (TMPDIR and the cache in tmp_path)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(TMPDIR=str(cache.parent / "tmp"), XDG_CACHE_HOME=str(cache))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    (cache.parent / "tmp").mkdir(exist_ok=True)
    return subprocess.run(
        ["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=420,
        check=False,
    )  # fmt: skip


def _cells(stdout: str) -> dict[str, tuple[str, str, str]]:
    """``Class::test[configuration]`` -> (result, detail, re-run line) of each printed cell."""
    found: dict[str, tuple[str, str, str]] = {}
    check = key = ""
    for line in stdout.splitlines():
        if line and not line.startswith(" ") and "  (" in line:
            check = line.split("  (")[0]
        elif line.startswith("  ") and not line.startswith("   "):
            result, configuration, *detail = line.split(None, 2)
            suffix = "" if configuration == "(default)" else f"[{configuration}]"
            key = check + suffix
            found[key] = (result, detail[0] if detail else "", "")
        elif line.strip().startswith("re-run: "):
            result, detail, _ = found[key]
            found[key] = (result, detail, line.strip().removeprefix("re-run: "))
        elif line.startswith("   ") and key:
            result, detail, rerun = found[key]
            found[key] = (result, f"{detail} {line.strip()}", rerun)
    return found


def test_printed_rerun_lines_rerun_one_cell_anywhere_and_failed_reruns_the_failures(
    tmp_path: Path,
) -> None:
    user, elsewhere, cache = tmp_path / "user", tmp_path / "elsewhere", tmp_path / "cache"
    user.mkdir()
    elsewhere.mkdir()
    (user / "broken_fsdp.py").write_text(BROKEN)
    selection = "stay_within_bound and strict and None or overlaps_communication_cpu or generated"
    first = _shell(
        "fsdp-conformance run -n 0 --impl broken_fsdp:Broken --report m.md --json m.json "
        f"--junit j.xml -k '{selection}'",
        user,
        cache,
    )
    assert first.returncode == 1, first.stdout + first.stderr
    cells = _cells(first.stdout)
    failing = {name: cell for name, cell in cells.items() if cell[0] == "FAIL"}
    assert len(cells) == 4 and len(failing) == 3, cells
    assert cells["TestOverlap::test_prefetch_overlaps_communication_cpu"] == ("pass", "", "")
    prefix = f"cd {user} && fsdp-conformance run --impl broken_fsdp:Broken --cell "
    for name, (_, _, rerun) in failing.items():
        assert rerun in (prefix + name, f"{prefix}'{name}'"), (name, rerun)
    # the fuzz cell's line is whole: the first difference and the command writing its repro.py
    fuzz_detail = failing[FUZZ][1]
    assert "a generated case differs from DDP" in fuzz_detail
    assert re.search(r"first difference: .*parameter '.*' after \d+ steps differs", fuzz_detail)
    command = f"`cd {user} && fsdp-conformance fuzz --impl broken_fsdp:Broken --seed 0 "
    assert f"write its repro.py: {command}" in fuzz_detail
    assert any(line.strip().startswith(command) for line in first.stdout.splitlines())

    # the same lines in the Markdown, the JSON and the JUnit properties
    reruns = {cell[2] for cell in failing.values()}
    document = json.loads((user / "m.json").read_text())
    assert {c["rerun"] for c in document["cells"] if c["outcome"] == "fail"} == reruns
    assert [c["rerun"] for c in document["cells"] if c["outcome"] == "pass"] == [""]
    assert all(f"re-run: `{line}`" in (user / "m.md").read_text() for line in reruns)
    junit = ElementTree.parse(user / "j.xml").getroot()
    properties = {p.get("value") for p in junit.iter("property") if p.get("name") == "fsdp_rerun"}
    assert properties == reruns

    # pasted in another directory, each runs exactly its cell and fails the same way; --failed
    # re-runs the three failures (not the passing cell); the three side by side (the pasted
    # lines with caches of their own: they need no recorded run)
    assert "re-run the failing and deviating cells: " in first.stderr
    line = first.stderr.split("re-run the failing and deviating cells: ")[1].splitlines()[0]
    pasted = [f"{BOUND}[strict-FULL_SHARD-bwd=None-fwd=0-limit=1]", FUZZ]
    jobs = [(failing[name][2], tmp_path / f"cache{i}") for i, name in enumerate(pasted)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        done = list(pool.map(lambda job: _shell(job[0], elsewhere, job[1]), [*jobs, (line, cache)]))
    for name, again in zip(pasted, done):
        assert again.returncode == 1, again.stdout + again.stderr
        assert _cells(again.stdout) == {name: failing[name]}, again.stdout
    assert sorted(os.listdir(elsewhere)) == []
    failed = done[-1]
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert _cells(failed.stdout) == failing
    written = sorted(set(os.listdir(user)) - {"__pycache__"})
    assert written == ["broken_fsdp.py", "j.xml", "m.json", "m.md"]  # the state is not here
    assert list((cache / "fsdp-conformance" / "failed").iterdir())


def test_failed_without_a_recorded_run_and_an_unknown_cell_are_one_line(tmp_path: Path) -> None:
    for args, message in (
        (["--failed"], "--failed: no earlier run of --impl impl (coverage pairwise, world size 2)"),
        (["--cell", "TestNoSuch::test_x"], "--cell 'TestNoSuch::test_x': not a cell of the suite"),
    ):
        done = _shell(f"fsdp-conformance run {' '.join(args)}", tmp_path, tmp_path / "cache")
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_pytest_rerun_line_of_a_suite_cell_outside_the_cli(tmp_path: Path) -> None:
    """Run by pytest itself, the property is a ``pytest --pyargs`` line that resolves anywhere."""
    user, elsewhere = tmp_path / "user", tmp_path / "elsewhere"
    user.mkdir()
    elsewhere.mkdir()
    (user / "broken_fsdp.py").write_text(BROKEN)
    cell = f"{BOUND}[strict-FULL_SHARD-bwd=None-fwd=0-limit=1]"
    first = _shell(
        "python -m pytest -p no:cacheprovider -q --junitxml=j.xml --fsdp-impl=broken_fsdp:Broken "
        f"--pyargs 'fsdp_conformance.suite.test_memory_bound::{cell}'",
        user,
        tmp_path / "cache",
    )
    assert first.returncode == 1, first.stdout + first.stderr
    junit = ElementTree.parse(user / "j.xml").getroot()
    (rerun,) = [p.get("value") for p in junit.iter("property") if p.get("name") == "fsdp_rerun"]
    assert rerun == (
        f"cd {user} && python -m pytest --pyargs "
        f"'fsdp_conformance.suite.test_memory_bound::{cell}' --fsdp-impl=broken_fsdp:Broken"
    )
    again = _shell(rerun + " -p no:cacheprovider", elsewhere, tmp_path / "cache")
    assert again.returncode == 1 and "1 failed in" in again.stdout, again.stdout
    assert "memory bound exceeded" in again.stdout
