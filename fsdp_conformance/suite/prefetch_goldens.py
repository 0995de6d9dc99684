"""Prefetch-order goldens: the rendered ``CommTrace`` of each prefetch case, pinning the exact
order of ``impl``, ``torch-fsdp1`` and ``torch-fsdp2`` (other adapters skip).

[Note: goldens that travel]
The torch adapters' goldens carry their torch release: ``goldens/<adapter>/<case>.txt`` was
recorded on ``BASE_TORCH_VERSIONS[adapter]``, ``goldens/<adapter>/torch-<X.Y>/`` on X.Y. On
another torch the trace is compared with the nearest recorded release (the older on a tie): a
match passes, a difference fails with the diff. Accepting records the running release.

Regenerate in one process (one writer per file), per adapter::

    pytest -p no:xdist --pyargs fsdp_conformance.suite.test_prefetch_order -k golden \\
        --fsdp-impl impl --fsdp-accept-goldens

(or ``EXPECTTEST_ACCEPT=1`` / ``FSDP_CONFORMANCE_ACCEPT_GOLDENS=1``); never into an installed
copy."""

from __future__ import annotations

import difflib
import importlib.resources
import os
import pathlib
from typing import Any

import pytest
import torch

from fsdp_conformance import constants

# adapters whose goldens pin torch's own order -> the release of goldens/<adapter>/<case>.txt
BASE_TORCH_VERSIONS = {"torch-fsdp1": "2.13", "torch-fsdp2": "2.13"}
VERSION_DIR_PREFIX = "torch-"
GOLDENS_DIR = "goldens"
ACCEPT_ENV_VARS = (constants.ENV_ACCEPT_GOLDENS, "EXPECTTEST_ACCEPT")
_INSTALLED_PARTS = ("site-packages", "dist-packages")


class GoldenAcceptError(RuntimeError):
    """Accepting goldens would write into an installed package instead of a source checkout."""


def accepting() -> bool:
    """Whether to accept goldens (``FSDP_CONFORMANCE_ACCEPT_GOLDENS=1``, or expecttest's
    ``EXPECTTEST_ACCEPT``); ValueError for a value of the first other than 0 and 1."""
    own = os.environ.get(constants.ENV_ACCEPT_GOLDENS, "")
    if own not in ("", "0", "1"):
        raise ValueError(
            f"{constants.ENV_ACCEPT_GOLDENS}={own!r}: set it to 1 (accept the prefetch-order "
            "goldens) or 0, or unset it"
        )
    return own == "1" or os.environ.get("EXPECTTEST_ACCEPT", "") not in ("", "0")


def _minor(version: str) -> tuple[int, int]:
    """``(major, minor)`` of ``"2.15.0+cu132"`` / ``"2.15"``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _running_minor() -> str:
    return "{}.{}".format(*_minor(torch.__version__))


def _packaged(adapter_name: str) -> Any:
    return importlib.resources.files(__package__) / GOLDENS_DIR / adapter_name


def recorded_versions(adapter_name: str, case: str) -> list[str]:
    """The torch releases (``"X.Y"``) a golden of ``adapter_name`` / ``case`` was recorded on
    (empty for an adapter whose goldens do not depend on torch)."""
    base = BASE_TORCH_VERSIONS.get(adapter_name)
    if base is None:
        return []
    folder = _packaged(adapter_name)
    versions = [base] if (folder / f"{case}.txt").is_file() else []
    if folder.is_dir():
        for entry in folder.iterdir():
            if entry.name.startswith(VERSION_DIR_PREFIX) and (entry / f"{case}.txt").is_file():
                versions.append(entry.name[len(VERSION_DIR_PREFIX) :])
    return sorted(set(versions), key=_minor)


def nearest_version(versions: list[str], running: str) -> str | None:
    """The recorded release closest to ``running`` (by minor release; the older on a tie)."""
    if not versions:
        return None
    target = _minor(running)

    def distance(version: str) -> tuple[int, int]:
        major, minor = _minor(version)
        gap = abs((major - target[0]) * 1000 + (minor - target[1]))
        return gap, 0 if (major, minor) <= target else 1

    return min(versions, key=distance)


def _nearest(adapter_name: str, case: str) -> str | None:
    return nearest_version(recorded_versions(adapter_name, case), _running_minor())


def _version_folder(folder: Any, adapter_name: str, version: str | None) -> Any:
    """``folder``, or its ``torch-<version>/`` for a release other than the adapter's base."""
    base = version is None or version == BASE_TORCH_VERSIONS.get(adapter_name)
    return folder if base else folder / f"{VERSION_DIR_PREFIX}{version}"


def read_golden(adapter_name: str, case: str, version: str | None = None) -> str | None:
    """The golden of ``adapter_name`` / ``case``, or None; ``version``: the torch release it
    was recorded on (default: the nearest to the running one)."""
    if version is None:
        version = _nearest(adapter_name, case)
    golden = _version_folder(_packaged(adapter_name), adapter_name, version) / f"{case}.txt"
    return golden.read_text(encoding="utf-8") if golden.is_file() else None


def has_goldens(adapter_name: str) -> bool:
    return _packaged(adapter_name).is_dir()


def accept_golden(
    adapter_name: str, case: str, rendered: str, package_dir: pathlib.Path | None = None
) -> pathlib.Path:
    """Write ``rendered`` as the golden of ``adapter_name`` / ``case`` in the source checkout
    whose ``fsdp_conformance/suite`` is ``package_dir`` (default: this one), for the running
    torch release; GoldenAcceptError for an installed package."""
    directory = pathlib.Path(package_dir or pathlib.Path(__file__).parent).resolve()
    if any(part in _INSTALLED_PARTS for part in directory.parts):
        raise GoldenAcceptError(
            f"cannot accept prefetch-order goldens: fsdp_conformance is installed in "
            f"{directory} (not a source checkout); install it editable from the checkout "
            "(pip install -e .) and run the accept command there"
        )
    folder = directory / GOLDENS_DIR / adapter_name
    if adapter_name in BASE_TORCH_VERSIONS:
        folder = _version_folder(folder, adapter_name, _running_minor())
    path = folder / f"{case}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(rendered, encoding="utf-8")
    return path


def check_golden(adapter_name: str, case: str, rendered: str) -> str | None:
    """Compare ``rendered`` with the golden (AssertionError with a diff), write it while
    accepting, or skip without goldens. Returns "recorded on torch X, matches on torch Y" for a
    golden of another torch release, else None."""
    if not has_goldens(adapter_name):
        pytest.skip(
            f"adapter {adapter_name!r} has no prefetch-order goldens (they are implementation-"
            "specific); override BasePrefetchOrderTests.check_golden with your own"
        )
    if accepting():
        accept_golden(adapter_name, case, rendered)
        return None
    fix = (
        "if the change is intended, rerun with --fsdp-accept-goldens (or EXPECTTEST_ACCEPT=1) "
        "in one process (-p no:xdist)"
    )
    running = _running_minor()
    recorded = _nearest(adapter_name, case)
    golden = read_golden(adapter_name, case, recorded)
    if golden is None:
        raise AssertionError(
            f"adapter {adapter_name!r}: no prefetch-order golden for case {case!r} "
            f"({GOLDENS_DIR}/{adapter_name}/{case}.txt); {fix}"
        )
    travelled = recorded is not None and recorded != running
    if rendered != golden:
        source = f"golden {adapter_name}/{case}"
        where = ""
        if travelled:
            source += f" (torch {recorded})"
            where = (
                f" recorded on torch {recorded} (no golden for torch {running} yet): a "
                f"difference to review on torch {torch.__version__}; if torch {running}'s "
                f"order is right, accepting records a golden for torch {running}"
            )
        texts = golden.splitlines(keepends=True), rendered.splitlines(keepends=True)
        diff = "".join(difflib.unified_diff(*texts, fromfile=source, tofile="this run"))
        raise AssertionError(
            f"adapter {adapter_name!r}, case {case!r}: the prefetch order differs from the "
            f"golden{where} ({fix}):\n{diff}"
        )
    if travelled:
        return f"recorded on torch {recorded}, matches on torch {torch.__version__}"
    return None
