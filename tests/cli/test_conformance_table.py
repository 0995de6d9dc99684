"""`fsdp-conformance conformance`: the check x implementation table (docs/conformance.md)."""

from __future__ import annotations

import importlib.util

import pytest

from fsdp_conformance.cli import main, table

REASON = "torch FSDP1 wraps a module twice. Reproduction: FSDP(lin); FSDP(lin)"


def _fake_results() -> list[table.ImplResult]:
    deviation = (
        f"no exception was raised -- known deviation of adapter 'x' (misuse.wrap_twice): {REASON}"
    )
    return [
        table.ImplResult(
            "impl",
            cells=[
                ("TestBadInputs::test_wrapping_a_module_twice", "pass", ""),
                ("TestMemoryBound::test_limited", "pass", ""),
                ("TestMemoryBound::test_limited", "pass", ""),
            ],
        ),
        table.ImplResult(
            "torch-fsdp1",
            cells=[
                ("TestBadInputs::test_wrapping_a_module_twice", "xfail", deviation),
                ("TestMemoryBound::test_limited", "pass", ""),
                ("TestMemoryBound::test_limited", "skip", "adapter does not support 'x': why"),
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
    assert "| check | id | `impl` | `torch-fsdp1` | `fairscale` |" in lines
    assert (
        "| `TestBadInputs::test_wrapping_a_module_twice` | misuse.wrap_twice | pass | deviation [1] | not applicable [2] |"
        in lines
    )
    assert (
        "| `TestMemoryBound::test_limited` |  | pass 2 | pass 1, not applicable 1 [3] | not applicable [2] |"
        in lines
    )
    assert f"1. {REASON}" in lines
    assert "2. not installed: pip install 'fsdp-conformance[fairscale]'" in lines
    assert "3. adapter does not support 'x': why" in lines


def test_failures_show_first() -> None:
    result = table.ImplResult("impl", cells=[("T::c", "pass", ""), ("T::c", "fail", "boom | x")])
    text = table.render_table([result], {})
    assert "| `T::c` |  | FAIL 1 [1], pass 1 |" in text
    assert "1. boom \\| x" in text


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
    assert (
        "| `TestBadInputs::test_wrapping_a_module_twice` | misuse.wrap_twice | pass | deviation [1] |"
        in text
    ), text
    assert "torch FSDP1 wraps a module that another instance already wraps" in text, text
    assert "torch 2." in text and "UTC" in text, text


def test_command_validates_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance", "--impl", "nope"]) == 2
    assert "unknown --impl 'nope'" in capsys.readouterr().err


def test_every_check_id_names_a_test_of_the_suite() -> None:
    from fsdp_conformance import suite
    from fsdp_conformance.adapters import CHECK_IDS

    assert set(table.CHECK_ID_OF_TEST.values()) == set(CHECK_IDS)
    tests = {
        name
        for base in vars(suite).values()
        if isinstance(base, type)
        for name in dir(base)
        if name.startswith("test_")
    }
    assert set(table.CHECK_ID_OF_TEST) <= tests, set(table.CHECK_ID_OF_TEST) - tests
