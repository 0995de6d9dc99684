"""The numbers the docs quote match the program or the run that measured them: every measured
figure is written from docs/figures.json between markers (``benchmarks/figures.py``; one command,
``python benchmarks/bench_run.py --update-docs``, measures and rewrites them), and the counts
the program decides are compared with it here. (The commands are checked by
tests/cli/test_docs_match_parser.py, the example output of ``run`` by tests/cli/test_cli.py.)"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest

from fsdp_conformance import constants

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _figures_module():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "benchmarks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.name)
def test_each_quoted_figure_is_the_recorded_one(path: Path) -> None:
    figures = _figures_module()
    text = path.read_text()
    for name, _ in figures.MARKER.findall(text):
        assert name in figures.TEMPLATES, f"{path.name}: unknown figure {name!r}"
    assert figures.render(text, figures.load()) == text, (
        f"{path.name} quotes a figure other than docs/figures.json records: run "
        "`python benchmarks/figures.py` (or measure again: python benchmarks/bench_run.py "
        "--update-docs)"
    )


def test_every_recorded_figure_is_quoted_and_the_main_job_in_readme_and_cli_md() -> None:
    figures = _figures_module()
    quoted = {name for path in DOCS for name, _ in figures.MARKER.findall(path.read_text())}
    assert quoted == set(figures.load()) == set(figures.TEMPLATES)
    for path in (ROOT / "README.md", ROOT / "docs" / "cli.md"):
        assert "<!-- figure run-impl -->" in path.read_text(), path.name


def test_the_example_adapters_claims_are_counted_right() -> None:
    from fsdp_conformance.adapters import ALL_FEATURES

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import my_fsdp_adapter
    finally:
        sys.path.remove(str(ROOT / "examples"))
    claims = re.findall(
        r"claims (\d+) of the\s+(\d+) features", (ROOT / "docs" / "suite.md").read_text()
    )
    assert claims == [(str(len(my_fsdp_adapter.SUPPORTED)), str(len(ALL_FEATURES)))]


def test_parity_config_counts_per_coverage() -> None:
    from fsdp_conformance.suite import configs

    row = re.search(r"^\| `--coverage` \|.*$", (ROOT / "docs" / "cli.md").read_text(), re.MULTILINE)
    pairwise, full = re.findall(r"\((\d+) per model", row.group(0))
    assert int(pairwise) == len(configs.pairwise())
    assert int(full) == math.prod(len(values) for values in configs.DIMENSIONS.values())


ADAPTER_NAMES = {
    "impl": "`impl`", "torch-fsdp1": "torch FSDP1", "torch-fsdp2": "torch FSDP2",
    "fairscale": "fairscale", "deepspeed": "DeepSpeed",
}  # fmt: skip


@pytest.mark.parametrize("path", [ROOT / "README.md", ROOT / "docs" / "cli.md"], ids=str)
def test_lists_of_built_in_adapters_name_every_one(path: Path) -> None:
    assert set(ADAPTER_NAMES) == set(constants.BUILTIN_ADAPTERS)
    lists = re.findall(r"\(built in: ([^)]*)\)", " ".join(path.read_text().split()))
    assert lists, f"{path.name} lost its list of built-in adapters"
    for listed in lists:
        missing = [name for name, shown in ADAPTER_NAMES.items() if shown not in listed]
        assert not missing, f"{path.name}: the built-in adapters {missing} are not in {listed!r}"


def test_the_readme_installs_the_torch_ci_installs_and_says_which_build_once() -> None:
    ci_pin = re.search(r"pip install [^\n]*\b(torch==[\d.]+)", (ROOT / ".ci" / "run").read_text())
    readme = (ROOT / "README.md").read_text()
    assert f"pip install {ci_pin.group(1)} &&" in readme
    assert "https://download.pytorch.org/whl/cpu" in readme  # where the CPU build comes from
    cli_md = (ROOT / "docs" / "cli.md").read_text()
    assert "CUDA" not in cli_md.split("## `fsdp-conformance run`")[0]  # the README says it
