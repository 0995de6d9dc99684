"""Prefetch-order goldens per adapter (``BasePrefetchOrderTests.test_trace_matches_golden``).

Each golden is the rendered ``CommTrace`` (``fsdp_conformance.observe.comm_trace``) of three
FULL_SHARD iterations of one zoo model and one prefetch setting, world size 2, CPU/gloo: one
line per all-gather, free, gradient reduction and compute start, ``op label state``. They pin the
exact order of one implementation: ``impl`` (this repository), ``torch-fsdp1`` and
``torch-fsdp2``. Other adapters have no goldens and skip; their prefetch is held to the
structural check ``test_prefetch_happens`` instead.

[Note: goldens that travel]
The torch adapters' order is torch's, so their goldens carry the torch release they were
recorded on: ``goldens/<adapter>/<case>.txt`` were recorded on ``BASE_TORCH_VERSIONS[adapter]``
(2.13), ``goldens/<adapter>/torch-<X.Y>/<case>.txt`` on torch X.Y. On a torch with its own
golden the trace is compared with it. On any other torch it is compared with the *nearest*
recorded one (closest minor release, the older on a tie): a match passes and says "recorded on
torch 2.13, matches on torch 2.15.0" (``check_golden`` returns that line); a mismatch fails with
the diff -- a difference to review, never a skip. Accepting on such a torch records a golden for
its own release (``torch-<X.Y>/``), leaving the others as they are.

The goldens are data files of this package (read with ``importlib.resources``); an adapter
with a folder there has goldens. Regenerate after an intended change (one process, so that one
writer edits each file; ranks other than 0 do not write)::

    pytest -p no:xdist --pyargs fsdp_conformance.suite.test_prefetch_order -k golden \\
        --fsdp-impl impl --fsdp-accept-goldens    # and again with torch-fsdp1, torch-fsdp2

``EXPECTTEST_ACCEPT=1`` (expecttest's variable) and ``FSDP_CONFORMANCE_ACCEPT_GOLDENS=1`` accept
too. Accepting writes into the source checkout the package was imported from, never into an
installed copy in site-packages (``GoldenAcceptError`` says how to fix that).
"""

from __future__ import annotations

import difflib
import importlib.resources
import os
import pathlib
from typing import Any

import pytest
import torch

from fsdp_conformance import constants

# The torch release (major.minor) the top-level goldens of the torch adapters were recorded on
TORCH_FSDP1_GOLDEN_VERSION = "2.13"
TORCH_FSDP2_GOLDEN_VERSION = "2.13"
# Adapters whose goldens pin torch's own order -> the release of goldens/<adapter>/<case>.txt
BASE_TORCH_VERSIONS = {
    "torch-fsdp1": TORCH_FSDP1_GOLDEN_VERSION,
    "torch-fsdp2": TORCH_FSDP2_GOLDEN_VERSION,
}
# Subfolder of goldens/<adapter>/ holding the goldens recorded on another torch release
VERSION_DIR_PREFIX = "torch-"
# Folder of the golden files, inside this package
GOLDENS_DIR = "goldens"
# Environment variables that make the golden check write the rendered trace instead of comparing
ACCEPT_ENV_VARS = (constants.ENV_ACCEPT_GOLDENS, "EXPECTTEST_ACCEPT")
# Path components of an installed (not editable) package
_INSTALLED_PARTS = ("site-packages", "dist-packages")


class GoldenAcceptError(RuntimeError):
    """Accepting goldens would write into an installed package instead of a source checkout."""


def accepting() -> bool:
    """Whether this process accepts goldens: ``FSDP_CONFORMANCE_ACCEPT_GOLDENS`` is ``1`` (``0``
    or unset: no), or ``EXPECTTEST_ACCEPT`` is set to anything but ``""`` or ``0`` (expecttest's
    own rule).

    Raises:
        ValueError: ``FSDP_CONFORMANCE_ACCEPT_GOLDENS`` is neither ``0`` nor ``1``.
    """
    own = os.environ.get(constants.ENV_ACCEPT_GOLDENS, "")
    if own not in ("", "0", "1"):
        raise ValueError(
            f"{constants.ENV_ACCEPT_GOLDENS}={own!r}: set it to 1 (accept the prefetch-order goldens) "
            "or 0, or unset it"
        )
    return own == "1" or os.environ.get("EXPECTTEST_ACCEPT", "") not in ("", "0")


def _minor(version: str) -> tuple[int, int]:
    """``(major, minor)`` of ``"2.15.0+cu132"`` / ``"2.15"``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _running_minor() -> str:
    return "{}.{}".format(*_minor(torch.__version__))


def recorded_versions(adapter_name: str, case: str) -> list[str]:
    """The torch releases (``"X.Y"``) a golden of ``adapter_name`` / ``case`` was recorded on
    (empty for an adapter whose goldens do not depend on torch, or with no such golden)."""
    base = BASE_TORCH_VERSIONS.get(adapter_name)
    if base is None:
        return []
    folder = importlib.resources.files(__package__) / GOLDENS_DIR / adapter_name
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


def _golden_file(adapter_name: str, case: str, version: str | None) -> Any:
    folder = importlib.resources.files(__package__) / GOLDENS_DIR / adapter_name
    if version is not None and version != BASE_TORCH_VERSIONS.get(adapter_name):
        folder = folder / f"{VERSION_DIR_PREFIX}{version}"
    return folder / f"{case}.txt"


def read_golden(adapter_name: str, case: str, version: str | None = None) -> str | None:
    """The golden text of ``adapter_name`` / ``case``, or None when there is no such file.

    Args:
        adapter_name: the adapter's registry name (``"impl"``, ``"torch-fsdp1"``).
        case: the case id (``prefetch_case_id``, e.g. ``"nested-bwd=None-fwd=0"``).
        version: for the torch adapters, the torch release (``"X.Y"``) it was recorded on
            (default: the nearest recorded to the running torch, [Note: goldens that travel]).
    """
    if version is None and adapter_name in BASE_TORCH_VERSIONS:
        version = nearest_version(recorded_versions(adapter_name, case), _running_minor())
    golden = _golden_file(adapter_name, case, version)
    if not golden.is_file():
        return None
    return golden.read_text(encoding="utf-8")


def has_goldens(adapter_name: str) -> bool:
    """Whether the package holds prefetch-order goldens for ``adapter_name``."""
    return (importlib.resources.files(__package__) / GOLDENS_DIR / adapter_name).is_dir()


def source_goldens_dir(package_dir: pathlib.Path | None = None) -> pathlib.Path:
    """The goldens folder of the source checkout (where accepting writes).

    Args:
        package_dir: the folder of ``fsdp_conformance/suite`` (default: the one this module was
            imported from).

    Raises:
        GoldenAcceptError: the package is an installed copy (under site-packages), so there is
            no source tree to write to.
    """
    directory = pathlib.Path(package_dir or pathlib.Path(__file__).parent).resolve()
    if any(part in _INSTALLED_PARTS for part in directory.parts):
        raise GoldenAcceptError(
            f"cannot accept prefetch-order goldens: fsdp_conformance is installed in "
            f"{directory} (not a source checkout); install it editable from the checkout "
            "(pip install -e .) and run the accept command there"
        )
    return directory / GOLDENS_DIR


def accept_golden(
    adapter_name: str,
    case: str,
    rendered: str,
    package_dir: pathlib.Path | None = None,
    version: str | None = None,
) -> pathlib.Path:
    """Write ``rendered`` as the golden of ``adapter_name`` / ``case`` in the source checkout.

    Args:
        adapter_name: the adapter's registry name.
        case: the case id.
        rendered: the rendered trace.
        package_dir: the folder of ``fsdp_conformance/suite`` (default: this module's).
        version: for the torch adapters, the torch release (``"X.Y"``) the golden is recorded
            on (default: the running one); a release other than the base one goes to
            ``torch-<X.Y>/``.

    Returns:
        The file written.
    """
    folder = source_goldens_dir(package_dir) / adapter_name
    base = BASE_TORCH_VERSIONS.get(adapter_name)
    if base is not None:
        version = version or _running_minor()
        if version != base:
            folder = folder / f"{VERSION_DIR_PREFIX}{version}"
    path = folder / f"{case}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(rendered, encoding="utf-8")
    return path


def compare_golden(adapter_name: str, case: str, rendered: str) -> str | None:
    """AssertionError with a unified diff unless ``rendered`` equals the golden.

    For the torch adapters the golden is the one recorded on the running torch's release, or
    the nearest recorded one ([Note: goldens that travel]).

    Args:
        adapter_name: the adapter's registry name.
        case: the case id.
        rendered: the rendered trace.

    Returns:
        None when compared with a golden of the running release (or one that does not depend
        on torch), else the line "recorded on torch X, matches on torch Y".
    """
    fix = (
        "if the change is intended, rerun with --fsdp-accept-goldens (or EXPECTTEST_ACCEPT=1) "
        "in one process (-p no:xdist)"
    )
    running = _running_minor()
    recorded = None
    if adapter_name in BASE_TORCH_VERSIONS:
        recorded = nearest_version(recorded_versions(adapter_name, case), running)
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
        diff = "".join(
            difflib.unified_diff(
                golden.splitlines(keepends=True),
                rendered.splitlines(keepends=True),
                fromfile=source,
                tofile="this run",
            )
        )
        raise AssertionError(
            f"adapter {adapter_name!r}, case {case!r}: the prefetch order differs from the "
            f"golden{where} ({fix}):\n{diff}"
        )
    if travelled:
        return f"recorded on torch {recorded}, matches on torch {torch.__version__}"
    return None


def check_golden(adapter_name: str, case: str, rendered: str) -> str | None:
    """Compare ``rendered`` with the golden of ``adapter_name`` and ``case`` (or skip).

    Adapters without goldens skip (the structural check ``test_prefetch_happens`` holds them);
    while accepting, the rendered trace is written instead of compared (for the torch adapters:
    as the golden of the running torch release).

    Args:
        adapter_name: the adapter's registry name.
        case: the case id.
        rendered: the rendered trace.

    Returns:
        ``compare_golden``'s note: "recorded on torch X, matches on torch Y" when the golden
        compared with was recorded on another release, else None.
    """
    if not has_goldens(adapter_name):
        pytest.skip(
            f"adapter {adapter_name!r} has no prefetch-order goldens (they are implementation-"
            "specific); override BasePrefetchOrderTests.check_golden with your own"
        )
    if accepting():
        accept_golden(adapter_name, case, rendered)
        return None
    return compare_golden(adapter_name, case, rendered)
