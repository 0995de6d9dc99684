"""The docs match the code: each command's section of docs/cli.md documents every option of its
parser with the parser's default and exactly the exit codes the command declares
(``cli.usage.EXIT_CODES``, also in its --help); the README's commands parse, run where the
adapter they name is importable, and quote the benchmarks' defaults right."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from fsdp_conformance.cli import build_parser
from fsdp_conformance.cli.usage import EXIT_CODES
from fsdp_conformance.constants import BUILTIN_ADAPTERS

ROOT = Path(__file__).resolve().parents[2]
CLI_DOC = (ROOT / "docs" / "cli.md").read_text()
README = (ROOT / "README.md").read_text()


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _section(command: str) -> str:
    """The ``## `fsdp-conformance <command>` ...`` section of docs/cli.md."""
    match = re.search(
        rf"^## `fsdp-conformance {command}`.*?(?=^## |\Z)", CLI_DOC, re.MULTILINE | re.DOTALL
    )
    assert match, f"docs/cli.md has no section '## `fsdp-conformance {command}`'"
    return match.group(0)


def _documented_options(section: str) -> dict[str, str]:
    """Option -> default cell of the section's option table (backticks stripped)."""
    rows = re.findall(r"^\| `(-[-\w]+)[^`]*` \|([^|]*)\|", section, re.MULTILINE)
    return {option: cell.replace("`", "").strip() for option, cell in rows}


def _shown(default: object) -> str:
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


@pytest.mark.parametrize("command", sorted(EXIT_CODES))
def test_each_command_documents_its_exit_codes_and_option_defaults(command: str) -> None:
    parser = _commands()[command]
    section = _section(command)
    sentence = re.search(r"Exit codes:(.*?)(?:\.\s|\.$)", section, re.DOTALL)
    assert sentence, f"{command}: no 'Exit codes:' sentence in docs/cli.md"
    documented = {int(code) for code in re.findall(r"\*\*(\d+)\*\*", sentence.group(1))}
    assert documented == set(EXIT_CODES[command]), (command, documented)
    assert "exit codes:" in parser.format_help()

    options = _documented_options(section)
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        name = max(action.option_strings, key=len)
        assert name in options, f"{command}: option {name} is not in docs/cli.md's table"
        if isinstance(action, argparse._StoreTrueAction):
            assert options[name] == "", (command, name, options[name])
        elif action.default is None:
            if name == "--impl":  # conformance --impl (repeatable): every built-in
                assert options[name] == ", ".join(BUILTIN_ADAPTERS), (command, name)
        else:
            assert options[name] == _shown(action.default), (command, name, options[name])
    known = {max(a.option_strings, key=len) for a in parser._actions if a.option_strings}
    assert set(options) <= known, (command, set(options) - known)


def _readme_commands() -> list[tuple[str, list[str]]]:
    """(folder it runs in, argv) of every ``fsdp-conformance`` command in README code blocks."""
    found = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", README, re.DOTALL):
        folder = "."  # a `cd` holds for the rest of its block
        for line in block.splitlines():
            if "fsdp-conformance " not in line and not line.startswith("cd "):
                continue
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["cd"]:
                    folder = str(Path(folder) / words[1])
                elif words[:1] == ["fsdp-conformance"]:
                    found.append((folder, words[1:]))
    return found


@pytest.mark.parametrize(
    ("folder", "argv"), _readme_commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_readme_commands_parse_and_name_importable_adapters(folder: str, argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    impl = getattr(args, "impl", None)
    for name in impl if isinstance(impl, list) else [impl]:
        if name and ":" in name:  # pkg.module:ATTR resolves from the folder the command runs in
            module = name.partition(":")[0].replace(".", "/")
            here = ROOT / folder
            assert (here / f"{module}.py").exists() or (here / module).is_dir(), (
                f"README runs `fsdp-conformance {' '.join(argv)}` in {folder!r}, where "
                f"{module!r} is not importable"
            )


def test_readme_quotes_the_benchmarks_round_counts_right() -> None:
    for script, given, rounds in re.findall(
        r"`python (benchmarks/\w+\.py)([^`]*)`[^`]*?(\d+) (?:alternating )?rounds", README
    ):
        source = (ROOT / script).read_text()
        default = re.search(r'"--rounds", type=int, default=(\d+)', source)
        flag = re.search(r"--rounds (\d+)", given)
        expected = flag.group(1) if flag else default and default.group(1)
        assert rounds == expected, f"README: `python {script}{given}` runs {expected} rounds"


def test_the_test_extra_lets_bench_harness_measure_multiprocesstestcase() -> None:
    import importlib.util

    pyproject = (ROOT / "pyproject.toml").read_text()
    test_extra = re.search(r"^test = \[(.*?)^\]", pyproject, re.MULTILINE | re.DOTALL)
    assert test_extra and re.search(r'^\s*"expecttest\b', test_extra.group(1), re.MULTILINE)
    path = ROOT / "benchmarks" / "bench_harness.py"
    spec = importlib.util.spec_from_file_location("bench_harness", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.torch_mptc_available()  # its MultiProcessTestCase row is measured, not dropped
