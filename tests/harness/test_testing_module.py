"""The FSDP test helpers live in fsdp_conformance.testing; world/ keeps only rank machinery."""

from __future__ import annotations

import importlib

import pytest
import torch
from fsdp_conformance.models import DeviceInit, delay

import fsdp_conformance
from fsdp_conformance import testing
from fsdp_conformance.harness.testcase import RankTestCase

NAMES = (
    "DummyProcessGroup",
    "FSDPInitMode",
    "FSDPTest",
    "device_sleep",
    "get_cycles_per_ms",
    "get_full_params",
)


@pytest.mark.parametrize("name", NAMES)
def test_the_helpers_live_in_testing_not_in_world(name):
    new = getattr(testing, name)
    if name in fsdp_conformance.__all__:
        assert getattr(fsdp_conformance, name) is new
    world = importlib.import_module("fsdp_conformance.harness")
    assert name not in world.__all__ and not hasattr(world, name)  # world knows no FSDP


def test_fsdp_test_is_the_rank_test_case():
    assert issubclass(testing.FSDPTest, RankTestCase)
    assert testing.FSDPInitMode is DeviceInit
    assert testing.FSDPInitMode.DEVICE_BEFORE is DeviceInit.BEFORE
    assert testing.FSDPInitMode.CUDA_NEVER is DeviceInit.NEVER


def test_device_sleep_is_the_zoo_delay(monkeypatch):
    calls = []
    monkeypatch.setattr(delay, "sleep_ms", lambda ms, device: calls.append((ms, device)))
    testing.device_sleep(5, "cpu")
    assert calls == [(5, "cpu")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cycles_per_ms_is_the_zoo_calibration():
    device = torch.device("cuda", torch.cuda.current_device())
    assert testing.get_cycles_per_ms() == delay.cycles_per_ms(device)
