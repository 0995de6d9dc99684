"""The adapter registry is re-entrant: an adapter module that resolves a built-in adapter
while it is itself being resolved (at import time or in its factory) does not deadlock;
resolving an adapter through itself is a clear error; a module that exists but raises on
import is told apart from a missing one. Each case runs in a fresh interpreter with a
deadline, so a deadlock fails the test instead of hanging it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Seconds a fresh interpreter gets to import torch and resolve an adapter (loaded host)
DEADLINE_S = 120

WRAPPING_MODULE = """
from fsdp_conformance.adapters import get_adapter
from fsdp_conformance.adapters.torch_fsdp1 import TorchFSDP1Adapter

_base = get_adapter("torch-fsdp1")  # at import time, while "wrapping:ADAPTER" resolves


class Wrapping(TorchFSDP1Adapter):
    pass


ADAPTER = Wrapping()


def factory():
    assert get_adapter("torch-fsdp1") is _base  # in the factory
    return Wrapping()


def cycle():
    return get_adapter("wrapping:cycle")
"""


def _resolve(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "wrapping.py").write_text(WRAPPING_MODULE)
    (tmp_path / "broken.py").write_text("raise ImportError('broken on purpose')\n")
    (tmp_path / "needs_missing.py").write_text("import no_such_dependency_xyz\n")
    code = "from fsdp_conformance.adapters import get_adapter\n" + textwrap.dedent(body)
    try:
        return subprocess.run(
            [sys.executable, "-c", code],
            check=False,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"resolving did not return within {DEADLINE_S} s (deadlock):\n{body}")


def test_adapter_module_resolving_a_builtin_does_not_deadlock(tmp_path: Path) -> None:
    result = _resolve(
        tmp_path,
        """
        import threading

        a = get_adapter("wrapping:ADAPTER")
        b = get_adapter("wrapping:factory")
        assert type(a).__name__ == type(b).__name__ == "Wrapping"
        assert get_adapter("wrapping:ADAPTER") is a
        # threads resolving concurrently all get the one cached object
        found = []
        threads = [
            threading.Thread(target=lambda: found.append(get_adapter("wrapping:factory")))
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(found) == 4 and all(x is b for x in found)
        print("ok")
        """,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_adapter_resolving_itself_is_a_clear_error(tmp_path: Path) -> None:
    result = _resolve(
        tmp_path,
        """
        try:
            get_adapter("wrapping:cycle")
        except ValueError as error:
            print(error)
        """,
    )
    assert "asks for itself while being resolved" in result.stdout, result.stderr
    assert "wrapping:cycle -> wrapping:cycle" in result.stdout


def test_broken_module_is_told_apart_from_a_missing_one(tmp_path: Path) -> None:
    result = _resolve(
        tmp_path,
        """
        from fsdp_conformance.adapters.registry import AdapterImportError

        for name in ("broken:ADAPTER", "needs_missing:ADAPTER", "no_such_module_xyz:ADAPTER"):
            try:
                get_adapter(name)
            except AdapterImportError as error:
                print("broken", name, error.__cause__)
            except ValueError:
                print("missing", name)
        """,
    )
    assert result.stdout.splitlines() == [
        "broken broken:ADAPTER broken on purpose",
        "broken needs_missing:ADAPTER No module named 'no_such_dependency_xyz'",
        "missing no_such_module_xyz:ADAPTER",
    ], result.stderr
