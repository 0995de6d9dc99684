"""State-dict entries are typed (``StateEntry``), and a wrong-type sharded entry is named."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from fsdp_conformance.impl import FullyShardedDataParallel as FSDP
from fsdp_conformance.impl import StateDictType
from fsdp_conformance.impl.state_dict import ShardTypeError, StateEntry

pytestmark = pytest.mark.fsdp_mode("process")


@pytest.mark.world_size(2)
def test_entries_are_named_fields(dist):
    model = FSDP(nn.Sequential(FSDP(nn.Linear(4, 4)), nn.BatchNorm1d(4)))
    entries = list(model._state_entries())
    assert all(isinstance(entry, StateEntry) for entry in entries)
    by_name = {entry.name: entry for entry in entries}
    assert by_name["0._flat_param"].kind == "flat"
    assert by_name["0._flat_param"].module is model.module[0]
    assert by_name["0._flat_param"].attr is None
    assert (by_name["0.weight"].kind, by_name["0.weight"].attr) == ("param", "weight")
    assert by_name["1.running_mean"].kind == "buffer"
    assert by_name["1.running_mean"].module is model.module[1]
    full = model.state_dict()
    assert set(full) == {e.name for e in entries if e.kind != "flat"}


@pytest.mark.world_size(2)
def test_a_sharded_entry_of_the_wrong_type_names_its_type(dist):
    model = FSDP(nn.Sequential(FSDP(nn.Linear(4, 4)), nn.Linear(4, 4)))
    state = model.state_dict(state_dict_type=StateDictType.SHARDED_STATE_DICT)
    state["0._flat_param"] = state["0._flat_param"].shard  # a plain tensor, not the shard object
    if dist.rank == 0:
        before = model.flat_param.detach().clone()
        with pytest.raises(TypeError) as failure:
            model.load_state_dict(state)
        message = str(failure.value)
        assert re.fullmatch(
            r"state dict entry '0\._flat_param' must be a ShardedFlatParameter from "
            r"state_dict\(state_dict_type=SHARDED_STATE_DICT\), got Tensor",
            message,
        ), message
        assert isinstance(failure.value, ShardTypeError)
        assert isinstance(failure.value, ValueError)  # the type it had before
        assert torch.equal(model.flat_param, before)  # nothing was loaded
