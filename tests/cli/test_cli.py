"""The ``fsdp-conformance`` CLI, run as a subprocess (as a user runs it).

Each ``run`` here selects a few checks with ``-k`` and runs without xdist (``-n 0``), so the
whole file takes about two minutes on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from xml.etree import ElementTree

import pytest

pytest_plugins = ["pytester"]

# What a subprocess may take at most (the suite's start-up is ~20 s on a loaded 2-core host)
TIMEOUT = 420

# An adapter that ignores limit_all_gathers=True: the memory-bound check must fail on it, the
# collective counts (which do not depend on the limiter) must still pass.
BROKEN_ADAPTER = """
from fsdp_conformance.adapters.impl import ImplAdapter


class NoLimitAdapter(ImplAdapter):
    name = "no-limit"

    def _wrap(self, module, process_group, config):
        return super()._wrap(module, process_group, {**config, "limit_all_gathers": False})
"""


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m fsdp_conformance.cli ARGS`` in ``cwd`` (also its TMPDIR)."""
    return subprocess.run(
        [sys.executable, "-m", "fsdp_conformance.cli", *args],
        check=False,
        cwd=cwd,
        # temp files, a failing run's kept log and --failed's record stay in the test's tmp_path
        env={
            **os.environ,
            "TMPDIR": str(cwd),
            "XDG_CACHE_HOME": str(cwd / ".cache"),
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def matrix_cells(output: str, check: str) -> list[tuple[str, str, str]]:
    """(result, configuration, detail) of each cell line printed under ``check``'s header."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(check + "  ("))
    cells: list[tuple[str, str, str]] = []
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        if line.startswith("   "):  # a long detail wrapped onto the next line
            result, configuration, detail = cells.pop()
            cells.append((result, configuration, f"{detail} {line.strip()}"))
            continue
        result, configuration, *rest = line.split(None, 2)
        cells.append((result, configuration, rest[0] if rest else ""))
    return cells


# -----------------------------------------------------------------------------
# run


def test_run_on_impl_passes_and_writes_matrix_json_junit(tmp_path: Path) -> None:
    result = cli(
        "run", "-n", "0",
        "-k", "test_counts_per_phase and nested or test_prefetch_overlaps_communication_cuda",
        "--report", "matrix.md", "--json", "matrix.json", "--junit", "junit.xml",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    counts = matrix_cells(out, "TestCollectiveCounts::test_counts_per_phase")
    assert counts == [("pass", "nested-FULL_SHARD", ""), ("pass", "nested-SHARD_GRAD_OP", "")]
    (cuda,) = matrix_cells(out, "TestOverlap::test_prefetch_overlaps_communication_cuda")
    assert cuda[:2] == ("skip", "(default)") and "GPU" in cuda[2], cuda  # skip with its reason
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("impl: 2 pass, 0 fail, 1 skip (3 cells, 2 checks)"), summary
    assert "collected 3" in result.stderr  # progress went to stderr

    document = json.loads((tmp_path / "matrix.json").read_text())
    assert document["summary"] == {"pass": 2, "fail": 0, "xfail": 0, "xpass": 0, "skip": 1}
    assert {(c["check"], c["configuration"], c["outcome"]) for c in document["cells"]} == {
        ("TestCollectiveCounts::test_counts_per_phase", "nested-FULL_SHARD", "pass"),
        ("TestCollectiveCounts::test_counts_per_phase", "nested-SHARD_GRAD_OP", "pass"),
        ("TestOverlap::test_prefetch_overlaps_communication_cuda", "(default)", "skip"),
    }
    assert document["impl"] == "impl" and document["pytest_exit_code"] == 0

    suite = ElementTree.parse(tmp_path / "junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("3", "0", "1")

    report = (tmp_path / "matrix.md").read_text()
    assert "| `nested-SHARD_GRAD_OP` | pass |  |" in report
    assert "| `TestCollectiveCounts::test_counts_per_phase` | 2 | 0 | 0 | 0 | 0 |" in report
    assert summary in report


def test_run_on_broken_adapter_fails_and_names_the_failing_checks(tmp_path: Path) -> None:
    (tmp_path / "broken_fsdp.py").write_text(BROKEN_ADAPTER)
    # docs/cli.md shows this run, its command and what it prints (thread mode: a failing cell
    # does not restart the rank processes; the run above uses the default mode)
    command, *shown = _documented_run("broken_fsdp:NoLimitAdapter")
    result = cli(*command, "--json", "matrix.json", cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert _unplaced(out.splitlines()) == _unplaced(shown), "docs/cli.md shows another output"
    bound = matrix_cells(out, "TestMemoryBound::test_limited_all_gathers_stay_within_bound")
    assert [cell[:2] for cell in bound] == [
        ("FAIL", "strict-FULL_SHARD-bwd=None-fwd=0-limit=1"),
        ("FAIL", "strict-FULL_SHARD-bwd=None-fwd=1-limit=1"),
    ], bound
    for _, _, detail in bound:  # the first assertion message of each failure
        assert detail.startswith(
            "CheckFailure: memory bound exceeded: iteration 1 forward: peak 6 resident"
        ), detail
        assert "measured: memory bound exceeded (peak_backward 36, peak_forward 30)" in detail
    assert matrix_cells(out, "TestCollectiveCounts::test_counts_per_phase") == [
        ("pass", "nested-FULL_SHARD", "")
    ]
    summary = out.strip().splitlines()[-1]
    assert re.fullmatch(
        r"no-limit: 1 pass, 2 fail \(3 cells, 2 checks\) in \S+ -- 2 FAILED",
        summary,
    ), summary
    assert "FAIL TestMemoryBound::test_limited_all_gathers_stay_within_bound" in result.stderr
    # each failure message once: in the matrix, not again in the progress lines
    assert "memory bound exceeded" not in result.stderr
    assert out.count("memory bound exceeded: iteration 1 forward") == 2, out
    cells = json.loads((tmp_path / "matrix.json").read_text())["cells"]
    failed = [cell for cell in cells if cell["outcome"] == "fail"]
    assert [cell["configuration"] for cell in failed] == [
        "strict-FULL_SHARD-bwd=None-fwd=0-limit=1",
        "strict-FULL_SHARD-bwd=None-fwd=1-limit=1",
    ]
    assert "exceeds the bound 2" in failed[0]["detail"]
    assert "exceeds the bound 3 incl. +1 for the early prefetch" in failed[1]["detail"]
    # the measured figure as data (checks.PROPERTY_MEASURED), not parsed from the message
    figure = failed[0]["measured"]
    assert figure["failure"] == "memory bound exceeded" and figure["peak_forward"] >= 6, figure
    assert all(cell["measured"] is None for cell in cells if cell["outcome"] == "pass"), cells


def _documented_run(impl: str) -> list:
    """(argv, *output lines) of the ``$ fsdp-conformance run ... --impl <impl>`` block of
    docs/cli.md."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    (block,) = re.findall(
        rf"```\n\$ (fsdp-conformance run [^\n]*--impl {impl}.*?)```", doc, re.DOTALL
    )
    command, *output = block.rstrip("\n").splitlines()
    return [shlex.split(command)[1:], *output]


def _unplaced(lines: list[str]) -> list[str]:
    """``lines`` without what differs from run to run: the wall time and the directory."""
    lines = [re.sub(r" in [\d.ms]+ -- ", " in ... -- ", line) for line in lines]
    lines = [re.sub(r"PYTHONPATH=\S+", "PYTHONPATH=...", line) for line in lines]
    return [re.sub(r"re-run: cd \S+ &&", "re-run: cd ... &&", line) for line in lines]


# -----------------------------------------------------------------------------
# overlap and timeline


def test_overlap_prints_the_table_and_ratio(tmp_path: Path) -> None:
    result = cli("overlap", "--repeats", "2", "--json", "overlap.json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for row in ("nothing (no delays)", "communication only", "compute only", "both"):
        assert f"  {row}" in result.stdout, result.stdout
    assert "overlap ratio (both - nothing) / (communication + compute serialised)" in result.stdout
    document = json.loads((tmp_path / "overlap.json").read_text())
    times = document["times"]
    assert document["config"]["limit_all_gathers"] == "False"
    assert times["all_gathers"] == 4 and times["synchronous"] == 0  # impl gathers asynchronously
    # lower bounds only (sleeps never end early): 4 layers x 30 ms compute, >= one 30 ms delay
    assert times["compute"] >= 4 * document["compute_ms"], times
    assert times["all_gather"] >= document["comm_ms"] and times["both"] >= times["compute"], times


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    return struct.unpack(">II", header[16:24])


def test_timeline_draws_two_panels_and_unlimited_exceeds_bound(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = cli(
        "timeline", "--out", "timeline.png", "--data", "timeline.json", "--trace", "trace.json",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    width, height = _png_size(tmp_path / "timeline.png")
    assert width > 800 and height > 500 and (tmp_path / "timeline.png").stat().st_size > 20_000

    document = json.loads((tmp_path / "timeline.json").read_text())
    assert document["axes_drawn"] == 2 and document["layers"] >= 6
    limited, unlimited = document["panels"]
    assert (limited["limit_all_gathers"], unlimited["limit_all_gathers"]) == (True, False)
    for panel in (limited, unlimited):
        phases = {sample["phase"] for sample in panel["samples"]}
        assert {"forward", "backward"} <= phases

    # residency right after each all-gather, per phase (the suite's peaks are taken there)
    def gathers(panel: dict, phase: str) -> list[int]:
        return [
            s["resident"]
            for s in panel["samples"]
            if s["op"] == "all_gather" and s["phase"] == phase and s["instance"] != "root"
        ]

    bound = unlimited["bound"]
    # limit off: the curve rises above the bound line, in forward already
    assert max(gathers(unlimited, "forward")) > bound["forward"], bound
    # limit on (the reference FSDP): within the bound after every all-gather of either phase
    for phase in ("forward", "backward"):
        assert max(gathers(limited, phase)) <= bound[phase], (phase, gathers(limited, phase))
    assert "True                       1  forward      2      2" in result.stdout

    # docs/timeline.png is this picture: the same words drawn (kept in the PNG), the same size
    from PIL import Image

    shipped = Image.open(Path(__file__).resolve().parents[2] / "docs" / "timeline.png")
    drawn = Image.open(tmp_path / "timeline.png")
    assert (
        drawn.size == shipped.size and "limit_all_gathers=False: peak" in drawn.text["Description"]
    )
    assert drawn.text["Description"] == shipped.text.get("Description"), (
        "docs/timeline.png is not what `fsdp-conformance timeline` draws now: redraw it with "
        "`fsdp-conformance timeline --out docs/timeline.png`"
    )

    trace = json.loads((tmp_path / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert any(e.get("name") == "FullyShardedDataParallel.rate_limiter" for e in events)


# -----------------------------------------------------------------------------
# bad arguments: one line on stderr, exit code 2, never a traceback


def _bad_argument_cases() -> list:
    return [
        pytest.param(["run", "--impl", "nope"], "unknown --impl 'nope'", id="unknown-impl"),
        pytest.param(
            ["run", "--impl", "no_such_pkg.fsdp:ADAPTER"],
            "cannot import module 'no_such_pkg",
            id="import-path-module",
        ),
        pytest.param(
            ["run", "--impl", "json:NO_ADAPTER"],
            "has no attribute 'NO_ADAPTER'",
            id="import-path-attribute",
        ),
        pytest.param(["run", "--impl", "json:dumps"], "factory", id="import-path-not-adapter"),
        pytest.param(["run", "--world-size", "0"], "--world-size 0: must be >= 1", id="ws-0"),
        pytest.param(
            ["run", "--world-size", "100000"], "this machine can run at most", id="ws-too-big"
        ),
        pytest.param(
            ["run", "--report", "missing/dir/m.md"],
            "--report missing/dir/m.md: cannot write there",
            id="report-unwritable",
        ),
        pytest.param(["run", "--json", "."], "--json .: is a directory", id="json-directory"),
        pytest.param(["run", "--junit", "no/such/j.xml"], "--junit", id="junit-unwritable"),
        pytest.param(["run", "-k", "a and b=c"], "not a pytest -k expression", id="bad-k"),
        pytest.param(["run", "--mode", "fork"], "invalid choice: 'fork'", id="bad-mode"),
        pytest.param(["run", "-n", "-1"], "-n -1", id="negative-workers"),
        pytest.param(["run", "--world-size", "two"], "invalid int value", id="ws-not-int"),
        pytest.param(
            ["overlap", "--limit-all-gathers", "maybe"], "expected true or false", id="overlap-bool"
        ),
        pytest.param(["overlap", "--impl", "nope"], "unknown --impl", id="overlap-impl"),
        pytest.param(["overlap", "--json", "missing/o.json"], "cannot write", id="overlap-out"),
        pytest.param(
            ["overlap", "--world-size", "1"],
            "a one-rank group all-gathers nothing",
            id="overlap-ws1",
        ),
        pytest.param(
            ["overlap", "--device", "cuda", "--world-size", "1"],
            "--world-size 1: a one-rank group all-gathers nothing",
            id="overlap-cuda-ws1",
        ),
        pytest.param(
            ["timeline", "--out", "missing/t.png"],
            "--out missing/t.png: cannot write",
            id="timeline-out",
        ),
        pytest.param(["timeline", "--world-size", "1"], "must be >= 2", id="timeline-ws"),
        pytest.param(["timeline", "--lag", "slow"], "invalid choice: 'slow'", id="timeline-lag"),
        pytest.param(["timeline", "--layers", "2"], "--layers 2", id="timeline-layers"),
        pytest.param(["frobnicate"], "invalid choice: 'frobnicate'", id="unknown-command"),
        pytest.param([], "required: COMMAND", id="no-command"),
    ]


@pytest.mark.parametrize(("args", "message"), _bad_argument_cases())
def test_bad_argument_gives_one_line_and_exit_2(args: list[str], message: str, tmp_path: Path):
    result = cli(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert message in result.stderr, result.stderr
    assert result.stderr.startswith("fsdp-conformance"), result.stderr


def test_run_selecting_nothing_is_a_bad_argument(tmp_path: Path) -> None:
    result = cli("run", "-n", "0", "-k", "no_such_check_anywhere", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    *progress, error = result.stderr.strip().splitlines()  # pytest ran: progress came first
    assert error == "fsdp-conformance run: error: -k 'no_such_check_anywhere': no check matches"
    assert all(line.startswith(("fsdp-conformance run: suite on", " 0:")) for line in progress)


def test_overlap_on_cuda_without_gpus_is_a_bad_argument(tmp_path: Path) -> None:
    from fsdp_conformance.harness import gpus

    if gpus.gpu_count() >= 1:
        pytest.skip("this host has a GPU for --device cuda")
    result = cli("overlap", "--device", "cuda", cwd=tmp_path)
    assert result.returncode == 2 and "--device cuda: needs a GPU, none" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_timeline_without_matplotlib_is_one_line(tmp_path: Path) -> None:
    fake = tmp_path / "no_matplotlib" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    result = cli("timeline", cwd=tmp_path, env={"PYTHONPATH": str(fake.parent)})
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "needs matplotlib" in result.stderr and "pip install matplotlib" in result.stderr


# -----------------------------------------------------------------------------
# help


@pytest.mark.parametrize("command", [[], ["run"], ["overlap"], ["timeline"], ["fuzz"]])
def test_help_has_an_example(command: list[str], tmp_path: Path) -> None:
    result = cli(*command, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "examples:" in result.stdout
    assert f"fsdp-conformance {command[0] if command else 'run'}" in result.stdout


def test_console_script_is_installed() -> None:
    # the script installed with this interpreter's package (a ``fsdp-conformance`` elsewhere on
    # PATH -- another Python's, a pyenv shim -- may belong to an environment without it)
    script = shutil.which("fsdp-conformance", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the package is not installed (pip install -e .): no console script")
    result = subprocess.run(
        [script, "--help"], check=False, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "run" in result.stdout


def test_matrix_of_a_collection_error(tmp_path: Path) -> None:
    # a plain unit test of the report module: collection errors become failing cells
    from fsdp_conformance.cli import report as _cli_report

    cells = _cli_report.cells_from_records(
        [
            {"event": "test", "nodeid": "t.py::TestA::test_x[cfg-1]", "outcome": "pass",
             "detail": "", "duration": 0.5},
            {"event": "collect_error", "nodeid": "t.py", "detail": "ImportError: boom"},
        ]
    )  # fmt: skip
    assert [(c.check, c.configuration, c.outcome) for c in cells] == [
        ("TestA::test_x", "cfg-1", "pass"),
        ("collecting t.py", "(default)", "fail"),
    ]
    text = _cli_report.render_text(cells)
    assert "FAIL   (default)  ImportError: boom" in textwrap.dedent(text)


def test_a_deviating_cell_carries_its_measured_figure() -> None:
    """The figure a check measured (checks.PROPERTY_MEASURED) travels from the record to the
    matrix's text and Markdown (in words) and to the JSON (as an object)."""
    from fsdp_conformance.cli import report as _cli_report

    figure = '{"failure": "memory bound exceeded", "peak_backward": 3, "peak_forward": 3}'
    (cell,) = _cli_report.cells_from_records(
        [
            {"event": "test", "nodeid": "t.py::TestB::test_y[lag]", "outcome": "xfail",
             "detail": "CheckFailure: memory bound exceeded -- known deviation", "duration": 1.0,
             "check_id": "memory_bound", "verdict": "deviation", "measured": json.loads(figure)},
        ]
    )  # fmt: skip
    words = "memory bound exceeded (peak_backward 3, peak_forward 3)"
    assert f"measured: {words}" in _cli_report.render_text([cell])
    assert f"<br>measured: {words}" in _cli_report.render_markdown([cell], {}, "")
    (data,) = json.loads(_cli_report.render_json([cell], {}))["cells"]
    assert data["measured"] == json.loads(figure)


def test_failure_message_is_the_first_assertion_line() -> None:
    # the failure a cell records (and the matrix shows): type and first line of the message; a
    # headline ending in ":" goes on with its next line
    from fsdp_conformance.suite.verdict import failure_line

    class IllegalTrainingState(AssertionError):
        pass

    error = IllegalTrainingState(
        "2 illegal states seen:\n  instance 3 in FORWARD at post_backward\nranks that passed: 0\n"
    )
    assert failure_line(error) == (
        "IllegalTrainingState: 2 illegal states seen: instance 3 in FORWARD at post_backward"
    )
    plain = AssertionError("loss differs at step 3\nexpected 1.0, got 2.0")
    assert failure_line(plain) == "AssertionError: loss differs at step 3"
    assert failure_line(AssertionError()) == "AssertionError"


def test_a_pytest_usage_error_is_a_record(tmp_path: Path) -> None:
    # what `run` says when pytest refuses its arguments comes from this record, not pytest's text
    from fsdp_conformance.cli import records

    results = tmp_path / "results.jsonl"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "fsdp_conformance.cli.records",
         "-p", "no:cacheprovider", "--fsdp-world-size=0", "--collect-only", "-q"],
        cwd=tmp_path, env=records.suite_environment(str(results)), capture_output=True,
        timeout=TIMEOUT, check=False,
    )  # fmt: skip
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert lines == [
        {
            "event": "usage_error",
            "detail": "--fsdp-world-size='0': the world size must be a whole number >= 1",
        }
    ]


def test_a_cell_on_a_gpu_names_where_its_ranks_ran(tmp_path: Path) -> None:
    # the fsdp_device report property: a GPU cell's matrix detail names it, a CPU cell's not
    from fsdp_conformance.cli import records

    (tmp_path / "test_where.py").write_text(
        "def test_gpu(record_property):\n"
        "    record_property('fsdp_device', 'cuda:0 shared by 2 ranks (gloo)')\n"
        "def test_cpu(record_property):\n"
        "    record_property('fsdp_device', 'cpu (gloo)')\n"
    )
    results = tmp_path / "results.jsonl"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "fsdp_conformance.cli.records",
         "-p", "no:cacheprovider", "-q", "test_where.py"],
        cwd=tmp_path, env=records.suite_environment(str(results)), capture_output=True,
        timeout=TIMEOUT, check=False,
    )  # fmt: skip
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    details = {line["nodeid"]: line["detail"] for line in lines if line["event"] == "test"}
    assert details == {
        "test_where.py::test_gpu": "[ranks on cuda:0 shared by 2 ranks (gloo)]",
        "test_where.py::test_cpu": "",
    }


def test_cells_of_other_world_sizes_run_first_grouped(pytester: pytest.Pytester) -> None:
    # xdist hands a worker consecutive cells: a size's cells together start one rank set
    pytester.makepyfile(
        test_sizes="""
        import pytest

        def test_a(): pass

        @pytest.mark.world_size(1)
        def test_one_a(): pass

        @pytest.mark.world_size(3)
        def test_three(): pass

        def test_b(): pass

        @pytest.mark.world_size(1)
        def test_one_b(): pass

        @pytest.mark.world_size(2)
        def test_two(): pass
        """
    )
    # a subprocess: the plugin freezes the garbage collector's view of the session
    result = pytester.runpytest_subprocess(
        "-p", "fsdp_conformance.cli.records", "--collect-only", "-q", "--fsdp-world-size=2"
    )
    order = [line.split("::")[1] for line in result.outlines if "::" in line]
    assert order == ["test_three", "test_one_a", "test_one_b", "test_a", "test_b", "test_two"]
