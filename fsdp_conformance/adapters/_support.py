"""Declared, tested support ranges of the built-in adapters (docs/compatibility.md).

Each built-in adapter declares the library versions it was run against end to end
(``fsdp-conformance run --impl <name>``, tools/compat_matrix.py) as a ``SupportRange``;
``features.support_problem(adapter)`` returns one line naming the installed and the supported versions
when the installed library is outside it, and the suite then skips every cell of that adapter
with that line instead of failing them one by one.

The upper end is the newest *tested* minor release: a newer torch is refused too, because the
torch-internal hooks of the adapters (``_fsdp2_internals.py``, ``_fsdp1_internals.py``) were
verified only up to there. ``FSDP_CONFORMANCE_UNTESTED_VERSIONS=1`` lifts the upper end (never
the lower one) to try a newer release; a moved internal then fails with one clear error naming
it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import re

from fsdp_conformance import constants

# (major, minor, patch) of a version string ("2.15.0+cu132" -> (2, 15, 0))
_RELEASE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")


def release(version: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a version string; ValueError if it has none."""
    match = _RELEASE.match(version.strip())
    if match is None:
        raise ValueError(f"cannot read a release number from version {version!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (e.g. "torch", "fairscale"), or None."""
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

    # distribution name ("torch", "fairscale")
    library: str
    # oldest supported release, e.g. "2.8.0"
    minimum: str
    # first release NOT supported (exclusive), e.g. "2.16" -- the minor after the newest tested
    below: str
    # the releases this range was measured on end to end
    tested: tuple[str, ...]

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
        """Why ``installed`` is outside this range (None: inside it).

        Args:
            installed: the installed version (None: not installed -- not this range's problem;
                the adapter says how to install it).
            allow_newer: accept releases above the tested ones (default: the
                ``FSDP_CONFORMANCE_UNTESTED_VERSIONS`` environment variable is ``1``).
        """
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
    """The first of ``ranges`` the install misses, as one line (None: inside all of them)."""
    for supported in ranges:
        problem = supported.problem(installed_version(supported.library))
        if problem is not None:
            return f"{problem}; docs/compatibility.md"
    return None


# The releases the compatibility matrix ran (docs/compatibility.md, tools/compat_matrix.py)
TESTED_TORCH = ("2.8.0", "2.13.0", "2.14.1", "2.15.0")
TORCH_RANGE = SupportRange("torch", "2.8.0", "2.16", TESTED_TORCH)
FAIRSCALE_RANGE = SupportRange("fairscale", "0.4.13", "0.4.14", ("0.4.13",))
# adapter name -> its declared ranges
# torch-fsdp2 from 2.13.0: on torch 2.8.0 the adapter drives fully_shard (its internals are
# detected), but FSDP2 2.8 takes twice DDP's gradient steps on gloo at world size 2 (its fp32
# reduce-scatter uses ReduceOp.AVG, which gloo appears to sum) -- training
# diverges from DDP by a factor of the world size on CPU -- and a one-rank mesh fails ("Could not
# resolve the process group registered under the name 1"); measured, docs/compatibility.md
FSDP2_TORCH_RANGE = SupportRange("torch", "2.13.0", "2.16", ("2.13.0", "2.14.1", "2.15.0"))
# deepspeed: its patches (comm trace, accelerator routing) and deviations were written against
# 0.19.8; the torch releases it ran end to end with (docs/deepspeed.md)
DEEPSPEED_RANGE = SupportRange("deepspeed", "0.19.0", "0.20", ("0.19.8",))
DEEPSPEED_TORCH_RANGE = SupportRange("torch", "2.13.0", "2.15", ("2.13.0", "2.14.1"))
RANGES: dict[str, tuple[SupportRange, ...]] = {
    "impl": (TORCH_RANGE,),
    "torch-fsdp1": (TORCH_RANGE,),
    "torch-fsdp2": (FSDP2_TORCH_RANGE,),
    "fairscale": (TORCH_RANGE, FAIRSCALE_RANGE),
    "deepspeed": (DEEPSPEED_TORCH_RANGE, DEEPSPEED_RANGE),
}
