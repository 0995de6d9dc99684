"""``fsdp-conformance run``: ``-n`` is capped at what the machine holds (one line naming the
cap, exit 2), and an ``--impl`` module that exists but raises on import is a broken adapter
(exit 1 with its traceback), not a usage error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fsdp_conformance.cli import limits as _limits

# What a CLI subprocess that stops before pytest starts may take on a loaded host
DEADLINE_S = 120


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_conformance.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )


def test_workers_beyond_the_machine_are_refused_naming_the_cap(tmp_path: Path) -> None:
    cap, _ = _limits.max_workers(2)
    result = _cli("run", "-n", str(cap + 48), cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"-n {cap + 48}: this machine holds at most {cap} workers" in lines[0]
    assert "CPUs" in lines[0] and f"give -n {cap} or less" in lines[0]


def test_cap_follows_cpus_and_memory(monkeypatch) -> None:
    monkeypatch.setattr(_limits, "cpu_count", lambda: 16)
    monkeypatch.setattr(_limits, "available_memory", lambda: 4 * 2**30)
    cap, reason = _limits.max_workers(2)
    assert cap == 4 * 2**30 // (_limits.WORKER_BYTES + 2 * _limits.RANK_BYTES)
    assert "16 CPUs, 4.0 GiB available" in reason
    monkeypatch.setattr(_limits, "available_memory", lambda: 512 * 2**30)
    assert _limits.max_workers(2)[0] == 16


def test_broken_adapter_module_is_exit_1_with_its_traceback(tmp_path: Path) -> None:
    (tmp_path / "broken_adapter.py").write_text(
        "def _load():\n    raise ImportError('the adapter is broken on purpose')\n\n\n_load()\n"
    )
    result = _cli("run", "--impl", "broken_adapter:ADAPTER", "-n", "0", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "Traceback (most recent call last)" in result.stderr
    assert 'broken_adapter.py", line 2, in _load' in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith("(the adapter is broken)")
    missing = _cli("run", "--impl", "no_such_adapter_module:ADAPTER", "-n", "0", cwd=tmp_path)
    assert missing.returncode == 2
    assert "Traceback" not in missing.stderr
