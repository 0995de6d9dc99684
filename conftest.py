"""Repository-level pytest configuration: the project's longest tests run first; what collection
imported is frozen for the session's garbage collections."""

from __future__ import annotations

import gc

import pytest

# Tests that take 8 s or more (the longest case's seconds in a full `pytest -n auto` run on 2
# cores, 2026-11-28), by node id without parameters. They run first: pyproject.toml's
# `--dist worksteal` lets an idle worker take half of another's queue, so a run ends within one
# test of balanced, and the tests left for the end are then short ones.
LONG_TESTS = {
    "tests/cli/test_rerun.py::"
    "test_printed_rerun_lines_rerun_one_cell_anywhere_and_failed_reruns_the_failures": 39,
    "tests/fuzz/test_fuzz_mutants.py::test_fuzz_finds_shrinks_and_reproduces": 37,
    "tests/harness/test_faults.py::test_fault_matrix": 30,
    "tests/suite/test_shapes.py::test_simple_fsdp_passes_and_its_broken_variants_fail": 26,
    "tests/suite/test_fsdp1_constructor_catches_broken.py::"
    "test_each_check_fails_on_its_broken_torch_and_passes_on_torch": 24,
    "tests/suite/test_envelopes_catch_worse.py::"
    "test_a_worse_figure_fails_and_the_declared_one_stays_a_deviation": 16,
    "tests/suite/test_fsdp1_methods_catch_broken.py::"
    "test_each_fsdp1_method_check_fails_on_its_broken_variant": 16,
    "tests/suite/test_fsdp2_api_checks.py::"
    "test_each_fsdp2_api_check_passes_on_torch_and_fails_on_its_broken_variant": 11,
    "tests/suite/test_fsdp2_module_checks.py::"
    "test_each_fsdp2_module_check_passes_on_torch_and_fails_on_its_broken_variant": 10,
    "tests/launcher/test_torchrun_harness.py::test_spmd_verdicts_isolation_and_watchdog": 22,
    "tests/launcher/test_torchrun_harness.py::"
    "test_killed_rank_ends_both_agents_within_the_timeout": 22,
    "tests/adapters/test_deepspeed.py::test_deepspeed_subset": 21,
    "tests/harness/test_xdist_and_gpus.py::test_xdist_runs_eight_two_rank_tests_concurrently": 19,
    "tests/launcher/test_torchrun_suite.py::test_suite_subset_matches_the_spawning_mode": 19,
    "tests/cli/test_rerun.py::test_pytest_rerun_line_of_a_suite_cell_outside_the_cli": 19,
    "tests/cli/test_litter.py::test_readme_tutorial_leaves_nothing_in_the_clone_or_tmpdir": 18,
    "tests/adapters/test_deepspeed.py::test_accumulation_over_synchronised_micro_batches": 18,
    "tests/launcher/test_torchrun_suite.py::test_two_torchrun_agents_on_localhost": 17,
    "tests/suite/test_state_dict_init_checks.py::test_each_check_fails_on_its_broken_variant": 16,
    "tests/harness/test_failures.py::"
    "test_process_mode_failures_are_named_and_the_pool_recovers": 14,
    "tests/cli/test_conformance_table.py::test_command_writes_the_table_from_a_real_run": 14,
    "tests/suite/test_adapter_deviations.py::"
    "test_subclass_and_delegate_of_torch_fsdp1_get_its_verdicts": 13,
    "tests/suite/test_downstream_example.py::test_representative_subset_passes": 12,
    "tests/fuzz/test_repro_exit_codes.py::test_still_fails_1_passes_now_0": 12,
    "tests/suite/test_adapters_of_last_week.py::"
    "test_a_hook_override_reaches_the_plain_hook_through_super": 12,
    "tests/suite/test_wrap_optim_forward_checks.py::"
    "test_each_check_fails_on_its_broken_variant": 11,
    "tests/cli/test_litter.py::test_demo_leaves_nothing_in_tmpdir": 11,
    "tests/suite/test_sharding_checks.py::"
    "test_each_sharding_check_fails_on_its_broken_variant": 11,
    "tests/launcher/test_torchrun_suite.py::"
    "test_broken_adapter_fails_and_rank_zero_names_rank_one": 11,
    "tests/suite/test_protocol_outside_adapter.py::test_engine_like_outside_adapter_passes": 11,
    "tests/suite/test_loops_catch_broken.py::test_each_loop_check_fails_on_its_broken_variant": 11,
    "tests/suite/test_suite_catches_broken_adapters.py::"
    "test_each_check_fails_on_its_broken_adapter": 11,
    "tests/harness/test_xdist_and_gpus.py::test_gpu_pool_never_gives_a_gpu_to_two_tests": 10,
    "tests/adapters/test_fairscale.py::test_deviation_reproductions_reproduce": 10,
    "tests/launcher/test_torchrun_cli.py::"
    "test_run_as_a_torchrun_job_prints_the_command_and_the_matrix": 9,
    "tests/harness/test_signals.py::"
    "test_signal_to_the_cli_pid_ends_it_within_the_bound_leaving_nothing": 9,
    "tests/cli/test_litter.py::test_failed_run_keeps_its_log_in_our_cache_and_nothing_in_tmp": 9,
    "tests/suite/test_pristine_rank_per_test.py::"
    "test_prefetch_checks_of_one_case_do_not_share_a_trace": 8,
    "tests/harness/test_isolation.py::test_next_test_sees_a_pristine_rank": 8,
    "tests/suite/test_verdict_path.py::"
    "test_an_unrelated_crash_in_a_deviating_cell_is_a_failure": 8,
    "tests/launcher/test_torchrun_harness.py::test_different_collections_fail_the_session": 8,
    "tests/suite/test_verdict_path.py::test_the_declared_failure_is_a_deviation_with_versions": 8,
    "tests/adapters/test_fairscale_missing.py::"
    "test_every_fairscale_cell_skips_with_the_install_line": 8,
    "tests/suite/test_claimed_not_implemented.py::"
    "test_claimed_feature_without_its_member_fails_declared_one_is_not_applicable": 8,
    "tests/cli/test_cli.py::test_run_on_broken_adapter_fails_and_names_the_failing_checks": 8,
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
