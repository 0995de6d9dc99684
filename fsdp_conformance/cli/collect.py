"""The old name of ``fsdp_conformance.cli.records`` (the CLI's pytest plugin)."""

from fsdp_conformance.cli.records import *
