"""The suite package's surface: base classes re-exported, never collected, no private torch."""

from __future__ import annotations

import subprocess
import sys

from fsdp_conformance import suite


def test_base_classes_are_exported_and_not_collected() -> None:
    assert set(suite.__all__) >= {
        "BaseDDPParityTests",
        "BaseStateDictTests",
        "BaseSummonFullParamsTests",
        "BaseTrainingStateTests",
    }
    for name in suite.__all__:
        assert not name.startswith("Test"), f"{name} would be collected wherever it is imported"


def test_suite_imports_nothing_from_torch_testing_internal_beyond_torch() -> None:
    script = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import fsdp_conformance.suite.test_parity, fsdp_conformance.suite.test_training_states\n"
        "import fsdp_conformance.observe.states\n"
        "print(sorted(m for m in set(sys.modules) - before "
        "if m.startswith('torch.testing._internal')))\n"
    )
    output = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert output.strip() == "[]", output
