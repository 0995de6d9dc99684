"""Each check of the FSDP2 API family (suite/test_fsdp2_api.py) passes on torch FSDP2 and fails on
a torch FSDP2 broken in the way it checks (the passing cells run in the same subprocess).

One pytest run (a subprocess, through pytester, ranks as threads) of a test file that patches
torch FSDP2's internals (torch 2.13) so that they misbehave only for the modules a broken FSDP2
namespace shards: each variant is the torch-fsdp2 adapter declaring its own namespace
(``Declarations.api["fsdp2"]``), whose ``fully_shard`` marks the states it creates (or runs while
a patched init function looks); one suite class per variant, one cell each:

- the root keeps its parameters unsharded despite ``reshard_after_forward=True`` (torch before
  the fix of pytorch#154655);
- ``reshard_after_forward=2`` treated as True (resharded over the whole mesh);
- ``output_dtype`` ignored; forward inputs cast despite ``cast_forward_inputs=False``; no input
  cast in an activation-checkpoint recompute (pytorch#159359); gradients reduced in
  ``param_dtype``, not ``reduce_dtype``;
- a recompute under ``checkpoint(block)`` that does not unshard a ``fully_shard``'ed child the
  first of two forwards' backward resharded (the error of pytorch#153354);
- grouped ``fully_shard([embed, head])`` giving each module its own copy of the tied weight;
- ``Shard(1)`` gradients reduce-scattered as dim-0 chunks;
- CPU offload overwriting the gradient accumulated over micro-batches with the newest one;
- ``DataParallelMeshDims`` reading only the first name of a tuple;
- FSDP over tensor-parallel parameters laid out ``Shard`` where ``_StridedShard`` is due (the
  full values come back in the wrong order).
"""

from __future__ import annotations

import textwrap

import pytest

from fsdp_conformance.adapters import features, get_adapter

pytest_plugins = ["pytester"]


BROKEN = textwrap.dedent(
    '''
    from __future__ import annotations

    import dataclasses

    import pytest
    import torch
    import torch.distributed.fsdp as fsdp
    from torch import nn
    from torch.distributed.fsdp._fully_shard import (
        _fsdp_init, _fsdp_param, _fsdp_param_group, _fsdp_state, _fully_shard,
    )
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.tensor import Shard

    from fsdp_conformance.adapters.torch_fsdp2 import TorchFSDP2Adapter
    from fsdp_conformance.suite import BaseFSDP2APITests

    WRAPPING = {}  # "mutant": the broken namespace whose fully_shard runs


    class Broken:
        """torch.distributed.fsdp whose fully_shard marks its states and groups `mutant`."""

        def __init__(self, mutant):
            self.mutant = mutant

        def __getattr__(self, name):
            return getattr(fsdp, name)

        def fully_shard(self, module, **options):
            WRAPPING["mutant"] = self.mutant
            try:
                result = fsdp.fully_shard(module, **options)
            finally:
                WRAPPING.clear()
            state = fsdp.fully_shard.state(module[0] if isinstance(module, list) else module)
            for marked in (state, *state._fsdp_param_groups):
                marked.mutant = self.mutant
            return result


    def broken(owner, name, mutant, replacement):
        """Patch owner.name: `replacement(original, *args)` where `mutant` is marked (the first
        argument) or wrapping, else the original."""
        original = getattr(owner, name)

        def patched(*args, **kwargs):
            marked = getattr(args[0], "mutant", None) if args else None
            if mutant in (marked, WRAPPING.get("mutant")):
                return replacement(original, *args, **kwargs)
            return original(*args, **kwargs)

        setattr(owner, name, patched)


    def root_keeps_unsharded(original, state):
        original(state)
        if state._is_root:
            for group in state._fsdp_param_groups:
                group.post_forward_mesh_info = None


    def int_as_true(original, reshard_after_forward, mesh_info):
        return original(True if reshard_after_forward else False, mesh_info)


    def casts_anyway(original, state, args, kwargs):
        policy = state._mp_policy
        state._mp_policy = dataclasses.replace(policy, cast_forward_inputs=True)
        try:
            return original(state, args, kwargs)
        finally:
            state._mp_policy = policy


    def recompute_skips_casts(original, state, args, kwargs):
        if state._training_state == TrainingState.PRE_BACKWARD:
            return args, kwargs
        return original(state, args, kwargs)


    def recompute_stays_sharded(original, state, module, args, kwargs):
        if state._training_state == TrainingState.PRE_BACKWARD:
            return state._cast_forward_inputs(args, kwargs)
        return original(state, module, args, kwargs)


    def reduces_in_param_dtype(original, group):
        original(group)
        for fsdp_param in group.fsdp_params:
            fsdp_param.reduce_dtype = None
        group._reduce_dtype = None


    def unties(original, modules, ignored_params=None):
        """Each later module of a group gets its own copy of a parameter an earlier one has."""
        params, buffers = original(modules, ignored_params)
        for index, module in enumerate(modules):
            earlier = {id(p) for m in modules[:index] for p in m.parameters(recurse=False)}
            for name, param in list(module.named_parameters(recurse=False)):
                if id(param) in earlier:
                    copy = nn.Parameter(param.detach().clone())
                    setattr(module, name, copy)
                    params.append(copy)
        return params, buffers


    def reduces_rows(original, fsdp_params, *args, **kwargs):
        placements = [p.fsdp_placement for p in fsdp_params]
        for fsdp_param in fsdp_params:
            fsdp_param.fsdp_placement = Shard(0)
        try:
            return original(fsdp_params, *args, **kwargs)
        finally:
            for fsdp_param, placement in zip(fsdp_params, placements):
                fsdp_param.fsdp_placement = placement


    def overwrites_accumulated(original, fsdp_params, *args, **kwargs):
        for fsdp_param in fsdp_params:
            fsdp_param.sharded_param.grad = None
        return original(fsdp_params, *args, **kwargs)


    def first_dim_only(original, mesh, dims=None):
        if dims is not None:
            first = lambda names: names[0] if isinstance(names, tuple) else names
            dims = fsdp.DataParallelMeshDims(shard=first(dims.shard), replicate=first(dims.replicate))
        return original(mesh, dims)


    def strided_as_shard(original, fsdp_param, *args, **kwargs):
        local = original(fsdp_param, *args, **kwargs)
        spec = fsdp_param._sharding_spec
        placements = tuple(
            Shard(p.dim) if type(p).__name__ == "_StridedShard" else p for p in spec.placements
        )
        fsdp_param._spmd_placements = placements
        fsdp_param._sharding_spec = type(spec)(spec.mesh, placements, tensor_meta=spec.tensor_meta)
        return local


    State, Group = _fsdp_state.FSDPState, _fsdp_param_group.FSDPParamGroup
    broken(State, "_lazy_init", "root_keeps_unsharded", root_keeps_unsharded)
    broken(_fully_shard, "_get_post_forward_mesh_info", "int_as_true", int_as_true)
    broken(State, "_cast_output_dtype", "output_dtype_ignored", lambda original, state, out: out)
    broken(State, "_cast_forward_inputs", "casts_anyway", casts_anyway)
    broken(State, "_cast_forward_inputs", "recompute_skips_casts", recompute_skips_casts)
    broken(State, "_pre_forward", "recompute_stays_sharded", recompute_stays_sharded)
    broken(Group, "_init_mp_dtypes", "reduces_in_param_dtype", reduces_in_param_dtype)
    broken(_fsdp_init, "_get_managed_states", "unties", unties)
    broken(_fully_shard, "_get_mesh_info", "first_dim_only", first_dim_only)
    broken(_fsdp_param.FSDPParam, "_init_sharding_spec_tp", "strided_as_shard", strided_as_shard)

    _post_backward = Group.post_backward
    _foreach_reduce = _fsdp_param_group.foreach_reduce
    REDUCING = {}


    def post_backward(group, *args, **kwargs):
        REDUCING["mutant"] = getattr(group, "mutant", None)
        try:
            return _post_backward(group, *args, **kwargs)
        finally:
            REDUCING.clear()


    def foreach_reduce(fsdp_params, *args, **kwargs):
        patch = {"reduces_rows": reduces_rows, "overwrites_accumulated": overwrites_accumulated}
        replacement = patch.get(REDUCING.get("mutant"))
        if replacement is None:
            return _foreach_reduce(fsdp_params, *args, **kwargs)
        return replacement(_foreach_reduce, fsdp_params, *args, **kwargs)


    Group.post_backward = post_backward
    _fsdp_param_group.foreach_reduce = foreach_reduce


    def variant(mutant):
        declarations = dataclasses.replace(
            TorchFSDP2Adapter.declarations, api={"fsdp2": Broken(mutant)}
        )
        return type(mutant, (TorchFSDP2Adapter,), {
            "name": mutant.replace("_", "-"), "declarations": declarations
        })


    MUTANTS = (
        "root_keeps_unsharded", "int_as_true", "output_dtype_ignored", "casts_anyway",
        "recompute_skips_casts", "recompute_stays_sharded", "reduces_in_param_dtype", "unties",
        "reduces_rows",
        "overwrites_accumulated", "first_dim_only", "strided_as_shard",
    )
    for _mutant in MUTANTS:
        globals()[f"Adapter_{_mutant}"] = variant(_mutant)

        class _Test(BaseFSDP2APITests):
            @pytest.fixture
            def fsdp_impl(self, mutant=_mutant):
                return f"test_broken_fsdp2:Adapter_{mutant}"

        globals()[f"Test_{_mutant}"] = _Test


    class TestOnTorchFSDP2(BaseFSDP2APITests):
        """No false failure: the default run's cells pass on torch FSDP2 itself (its states
        unmarked, every patch above passes through)."""

        coverage = "pairwise"

        @pytest.fixture
        def fsdp_impl(self):
            return "torch-fsdp2"
    '''
)

# (cell, a line its failure shows)
CELLS = [
    (
        "Test_root_keeps_unsharded::test_reshard_after_forward[True]",
        "*step 0: trunk.weight: holds (16, 8) of (16, 8), 1/2 promised*",
    ),
    (
        "Test_int_as_true::test_reshard_after_forward[int]",
        "*step 0: backward all-gathered over groups of [[]4[]] ranks; 2 ranks promised*",
    ),
    (  # the norm's fp32 output reaches the next block's bf16 Linear
        "Test_output_dtype_ignored::test_mixed_precision",
        "*RuntimeError: mat1 and mat2 must have the same dtype, but got Float and BFloat16*",
    ),
    ("Test_casts_anyway::test_mixed_precision", "*blocks.0 (block) inputs: *torch.bfloat16)*"),
    (
        "Test_recompute_skips_casts::test_mixed_precision",
        "*CheckpointError: torch.utils.checkpoint: Recomputed values for the following tensors*",
    ),
    (  # the second forward's recompute finds the first backward's resharded parameters
        "Test_recompute_stays_sharded::test_activation_checkpointing[composable]",
        "*RuntimeError: aten.addmm.default got mixed torch.Tensor and DTensor*",
    ),
    (
        "Test_reduces_in_param_dtype::test_mixed_precision",
        "*blocks.0 (block) reduction: [[]'torch.bfloat16'[]], torch.float32 promised*",
    ),
    ("Test_unties::test_grouped_tied", "*after training head.weight is no longer embed.weight*"),
    (
        "Test_reduces_rows::test_shard_placement_fn",
        "*step 0: trunk.weight's gradient differs from DDP's*",
    ),
    (
        "Test_overwrites_accumulated::test_cpu_offload[sync_every]",
        "*overwrites-accumulated*losses differ from DDP's*",
    ),
    (
        "Test_first_dim_only::test_dp_mesh_dims[shard_flat]",
        "*CheckFailure: parameters not sharded over the shard dims: adapter 'first-dim-only'*",
    ),
    (
        "Test_strided_as_shard::test_tensor_parallel",
        "*adapter 'strided-as-shard'*parameter 'blocks.0.up.weight' differs*",
    ),
]


PASSING = 8  # TestOnTorchFSDP2: the cells of fsdp-conformance run's default coverage


def test_each_fsdp2_api_check_passes_on_torch_and_fails_on_its_broken_variant(
    pytester: pytest.Pytester,
) -> None:
    if features.support_problem(get_adapter("torch-fsdp2")) is not None:
        pytest.skip("torch FSDP2 outside the torch-fsdp2 adapter's tested range")
    pytester.makepyfile(test_broken_fsdp2=BROKEN)
    cells = [f"test_broken_fsdp2.py::{cell}" for cell, _ in CELLS]
    cells.append("test_broken_fsdp2.py::TestOnTorchFSDP2")
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rf", "-n", "0", "--fsdp-mode=thread", *cells
    )
    result.assert_outcomes(failed=len(CELLS), passed=PASSING)
    result.stdout.fnmatch_lines([line for _, line in CELLS], consecutive=False)
