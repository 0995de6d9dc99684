"""hypothesis strategies for ``FuzzCase`` (imported only where hypothesis is needed).

``cases(capabilities)`` draws a model spec, a wrap plan, a wrap config and a training program
using only what the adapter declares (``Capabilities.of(adapter, world_size)``): a feature the
adapter does not support is never drawn. Draws are ordered simplest first, so hypothesis shrinks
towards small, plain cases (one block, tensor outputs, root-only wrapping, one synced step).

[Note: what is not generated, and why]
- A weight tied across two *different* instances: FSDP1-style flat parameters require shared
  parameters to live in one instance (their lowest common ancestor); the plan never separates
  tied blocks (a tie is always inside one instance, the root or a nested one).
- Mixed precision: drawn in one case in four (param_dtype and reduce_dtype among bf16 / fp16 /
  fp32, buffer_dtype where the adapter casts buffers), as far as the adapter's features allow;
  the comparison then uses the suite's precision tolerance (``run.tolerance``).
- ``sync_module_states`` / ``device_id``: every rank builds identical weights already; they
  are the config-matrix checks' business.
- A step whose last micro-batch runs inside ``no_sync``: the optimizer would step on
  unreduced gradients, which no FSDP promises to match DDP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdp_conformance.adapters import Feature
from fsdp_conformance.adapters import features as adapter_features

from .spec import Block, FuzzCase, ModelSpec, Program, Seq, Step, node_paths

# Sizes drawn for widths (first = what shrinking goes towards); 1 and 3 are below / not a
# multiple of the world size
WIDTHS = (4, 1, 3, 2, 5, 8, 7)
MAX_DEPTH = 2  # Seq nesting levels below the body
MAX_NODES = 4  # children per Seq
MAX_STEPS = 3
MAX_MICRO = 3
CLIP_NORMS = (1.0, 0.05, 100.0)
PRECISIONS = ("bf16", "fp16", "fp32")


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What an adapter lets the generator draw (picklable; built in a rank from the adapter)."""

    supported: frozenset[str]
    unsupported_values: tuple[tuple[str, Any], ...]
    world_size: int

    @classmethod
    def of(cls, adapter: Any, world_size: int) -> Capabilities:
        return cls(
            frozenset(adapter_features.capabilities(adapter)),
            tuple(dict(adapter_features.declared(adapter).unsupported_values)),
            world_size,
        )

    def has(self, *features: str) -> bool:
        return all(feature in self.supported for feature in features)


def _config_options(caps: Capabilities) -> list[tuple[str, tuple[Any, ...]]]:
    """(key, allowed values) of the wrap config keys the generator varies."""
    from fsdp_conformance.adapters.features import features_for, normalize_config

    candidates = [
        ("sharding_strategy", ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")),
        ("backward_prefetch", ("BACKWARD_PRE", "BACKWARD_POST", None)),
        ("forward_prefetch", (True, False)),
        ("limit_all_gathers", (True, False)),
        ("cpu_offload", (True,)),
        ("use_orig_params", (True,)),
    ]
    refused = set(caps.unsupported_values)
    options = []
    for key, values in candidates:
        allowed = tuple(
            value
            for value in values
            if all(
                feature in caps.supported
                for feature in features_for(normalize_config({key: value}))
            )
            and (key, value) not in refused
        )
        if allowed:
            options.append((key, allowed))
    return options


def _precision_policies(caps: Capabilities) -> list[tuple[tuple[str, str], ...]]:
    """The mixed-precision policies (``FuzzCase.precision``) the adapter's features allow, at
    least one dtype of each below float32 (all-float32 is the plain case)."""
    from fsdp_conformance.adapters.features import features_for, normalize_config

    if not caps.has(Feature.MIXED_PRECISION):
        return []
    policies = []
    for param in PRECISIONS:
        for reduce in PRECISIONS:
            for buffer in (None, param):
                if "fp32" == param == reduce or (buffer is not None and param == "fp32"):
                    continue
                policy = (("param_dtype", param), ("reduce_dtype", reduce))
                if buffer is not None:
                    policy += (("buffer_dtype", buffer),)
                case = FuzzCase(ModelSpec(1, Seq(())), precision=tuple(sorted(policy)))
                needed = features_for(normalize_config(case.wrap_config))
                if all(feature in caps.supported for feature in needed):
                    policies.append(tuple(sorted(policy)))
    return policies


def cases(caps: Capabilities, max_steps: int = MAX_STEPS, max_nodes: int = MAX_NODES) -> Any:
    """The strategy of ``FuzzCase`` for an adapter with ``caps``."""
    from hypothesis import strategies as st

    kinds = ["linear", "act", "layernorm", "embed", "twice"]
    if caps.has(Feature.FORWARD_VARIANTS):
        kinds.append("branch")
    frozen_ok = caps.has(Feature.FROZEN_PARAMETERS) or caps.has(Feature.FROZEN_PARAMETERS_MIXED)
    mixed_ok = caps.has(Feature.FROZEN_PARAMETERS_MIXED)
    checkpoint_ok = caps.has(Feature.ACTIVATION_CHECKPOINTING)
    outputs = st.sampled_from(("tensor", "tuple", "list", "dict", "dataclass"))
    config_options = _config_options(caps)
    policies = _precision_policies(caps)
    round_trip_ok = caps.has(Feature.FULL_STATE_DICT)
    meta_ok = caps.has(Feature.META_INIT)

    @st.composite
    def block(draw: Any, width: int) -> Block:
        kind = draw(st.sampled_from(kinds))
        width_out = width
        bias = True
        tie = 0
        if kind == "linear":
            width_out = draw(st.sampled_from(WIDTHS))
            bias = draw(st.booleans())
            if width_out == width and draw(st.booleans()):
                tie = width  # every tied square Linear of this width shares one weight
        frozen = frozen_ok and kind not in ("act",) and not tie and draw(st.integers(0, 4)) == 4
        return Block(
            kind=kind,
            width_in=width,
            width_out=width_out,
            bias=bias,
            tie=tie,
            frozen=frozen,
            checkpoint=checkpoint_ok and draw(st.integers(0, 3)) == 3,
            output=draw(outputs),
            period=draw(st.integers(2, 3)) if kind == "branch" else 2,
            vocab=draw(st.integers(1, 5)) if kind == "embed" else 0,
        )

    @st.composite
    def seq(draw: Any, width: int, depth: int) -> tuple[Seq, int]:
        count = draw(st.integers(1, max_nodes))
        nodes = []
        for _ in range(count):
            if depth < MAX_DEPTH and draw(st.integers(0, 3)) == 3:
                node, width = draw(seq(width, depth + 1))
                node = dataclasses.replace(
                    node,
                    checkpoint=checkpoint_ok and draw(st.integers(0, 3)) == 3,
                    output=draw(outputs),
                )
            else:
                node = draw(block(width))
                width = node.width_out
            nodes.append(node)
        return Seq(tuple(nodes)), width

    @st.composite
    def case(draw: Any) -> FuzzCase:
        width = draw(st.sampled_from(WIDTHS))
        body, _ = draw(seq(width, 0))
        model = ModelSpec(
            width=width, body=body, seed=draw(st.integers(0, 3)), output=draw(outputs)
        )
        paths = node_paths(body)
        candidates = [path for path, _ in paths]
        candidates += [
            f"{path}.lin"
            for path, node in paths
            if isinstance(node, Block) and node.kind == "twice"
        ]
        candidates.append("head")
        plan = {path for path in candidates if draw(st.integers(0, 2)) == 2}
        plan = _legal_plan(plan, paths, frozen_needs_instance=not mixed_ok)
        config = []
        for key, values in config_options:
            if draw(st.booleans()):
                config.append((key, draw(st.sampled_from(values))))
        steps = []
        for _ in range(draw(st.integers(1, max_steps))):
            micro = [True]
            if caps.has(Feature.GRADIENT_ACCUMULATION):
                micro = [draw(st.booleans()) for _ in range(draw(st.integers(0, MAX_MICRO - 1)))]
                micro = [not unsynced for unsynced in micro] + [True]
            clip = None
            if caps.has(Feature.CLIP_GRAD_NORM) and draw(st.booleans()):
                clip = draw(st.sampled_from(CLIP_NORMS))
            evaluate = caps.has(Feature.FORWARD_VARIANTS) and draw(st.booleans())
            round_trip = round_trip_ok and draw(st.integers(0, 3)) == 3
            steps.append(Step(tuple(micro), clip, evaluate, round_trip))
        program = Program(
            tuple(steps), batch=draw(st.integers(1, 3)), data_seed=draw(st.integers(0, 3))
        )
        precision = ()
        if policies and draw(st.integers(0, 3)) == 3:
            precision = draw(st.sampled_from(policies))
        meta = meta_ok and draw(st.integers(0, 3)) == 3
        return FuzzCase(model, tuple(sorted(plan)), tuple(sorted(config)), program, precision, meta)

    return case()


def _legal_plan(
    plan: set[str], paths: list[tuple[str, Any]], frozen_needs_instance: bool
) -> set[str]:
    """``plan`` without wraps that would split a weight tie; with every frozen block wrapped on
    its own when the adapter cannot mix frozen and trainable parameters in one instance."""
    ties: dict[int, list[str]] = {}
    for path, node in paths:
        if isinstance(node, Block) and node.tie:
            ties.setdefault(node.tie, []).append(path)
    changed = True
    while changed:
        changed = False
        for members in ties.values():
            owners = {_innermost(plan, member) for member in members}
            if len(owners) > 1 or any(owner in members for owner in owners):
                # drop the deepest wrap that separates the group and look again
                drop = max(owners - {None}, key=lambda path: path.count("."))
                plan.discard(drop)
                changed = True
    if frozen_needs_instance:
        plan |= {path for path, node in paths if isinstance(node, Block) and node.frozen}
    return plan


def _innermost(plan: set[str], path: str) -> str | None:
    """The deepest wrapped module containing ``path`` (itself included), None for the root."""
    best = None
    for wrapped in plan:
        if path == wrapped or path.startswith(wrapped + "."):
            if best is None or wrapped.count(".") > best.count("."):
                best = wrapped
    return best
