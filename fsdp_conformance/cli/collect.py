"""The old name of ``fsdp_conformance.cli.records`` (the CLI's pytest plugin)."""

from fsdp_conformance.cli.records import (
    ENV_RESULTS,
    NO_LITTER,
    pytest_configure,
    suite_command,
    suite_environment,
)

__all__ = ["ENV_RESULTS", "NO_LITTER", "pytest_configure", "suite_command", "suite_environment"]
