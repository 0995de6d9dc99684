"""The adapter example in docs/adapters.md works as written (through `module:ATTR`)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from fsdp_conformance.models import NestedWrappedModule
from torch import nn

from fsdp_conformance.adapters import Feature, InstanceState, get_adapter
from fsdp_conformance.adapters import features as adapter_features

DOC = Path(__file__).resolve().parents[2] / "docs" / "adapters.md"


def _example_source() -> str:
    match = re.search(r"<!-- example: my_fsdp_adapter\.py -->\n```python\n(.*?)```", DOC.read_text(),
                      re.DOTALL)
    assert match, f"{DOC} lost its example block"
    return match.group(1)


@pytest.mark.world_size(2)
def test_docs_example_adapter_runs_through_module_attr(dist):
    folder = dist.tmp_path / f"example_rank{dist.rank}"
    folder.mkdir()
    (folder / "my_fsdp_adapter.py").write_text(_example_source())
    sys.path.insert(0, str(folder))
    try:
        adapter = get_adapter("my_fsdp_adapter:ADAPTER")
        assert adapter.name == "my-fsdp"
        with pytest.raises(pytest.skip.Exception, match="'my-fsdp' does not support 'cpu_offload'"):
            adapter_features.skip_unless(adapter, Feature.CPU_OFFLOAD)

        reference = NestedWrappedModule(dist.group)
        ddp = nn.parallel.DistributedDataParallel(reference)
        model = NestedWrappedModule(dist.group, adapter.wrapper(sharding_strategy="SHARD_GRAD_OP"))
        root = adapter.wrap(model, sharding_strategy="SHARD_GRAD_OP")
        for wrapped, zoo_model in ((ddp, reference), (root, model)):
            inputs = zoo_model.get_input(dist.device)
            zoo_model.run_backward(zoo_model.get_loss(inputs, wrapped(*inputs)))
            torch.optim.SGD(wrapped.parameters(), lr=0.1).step()
        assert [adapter.training_state(i) for i in adapter.instances(root)] == [
            InstanceState.IDLE
        ] * 4
        full = adapter.full_params(root)
        for name, param in reference.named_parameters():
            assert torch.equal(full[name], param.detach()), name
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("my_fsdp_adapter", None)
