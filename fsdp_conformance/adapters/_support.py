"""Declared, tested support ranges of the built-in adapters (docs/compatibility.md).

A ``SupportRange`` is the library versions an adapter ran end to end with; outside it every
cell skips with one line (``features.support_problem``). The upper end is the newest tested
minor (the torch-internal hooks were verified up to there);
``FSDP_CONFORMANCE_UNTESTED_VERSIONS=1`` lifts it, never the lower one.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re

from fsdp_conformance import constants

_RELEASE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")


def release(version: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a version string ("2.15.0+cu132" -> (2, 15, 0))."""
    match = _RELEASE.match(version.strip())
    if match is None:
        raise ValueError(f"cannot read a release number from version {version!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def installed_version(distribution: str) -> str | None:
    if distribution == "torch":
        import torch

        return str(torch.__version__)
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclasses.dataclass(frozen=True)
class SupportRange:
    """The versions of one library an adapter was tested with: ``minimum <= v < below``."""

    library: str  # distribution name
    minimum: str  # e.g. "2.8.0"
    below: str  # the minor after the newest tested, e.g. "2.16"
    tested: tuple[str, ...]  # the releases measured end to end

    def __post_init__(self) -> None:
        if release(self.minimum) >= release(self.below):
            raise ValueError(
                f"SupportRange({self.library}): minimum {self.minimum} >= {self.below}"
            )

    @property
    def spec(self) -> str:
        """``"torch>=2.8.0,<2.16"``."""
        return f"{self.library}>={self.minimum},<{self.below}"

    def problem(self, installed: str | None, allow_newer: bool | None = None) -> str | None:
        """Why ``installed`` (None: not installed, no problem here) is outside this range;
        `allow_newer` defaults to ``FSDP_CONFORMANCE_UNTESTED_VERSIONS=1``."""
        if installed is None:
            return None
        if allow_newer is None:
            allow_newer = os.environ.get(constants.ENV_UNTESTED_VERSIONS, "") == "1"
        version = release(installed)
        tested = ", ".join(self.tested)
        if version < release(self.minimum):
            return (
                f"{self.library} {installed} is older than this adapter supports ({self.spec}, "
                f"tested on {tested})"
            )
        if version >= release(self.below) and not allow_newer:
            return (
                f"{self.library} {installed} is newer than this adapter was tested with "
                f"({self.spec}, tested on {tested}); set {constants.ENV_UNTESTED_VERSIONS}=1 to "
                "run it anyway"
            )
        return None


def support_problem_of(ranges: tuple[SupportRange, ...]) -> str | None:
    """The first of ``ranges`` the install misses, as one line, or None."""
    for supported in ranges:
        problem = supported.problem(installed_version(supported.library))
        if problem is not None:
            return f"{problem}; docs/compatibility.md"
    return None


# the releases the compatibility matrix ran (docs/compatibility.md)
TESTED_TORCH = ("2.8.0", "2.13.0", "2.14.1", "2.15.0")
TORCH_RANGE = SupportRange("torch", "2.8.0", "2.16", TESTED_TORCH)
FAIRSCALE_RANGE = SupportRange("fairscale", "0.4.13", "0.4.14", ("0.4.13",))
# torch-fsdp2 from 2.13.0: FSDP2 2.8 reduces with ReduceOp.AVG, which gloo sums (twice DDP's
# steps at world size 2), and a one-rank mesh fails there (measured, docs/compatibility.md)
FSDP2_TORCH_RANGE = SupportRange("torch", "2.13.0", "2.16", ("2.13.0", "2.14.1", "2.15.0"))
# deepspeed: its patches and deviations were written against 0.19.8 (docs/deepspeed.md)
DEEPSPEED_RANGE = SupportRange("deepspeed", "0.19.0", "0.20", ("0.19.8",))
DEEPSPEED_TORCH_RANGE = SupportRange("torch", "2.13.0", "2.15", ("2.13.0", "2.14.1"))
