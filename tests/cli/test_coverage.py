"""``fsdp-conformance coverage``: collects, never runs; its counts, its JSON, its errors.

One report per adapter is built once per module (the collection is in-process: a few seconds,
plus one collection per feature that changes the parity configs).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import pytest

from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.cli import coverage, main

# A small adapter: the reference FSDP claiming the wrap config's values except an explicit
# backward_prefetch=None (so one feature changes the parity configs: collected again), and none
# of the operations or loops
FAKE_ADAPTER = textwrap.dedent(
    """
    import dataclasses

    from fsdp_conformance.adapters import ALL_FEATURES, Feature
    from fsdp_conformance.adapters.impl import ImplAdapter

    CLAIMED = {
        Feature.FULL_SHARD, Feature.SHARD_GRAD_OP, Feature.NO_SHARD,
        Feature.BACKWARD_PREFETCH_PRE, Feature.BACKWARD_PREFETCH_POST, Feature.FORWARD_PREFETCH,
        Feature.LIMIT_ALL_GATHERS, Feature.LIMIT_ALL_GATHERS_OFF, Feature.CPU_OFFLOAD,
    }


    class SmallAdapter(ImplAdapter):
        name = "small"
        declarations = dataclasses.replace(
            ImplAdapter.declarations,
            unsupported={feature: "not in small" for feature in ALL_FEATURES - CLAIMED},
        )


    ADAPTER = SmallAdapter()
    """
)
IMPL = "small_coverage_adapter:ADAPTER"


class _NoRanks:
    """Fails a test that starts a rank: coverage collects only."""

    started: ClassVar[list[str]] = []

    @classmethod
    def install(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        from fsdp_conformance.harness import controller as runtime

        def refuse(*args: Any, **kwargs: Any) -> Any:
            cls.started.append(repr(args)[:200])
            raise AssertionError("coverage started ranks")

        monkeypatch.setattr(runtime.Runtime, "run", refuse)
        monkeypatch.setattr(runtime, "run_function", refuse)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The fake adapter's coverage report, built in its folder with ranks refused."""
    folder = tmp_path_factory.mktemp("small")
    (folder / "small_coverage_adapter.py").write_text(FAKE_ADAPTER)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.chdir(folder)
        monkeypatch.syspath_prepend(str(folder))
        _NoRanks.install(monkeypatch)
        json_path = folder / "coverage.json"
        assert main(["coverage", "--impl", IMPL, "--json", str(json_path)]) == 0
        return {"folder": folder, "json": json.loads(json_path.read_text())}


def test_no_rank_is_started(small: dict[str, Any]) -> None:
    assert small["json"]["cells"] > 100
    assert _NoRanks.started == []


def test_counts_match_an_independent_collection(small: dict[str, Any]) -> None:
    """Every collected cell is counted once; the parity cells that run are the parity cases
    over the values the adapter supports, without the models that need a missing feature."""
    from fsdp_conformance.models import AlwaysWrapNestedWrappedModule

    from fsdp_conformance.adapters import get_adapter
    from fsdp_conformance.suite import BaseDDPParityTests, configs, zoo

    data = small["json"]
    assert data["run"] + data["skip"] == data["cells"] == len(data["cell_list"])
    assert sum(c["run"] + c["skip"] for c in data["checks"].values()) == data["cells"]
    assert data["run"] == sum(cell["runs"] for cell in data["cell_list"])

    adapter = get_adapter(IMPL)
    dimensions = configs.supported_dimensions(adapter)
    assert dimensions["backward_prefetch"] == ("BACKWARD_PRE", "BACKWARD_POST")
    cases = configs.parity_cases(
        BaseDDPParityTests.models,
        "pairwise",
        BaseDDPParityTests.world_sizes,
        BaseDDPParityTests.large_world_models,
        dimensions,
    )
    # the always-wrap model's root is wrapped with its ROOT_WRAP_CONFIG (auto_wrap_policy)
    root_config = {"always_wrap": AlwaysWrapNestedWrappedModule.ROOT_WRAP_CONFIG}
    runnable = [
        case
        for case in cases
        if adapter_features.supports(adapter, *zoo.MODELS[case.model].features)
        and adapter_features.supports(adapter, *adapter_features.wrap_features(**case.wrap_config))
        and adapter_features.supports(
            adapter, *adapter_features.wrap_features(**root_config.get(case.model, {}))
        )
    ]
    assert 0 < len(runnable) < len(cases)  # the delay models need comm_trace
    skipped = len(cases) - len(runnable)
    assert data["checks"]["parity.ddp"] == {"run": len(runnable), "skip": skipped}
    # the checks whose registered features the adapter lacks never run
    assert data["checks"]["comm.counts"]["run"] == 0
    assert data["checks"]["states.assert_state"] == {"run": 0, "skip": 1}


def test_unlocks_are_sorted_and_add_up(small: dict[str, Any]) -> None:
    data = small["json"]
    unlocks = data["unlocks"]
    counts = [entry["cells"] for entry in unlocks]
    assert counts == sorted(counts, reverse=True) and counts[0] > 0
    for entry in unlocks:
        assert entry["cells"] == sum(entry["checks"].values()), entry
        assert entry["reason"] == "not in small"
    by_feature = {entry["feature"]: entry for entry in unlocks}
    # the parity cells that skip need either comm_trace (the delay models) or auto_wrap_policy
    # (the always-wrap model's root config, asked for after its nested wraps)
    parity_gains = [
        by_feature[f]["checks"]["parity.ddp"] for f in ("comm_trace", "auto_wrap_policy")
    ]
    assert min(parity_gains) > 0 and sum(parity_gains) == data["checks"]["parity.ddp"]["skip"]
    assert by_feature["comm_trace"]["checks"]["comm.counts"] > 0
    # backward_prefetch_none is a new value of a parity dimension: more configs, collected anew
    assert by_feature["backward_prefetch_none"]["checks"]["parity.ddp"] > 0
    # the memory bound needs several missing features together: no single one unlocks it
    assert all("memory_bound" not in entry["checks"] for entry in unlocks)
    assert "memory_bound" in data["checks"] and data["checks"]["memory_bound"]["run"] == 0


def test_json_schema(small: dict[str, Any]) -> None:
    data = small["json"]
    assert data["schema"] == coverage.JSON_SCHEMA_VERSION
    assert data["impl"] == IMPL and data["adapter"] == "small" and data["coverage"] == "pairwise"
    assert data["world_size"] == 2 and data["support_problem"] is None
    for key in ("cells", "run", "skip", "unprobed"):
        assert isinstance(data[key], int), key
    assert all(set(counts) == {"run", "skip"} for counts in data["checks"].values())
    assert all(isinstance(n, int) for n in data["skipped_by"].values())
    for entry in data["unlocks"]:
        assert set(entry) == {"feature", "reason", "cells", "checks"}
    for cell in data["cell_list"]:
        assert set(cell) == {"nodeid", "check", "runs", "missing", "blocked"}
        assert cell["runs"] == (not cell["missing"] and not cell["blocked"]), cell


def test_text_names_the_next_feature(
    small: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(small["folder"])
    monkeypatch.syspath_prepend(str(small["folder"]))
    text = coverage.render_text(small["json"])
    first = small["json"]["unlocks"][0]
    assert f"implement `{first['feature']}` next: +{first['cells']} cells" in text
    assert f"{small['json']['run']} would run, {small['json']['skip']} would skip" in text


@pytest.mark.parametrize(
    "impl, expected",
    [
        ("torch-fsdp3", "unknown --impl 'torch-fsdp3'"),
        ("no_such_module_here:ADAPTER", "cannot import module 'no_such_module_here'"),
    ],
)
def test_bad_impl_is_one_line_exit_2(
    impl: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    _NoRanks.install(monkeypatch)
    assert main(["coverage", "--impl", impl]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("fsdp-conformance coverage: error: ") and expected in err, err
