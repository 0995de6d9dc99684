"""What wrapping promises about parameters outside the usual one-owner case (collected by
``--pyargs``): ``wrap.shared_across_instances``.

``BaseSharedParamsTests``: ``tied_instances`` (models/tied.py) ties an embedding's weight to an
output head's and wraps the two apart, so one parameter is used by two FSDP instances. The
implementation either refuses the wrap, or the first forward (the root's lazy init: where FSDP2
checks), with an error naming the shared parameter (``weight`` with one of its modules,
``embed`` / ``head`` / ``Embedding`` / ``Linear``), or
trains it as DDP does, bit for bit (SGD with momentum: the same arithmetic as DDP where the two
uses' gradients are summed before the reduction; ``training.assert_same_training``). A wrap
that succeeds and then trains the two uses as two parameters (untied) diverges from DDP and
fails.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import pytest
import torch

from fsdp_conformance.adapters import UnsupportedFeatureError

from . import training, verdict
from .loops import LoopCase, _parametrize, build

# an error that names the shared parameter: its attribute name and one of its modules
_NAMES_SHARED = re.compile(r"\bweight\b.*\b(embed|head|Embedding|Linear)|(embed|head)\.weight")


class BaseSharedParamsTests:
    """One parameter used by two instances: a clear error at wrap (or at the first forward,
    before any training), or training as DDP."""

    model: ClassVar[str] = "tied_instances"
    strategies: ClassVar[tuple[str, ...]] = ("FULL_SHARD", "SHARD_GRAD_OP")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        _parametrize(metafunc, strategy=self.strategies)

    @pytest.mark.world_size(2)
    def test_shared_parameter_across_instances(self, fsdp_adapter: Any, dist: Any, strategy: str):
        case = LoopCase(self.model, strategy, "tied_apart")
        with verdict.cell(fsdp_adapter, "wrap.shared_across_instances", case):
            adapter = fsdp_adapter
            label = (
                f"adapter {adapter.name!r}, {self.model} (embed.weight is head.weight, the two "
                f"wrapped apart), {strategy}"
            )
            try:
                root, zoo_model = build(adapter, self.model, dist, {"sharding_strategy": strategy})
                with torch.no_grad():  # the root's lazy init (FSDP2 checks parameters there)
                    root(*zoo_model.get_input(dist.device))
            except UnsupportedFeatureError:
                raise
            except Exception as error:  # noqa: BLE001 -- a refusal of any type is allowed
                message = f"{type(error).__name__}: {error}"
                assert _NAMES_SHARED.search(message), (
                    f"{label}: wrapping failed with {message!r}, which does not name the shared "
                    "parameter (e.g. 'head.weight', shared with 'embed')"
                )
                return
            losses = training.train(root, zoo_model, dist.device, adapter=adapter)
            result = training.TrainingResult(losses, adapter.full_params(root))
            training.assert_same_training(
                f"{label}: the wrap was accepted, so training must match DDP",
                result,
                training.reference_run(self.model, dist),
            )


class TestSharedParams(BaseSharedParamsTests):
    pass
