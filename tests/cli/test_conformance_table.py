"""`fsdp-conformance conformance`: the check x implementation table (docs/conformance.md)."""

from __future__ import annotations

import importlib.util

import pytest

from fsdp_conformance import checks
from fsdp_conformance.cli import main, table

REASON = "torch FSDP1 wraps a module twice. Reproduction: FSDP(lin); FSDP(lin)"


def _fake_results() -> list[table.ImplResult]:
    cell = checks.Result
    return [
        table.ImplResult(
            "impl",
            cells=[
                cell("misuse.wrap_twice", "pass"),
                cell("memory_bound", "pass"),
                cell("memory_bound", "pass"),
            ],
        ),
        table.ImplResult(
            "torch-fsdp1",
            cells=[
                cell("misuse.wrap_twice", "deviation", REASON),
                cell("memory_bound", "pass"),
                cell("memory_bound", "not applicable", "adapter does not support 'x': why"),
            ],
        ),
        table.ImplResult(
            "fairscale", unavailable="not installed: pip install 'fsdp-conformance[fairscale]'"
        ),
    ]


def test_table_folds_configurations_and_numbers_the_reasons() -> None:
    text = table.render_table(_fake_results(), {"versions": "torch 2.13.0"})
    lines = text.splitlines()
    assert "- versions: torch 2.13.0" in lines
    assert "| check | promise | `impl` | `torch-fsdp1` | `fairscale` |" in lines
    promise = "wrapping a module that an instance already wraps is refused"
    assert (
        f"| `misuse.wrap_twice` | {promise} | pass | deviation [3] | not applicable [2] |" in lines
    ), text
    assert any(
        line.startswith("| `memory_bound` |")
        and line.endswith("| pass 2 | pass 1, not applicable 1 [1] | not applicable [2] |")
        for line in lines
    ), text
    assert "1. adapter does not support 'x': why" in lines
    assert "2. not installed: pip install 'fsdp-conformance[fairscale]'" in lines
    assert f"3. {REASON}" in lines


def test_failures_show_first() -> None:
    result = table.ImplResult(
        "impl", cells=[checks.Result("T::c", "pass"), checks.Result("T::c", "FAIL", "boom | x")]
    )
    text = table.render_table([result], {})
    assert "| `T::c` | (not a registered check) | FAIL 1 [1], pass 1 |" in text
    assert "1. boom \\| x" in text


def test_deviation_reason_comes_from_properties_not_message_text() -> None:
    """The table carries a deviation's reason from the recorded properties: the failure and
    xfail text (whatever its format) is never read."""
    from fsdp_conformance.cli import report

    record = {
        "event": "test",
        "nodeid": "suite/test_bad_inputs.py::TestBadInputs::test_wrapping_a_module_twice",
        "outcome": "xfail",
        "detail": "garbage -- known deviation of adapter 'x' (parity.ddp): NOT THE REASON",
        "check_id": "misuse.wrap_twice",
        "verdict": "deviation",
        "reason": REASON,
    }
    (cell,) = report.cells_from_records([record])
    result = table.ImplResult("torch-fsdp1", cells=[table.table_cell(cell)])
    text = table.render_table([result], {})
    assert "| `misuse.wrap_twice` |" in text and f"1. {REASON}" in text, text
    assert "NOT THE REASON" not in text and "garbage" not in text, text


def test_missing_fairscale_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "fairscale" else real(name, *a),
    )
    assert table.unavailable_reason("fairscale") == (
        "not installed: pip install 'fsdp-conformance[fairscale]'"
    )
    assert table.unavailable_reason("impl") is None


def test_command_writes_the_table_from_a_real_run(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "conformance.md"
    code = main([
        "conformance", "--out", str(out), "--impl", "impl", "--impl", "torch-fsdp1",
        "-k", "test_wrapping_a_module_twice",
    ])  # fmt: skip
    assert code == 0
    text = out.read_text()
    assert any(
        line.startswith("| `misuse.wrap_twice` |") and line.endswith("| pass | deviation [1] |")
        for line in text.splitlines()
    ), text
    assert "torch FSDP1 wraps a module that another instance already wraps" in text, text
    assert "torch 2." in text and "UTC" in text, text


def test_command_validates_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance", "--impl", "nope"]) == 2
    assert "unknown --impl 'nope'" in capsys.readouterr().err
