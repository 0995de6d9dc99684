"""hypothesis strategies for ``FuzzCase`` (imported only where hypothesis is needed).

``cases(capabilities)`` draws only what the adapter declares (``Capabilities.of(adapter,
world_size)``), simplest first, so hypothesis shrinks towards small, plain cases.

[Note: what is not generated, and why]
- A weight tied across two instances: FSDP1-style flat parameters need shared parameters in one
  instance, so the plan never separates tied blocks.
- ``sync_module_states`` / ``device_id``: every rank builds identical weights already.
- A step whose last micro-batch runs inside ``no_sync``: the optimizer would step on unreduced
  gradients, which no FSDP promises to match DDP.
Mixed precision is drawn in one case in four, compared with the suite's precision tolerance.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdp_conformance.adapters import Feature
from fsdp_conformance.adapters import features as adapter_features

from .spec import Block, FuzzCase, ModelSpec, Program, Seq, Step, node_paths

# widths drawn (the first is what shrinking goes towards; 1 and 3: below / not a multiple of 2)
WIDTHS = (4, 1, 3, 2, 5, 8, 7)
MAX_DEPTH = 2  # Seq nesting levels below the body
MAX_NODES = 4  # children per Seq
MAX_STEPS = 3
MAX_MICRO = 3
CLIP_NORMS = (1.0, 0.05, 100.0)
PRECISIONS = ("bf16", "fp16", "fp32")


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What an adapter lets the generator draw (picklable)."""

    supported: frozenset[str]
    unsupported_values: tuple[tuple[str, Any], ...]
    world_size: int

    @classmethod
    def of(cls, adapter: Any, world_size: int) -> Capabilities:
        return cls(
            frozenset(adapter_features.capabilities(adapter)),
            tuple(dict(adapter.declarations.unsupported_values)),
            world_size,
        )

    def has(self, *features: str) -> bool:
        return all(feature in self.supported for feature in features)


def _allowed(caps: Capabilities, config: dict[str, Any]) -> bool:
    from fsdp_conformance.adapters.features import features_for, normalize_config

    return all(feature in caps.supported for feature in features_for(normalize_config(config)))


def _config_options(caps: Capabilities) -> list[tuple[str, tuple[Any, ...]]]:
    """(key, allowed values) of the wrap config keys the generator varies."""
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
            if _allowed(caps, {key: value}) and (key, value) not in refused
        )
        if allowed:
            options.append((key, allowed))
    return options


def _precision_policies(caps: Capabilities) -> list[tuple[tuple[str, str], ...]]:
    """The mixed-precision policies (``FuzzCase.precision``) the adapter's features allow, at
    least one dtype below float32."""
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
                policy = tuple(sorted(policy))
                if _allowed(caps, FuzzCase(ModelSpec(1, Seq(())), precision=policy).wrap_config):
                    policies.append(policy)
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

    def one_in(draw: Any, n: int) -> bool:
        return draw(st.integers(0, n - 1)) == n - 1

    @st.composite
    def block(draw: Any, width: int) -> Block:
        kind = draw(st.sampled_from(kinds))
        width_out, bias, tie = width, True, 0
        if kind == "linear":
            width_out = draw(st.sampled_from(WIDTHS))
            bias = draw(st.booleans())
            if width_out == width and draw(st.booleans()):
                tie = width  # every tied square Linear of this width shares one weight
        frozen = frozen_ok and kind != "act" and not tie and one_in(draw, 5)
        return Block(
            kind=kind,
            width_in=width,
            width_out=width_out,
            bias=bias,
            tie=tie,
            frozen=frozen,
            checkpoint=checkpoint_ok and one_in(draw, 4),
            output=draw(outputs),
            period=draw(st.integers(2, 3)) if kind == "branch" else 2,
            vocab=draw(st.integers(1, 5)) if kind == "embed" else 0,
        )

    @st.composite
    def seq(draw: Any, width: int, depth: int) -> tuple[Seq, int]:
        nodes = []
        for _ in range(draw(st.integers(1, max_nodes))):
            if depth < MAX_DEPTH and one_in(draw, 4):
                node, width = draw(seq(width, depth + 1))
                checkpoint = checkpoint_ok and one_in(draw, 4)
                node = dataclasses.replace(node, checkpoint=checkpoint, output=draw(outputs))
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
        plan = {path for path in candidates if one_in(draw, 3)}
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
            round_trip = round_trip_ok and one_in(draw, 4)
            steps.append(Step(tuple(micro), clip, evaluate, round_trip))
        program = Program(
            tuple(steps), batch=draw(st.integers(1, 3)), data_seed=draw(st.integers(0, 3))
        )
        precision = ()
        if policies and one_in(draw, 4):
            precision = draw(st.sampled_from(policies))
        meta = meta_ok and one_in(draw, 4)
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
    owners = [wrapped for wrapped in plan if path == wrapped or path.startswith(wrapped + ".")]
    return max(owners, key=lambda wrapped: wrapped.count("."), default=None)
