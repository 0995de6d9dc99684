"""Repository-level pytest configuration: the project's longest tests run first; what collection
imported is frozen for the session's garbage collections."""

from __future__ import annotations

import gc

import pytest

# Tests that take 5 s or more (the longest case's seconds in a full `pytest -n auto` run on 2
# cores, 2026-11-26), by node id without parameters. They run first so that `-n auto`'s load
# scheduling hands them out at the start instead of leaving one to extend the end of the run.
LONG_TESTS = {
    "tests/fuzz/test_fuzz_mutants.py::test_fuzz_finds_shrinks_and_reproduces": 33,
    "tests/harness/test_faults.py::test_fault_matrix": 24,
    "tests/suite/test_adapter_deviations.py::"
    "test_subclass_and_delegate_of_torch_fsdp1_get_its_verdicts": 21,
    "tests/launcher/test_torchrun_harness.py::"
    "test_killed_rank_ends_both_agents_within_the_timeout": 21,
    "tests/adapters/test_deepspeed.py::test_deepspeed_subset": 19,
    "tests/suite/test_wrap_optim_forward_checks.py::"
    "test_each_check_fails_on_its_broken_variant": 18,
    "tests/suite/test_shapes.py::test_simple_fsdp_passes_and_its_broken_variants_fail": 16,
    "tests/suite/test_sharding_checks.py::test_each_sharding_check_fails_on_its_broken_variant": 15,
    "tests/launcher/test_torchrun_suite.py::test_suite_subset_matches_the_spawning_mode": 13,
    "tests/launcher/test_torchrun_harness.py::test_spmd_verdicts_isolation_and_watchdog": 12,
    "tests/harness/test_failures.py::"
    "test_process_mode_failures_are_named_and_the_pool_recovers": 10,
    "tests/fuzz/test_repro_exit_codes.py::test_still_fails_1_passes_now_0": 9,
    "tests/suite/test_state_dict_init_checks.py::test_each_check_fails_on_its_broken_variant": 9,
    "tests/cli/test_cli.py::test_timeline_draws_two_panels_and_unlimited_exceeds_bound": 8,
    "tests/suite/test_loops_catch_broken.py::test_each_loop_check_fails_on_its_broken_variant": 7,
    "tests/adapters/test_deepspeed.py::test_accumulation_over_synchronised_micro_batches": 7,
    "tests/harness/test_signals.py::"
    "test_signal_to_the_cli_pid_ends_it_within_the_bound_leaving_nothing": 7,
    "tests/launcher/test_torchrun_suite.py::test_two_torchrun_agents_on_localhost": 7,
    "tests/cli/test_conformance_table.py::test_command_writes_the_table_from_a_real_run": 6,
    "tests/cli/test_litter.py::test_failed_run_keeps_its_log_in_our_cache_and_nothing_in_tmp": 6,
    "tests/suite/test_precision_catch_broken.py::"
    "test_each_precision_check_fails_on_its_broken_variant": 6,
    "tests/launcher/test_torchrun_cli.py::"
    "test_run_as_a_torchrun_job_prints_the_command_and_the_matrix": 6,
    "tests/suite/test_downstream_example.py::test_representative_subset_passes": 5,
    "tests/cli/test_cli.py::test_run_on_impl_passes_and_writes_matrix_json_junit": 5,
    "tests/launcher/test_torchrun_suite.py::"
    "test_broken_adapter_fails_and_rank_zero_names_rank_one": 5,
}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Known-long tests first, longest first; the rest keep their order (a stable sort)."""
    items.sort(key=lambda item: -LONG_TESTS.get(item.nodeid.split("[", 1)[0], 0))


def pytest_collection_finish(session: pytest.Session) -> None:
    """torch and the collected modules live as long as the session: frozen, the collections
    during the run (and pytest's five at its end) no longer walk their ~300,000 objects."""
    gc.collect()
    gc.freeze()
