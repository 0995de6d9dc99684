"""The model zoo (`fsdp_conformance.models`)."""
