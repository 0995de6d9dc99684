"""Prefetch-order goldens per adapter (``BasePrefetchOrderTests.test_trace_matches_golden``).

Each golden is the rendered ``CommTrace`` (``fsdp_conformance.observe.comm_trace``) of three
FULL_SHARD iterations of one zoo model and one prefetch setting, world size 2, CPU/gloo: one
line per all-gather, free, gradient reduction and compute start, ``op label state``. They pin the
exact order of one implementation: ``impl`` (this repository), ``torch-fsdp1`` and
``torch-fsdp2`` (both written against torch 2.13.0; other torch versions skip). Other adapters have no goldens and skip; their
prefetch is held to the structural check ``test_prefetch_happens`` instead.

The goldens are data files of this package, ``goldens/<adapter>/<case>.txt`` (read with
``importlib.resources``); an adapter with a folder there has goldens. Regenerate after an
intended change (one process, so that one writer edits each file; ranks other than 0 do not
write)::

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

import pytest
import torch

from fsdp_conformance import vocab

# The torch release the torch-fsdp1 and torch-fsdp2 goldens were recorded with
TORCH_FSDP1_GOLDEN_VERSION = "2.13."
TORCH_FSDP2_GOLDEN_VERSION = "2.13."
# Adapters whose goldens pin torch's own order: the torch release they were recorded with
_TORCH_GOLDEN_VERSIONS = {
    "torch-fsdp1": TORCH_FSDP1_GOLDEN_VERSION,
    "torch-fsdp2": TORCH_FSDP2_GOLDEN_VERSION,
}
# Folder of the golden files, inside this package
GOLDENS_DIR = "goldens"
# Environment variables that make the golden check write the rendered trace instead of comparing
ACCEPT_ENV_VARS = (vocab.ENV_ACCEPT_GOLDENS, "EXPECTTEST_ACCEPT")
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
    own = os.environ.get(vocab.ENV_ACCEPT_GOLDENS, "")
    if own not in ("", "0", "1"):
        raise ValueError(
            f"{vocab.ENV_ACCEPT_GOLDENS}={own!r}: set it to 1 (accept the prefetch-order goldens) "
            "or 0, or unset it"
        )
    return own == "1" or os.environ.get("EXPECTTEST_ACCEPT", "") not in ("", "0")


def read_golden(adapter_name: str, case: str) -> str | None:
    """The golden text of ``adapter_name`` / ``case``, or None when there is no such file.

    Args:
        adapter_name: the adapter's registry name (``"impl"``, ``"torch-fsdp1"``).
        case: the case id (``prefetch_case_id``, e.g. ``"nested-bwd=None-fwd=0"``).
    """
    golden = importlib.resources.files(__package__) / GOLDENS_DIR / adapter_name / f"{case}.txt"
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
    adapter_name: str, case: str, rendered: str, package_dir: pathlib.Path | None = None
) -> pathlib.Path:
    """Write ``rendered`` as the golden of ``adapter_name`` / ``case`` in the source checkout.

    Args:
        adapter_name: the adapter's registry name.
        case: the case id.
        rendered: the rendered trace.
        package_dir: the folder of ``fsdp_conformance/suite`` (default: this module's).

    Returns:
        The file written.
    """
    path = source_goldens_dir(package_dir) / adapter_name / f"{case}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(rendered, encoding="utf-8")
    return path


def compare_golden(adapter_name: str, case: str, rendered: str) -> None:
    """AssertionError with a unified diff unless ``rendered`` equals the stored golden.

    Args:
        adapter_name: the adapter's registry name.
        case: the case id.
        rendered: the rendered trace.
    """
    golden = read_golden(adapter_name, case)
    fix = (
        "if the change is intended, rerun with --fsdp-accept-goldens (or EXPECTTEST_ACCEPT=1) "
        "in one process (-p no:xdist)"
    )
    if golden is None:
        raise AssertionError(
            f"adapter {adapter_name!r}: no prefetch-order golden for case {case!r} "
            f"({GOLDENS_DIR}/{adapter_name}/{case}.txt); {fix}"
        )
    if rendered != golden:
        diff = "".join(
            difflib.unified_diff(
                golden.splitlines(keepends=True),
                rendered.splitlines(keepends=True),
                fromfile=f"golden {adapter_name}/{case}",
                tofile="this run",
            )
        )
        raise AssertionError(
            f"adapter {adapter_name!r}, case {case!r}: the prefetch order differs from the "
            f"golden ({fix}):\n{diff}"
        )


def check_golden(adapter_name: str, case: str, rendered: str) -> None:
    """Compare ``rendered`` with the golden of ``adapter_name`` and ``case`` (or skip).

    Adapters without goldens skip (the structural check ``test_prefetch_happens`` holds them);
    while accepting, the rendered trace is written instead of compared.

    Args:
        adapter_name: the adapter's registry name.
        case: the case id.
        rendered: the rendered trace.
    """
    if not has_goldens(adapter_name):
        pytest.skip(
            f"adapter {adapter_name!r} has no prefetch-order goldens (they are implementation-"
            "specific); override BasePrefetchOrderTests.check_golden with your own"
        )
    recorded_with = _TORCH_GOLDEN_VERSIONS.get(adapter_name)
    if recorded_with is not None and not torch.__version__.startswith(recorded_with):
        pytest.skip(
            f"adapter {adapter_name!r}: the prefetch-order goldens were recorded with torch "
            f"{recorded_with}x, this is torch {torch.__version__}"
        )
    if accepting():
        accept_golden(adapter_name, case, rendered)
        return
    compare_golden(adapter_name, case, rendered)
