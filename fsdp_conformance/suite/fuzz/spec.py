"""The generated case (``FuzzCase``): plain frozen values, so ``repr(case)`` is Python that
rebuilds it and every rank builds the identical model from the case alone.

[Note: the generated model]
A ``ModelSpec`` is a tree of nodes applied in order to an activation ``h`` of shape
``(batch, width)``; each node's forward is ``node(h, tokens, it)`` (``it``: the step index) and
returns ``h`` in its ``output`` container. Leaves (``Block``) are described by ``describe``; a
branch's use changes between steps, never within one (a parameter used inside ``no_sync`` but
unused by the synchronising backward has no agreed outcome). The model ends in a trainable
``Linear(width, 2)`` head.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

# dtype names of the mixed-precision policy -> torch attribute
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclasses.dataclass(frozen=True)
class Block:
    """One leaf module (see [Note: the generated model])."""

    kind: str
    width_in: int
    width_out: int
    bias: bool = True
    tie: int = 0
    frozen: bool = False
    checkpoint: bool = False
    output: str = "tensor"
    period: int = 2  # branch: used when it % period == 0
    vocab: int = 0  # embed: number of embeddings


@dataclasses.dataclass(frozen=True)
class Seq:
    """A container node: its children applied in order."""

    nodes: tuple[Block | Seq, ...]
    checkpoint: bool = False
    output: str = "tensor"


Node = Union[Block, Seq]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The whole model: input width, body, init seed, the root's output container."""

    width: int
    body: Seq
    seed: int = 0
    output: str = "tensor"


@dataclasses.dataclass(frozen=True)
class Step:
    """One optimizer step: micro-batches (False = backward inside no_sync), the max_norm of a
    clip before the step, an evaluation forward after it, a full-state-dict round trip."""

    micro: tuple[bool, ...] = (True,)
    clip: float | None = None
    eval: bool = False
    round_trip: bool = False


@dataclasses.dataclass(frozen=True)
class Program:
    """The training program: steps, batch size per micro-batch, data seed."""

    steps: tuple[Step, ...]
    batch: int = 2
    data_seed: int = 0


@dataclasses.dataclass(frozen=True)
class FuzzCase:
    """One generated case.

    Attributes:
        model: the model spec.
        plan: module paths (of the unwrapped model) wrapped as nested instances, innermost
            first, before the root wrap.
        config: the wrap config as sorted (key, value) pairs.
        program: the training program.
        precision: the mixed-precision policy as sorted (key, dtype name) pairs (keys
            param_dtype / reduce_dtype / buffer_dtype, names of ``DTYPES``); () = float32.
        meta: built on the meta device, wrapped, materialised and loaded with the CPU build's
            weights.
    """

    model: ModelSpec
    plan: tuple[str, ...] = ()
    config: tuple[tuple[str, Any], ...] = ()
    program: Program = Program(steps=(Step(),))
    precision: tuple[tuple[str, str], ...] = ()
    meta: bool = False

    @property
    def wrap_config(self) -> dict[str, Any]:
        """The config ``adapter.wrap`` gets (``mixed_precision`` as a dict of torch dtypes)."""
        config = dict(self.config)
        if self.precision:
            import torch

            config["mixed_precision"] = {
                key: getattr(torch, DTYPES[name]) for key, name in self.precision
            }
        return config

    def uses(self) -> frozenset[str]:
        """What the case exercises, for ``Deviation(check="fuzz.generated", applies=...)``:
        block kinds, "frozen", "tie", "checkpoint", "output:KIND", "no_sync",
        "accumulate:synced", "clip", "eval", "nested", "checkpoint:wrapped", "branch:wrapped",
        "instance-output:KIND", "config:KEY=VALUE", "precision:bf16" (param_dtype),
        "precision:reduce=fp32", "precision:buffer=bf16", "state_dict:round_trip", "init:meta".
        """
        used: set[str] = {f"output:{self.model.output}", f"instance-output:{self.model.output}"}
        for path, node in node_paths(self.model.body):
            wrapped = path in self.plan
            flags = {
                f"output:{node.output}": True,
                "checkpoint": node.checkpoint,
                "checkpoint:wrapped": node.checkpoint
                and any(p == path or p.startswith(path + ".") for p in self.plan),
                f"instance-output:{node.output}": wrapped,
            }
            if isinstance(node, Block):
                flags.update({node.kind: True, "frozen": node.frozen, "tie": node.tie})
                flags["branch:wrapped"] = wrapped and node.kind == "branch"
            used.update(name for name, on in flags.items() if on)
        for step in self.program.steps:
            flags = {
                "no_sync": not all(step.micro),
                "accumulate:synced": any(step.micro[:-1]),
                "clip": step.clip is not None,
                "eval": step.eval,
                "state_dict:round_trip": step.round_trip,
            }
            used.update(name for name, on in flags.items() if on)
        if any(a != b and b.startswith(a + ".") for a in self.plan for b in self.plan):
            used.add("nested")
        used.update(f"config:{key}={value}" for key, value in self.config)
        for key, name in self.precision:
            short = key.removesuffix("_dtype")
            used.add(f"precision:{name}" if short == "param" else f"precision:{short}={name}")
        if self.meta:
            used.add("init:meta")
        return frozenset(used)

    def size(self) -> int:
        """A rough size (nodes + plan + steps + micro-batches), for progress lines."""
        program = sum(
            len(step.micro) + (step.clip is not None) + step.eval + step.round_trip
            for step in self.program.steps
        )
        nodes = sum(1 for _ in iter_nodes(self.model.body))
        return nodes + len(self.plan) + program + len(self.precision) + self.meta


def iter_nodes(seq: Seq):
    """Every node under ``seq`` (pre-order, ``seq`` itself excluded)."""
    for _, node in node_paths(seq):
        yield node


def node_paths(seq: Seq, prefix: str = "body") -> list[tuple[str, Node]]:
    """(module path in the built model, node) for every node under ``seq``, pre-order."""
    out: list[tuple[str, Node]] = []
    for index, node in enumerate(seq.nodes):
        path = f"{prefix}.nodes.{index}"
        out.append((path, node))
        if isinstance(node, Seq):
            out += node_paths(node, path)
    return out


_BLOCK_TEXT = {
    "linear": "Linear({width_in}, {width_out}, bias={bias})",
    "layernorm": "LayerNorm({width_in})",
    "act": "Tanh()",
    "embed": "h + Embedding({vocab}, {width_in})(tokens % {vocab})",
    "twice": "h + lin(tanh(lin(h))), lin = Linear({width_in}, {width_in})  # called twice",
    "branch": "h + Linear({width_in}, {width_in})(h) if it % {period} == 0 else h  # unused in "
    "some forwards",
}


def describe(case: FuzzCase, world_size: int | None = None) -> str:
    """The case as readable text: the model as code-like lines, the plan, config and program."""
    lines = ["model (input width %d, init seed %d):" % (case.model.width, case.model.seed)]
    if case.meta:
        lines[0] += (
            "  # built on the meta device, wrapped, adapter.materialize(), then loaded with "
            "these weights"
        )

    def render(seq: Seq, prefix: str, indent: int) -> None:
        for index, node in enumerate(seq.nodes):
            path = f"{prefix}.nodes.{index}"
            marks = ["WRAPPED"] if path in case.plan else []
            if node.checkpoint:
                marks.append("checkpointed")
            if node.output != "tensor":
                marks.append(f"returns {node.output}")
            suffix = f"   # {', '.join(marks)}" if marks else ""
            pad = "  " * indent
            if isinstance(node, Seq):
                lines.append(f"{pad}{path} = Seq(  {suffix.strip()}".rstrip())
                render(node, path, indent + 1)
                lines.append(f"{pad})")
            else:
                text = _BLOCK_TEXT[node.kind].format(**dataclasses.asdict(node))
                if node.tie:
                    text += f"  # weight tied (tie {node.tie})"
                if node.frozen:
                    text += "  # frozen"
                lines.append(f"{pad}{path} = {text}{suffix}")

    render(case.model.body, "body", 1)
    lines.append(
        f"  head = Linear({final_width(case.model)}, 2)"
        + (f"   # root returns {case.model.output}" if case.model.output != "tensor" else "")
    )
    lines.append("loss = output.float().pow(2).mean() per micro-batch")
    lines.append(
        "wrap plan (innermost first, then the root): "
        + (", ".join(sorted(case.plan, key=lambda p: -p.count("."))) or "root only")
    )
    lines.append(f"config: {', '.join(f'{k}={v!r}' for k, v in case.config) or 'defaults'}")
    if case.precision:
        policy = ", ".join(f"{key}={name}" for key, name in case.precision)
        lines.append(f"mixed_precision: {policy} (compared with float32 DDP within a tolerance)")
    program = case.program
    lines.append(
        f"program: batch {program.batch} per micro-batch per rank, data seed {program.data_seed}"
        + (f", world size {world_size}" if world_size else "")
    )
    for index, step in enumerate(program.steps):
        micro = " ".join("sync" if sync else "no_sync" for sync in step.micro)
        extra = [f"clip_grad_norm_({step.clip:g})"] if step.clip is not None else []
        extra.append("optimizer.step()")
        if step.round_trip:
            extra.append("load_state_dict(state_dict()) (the full state dict, round trip)")
        if step.eval:
            extra.append("eval forward under no_grad")
        lines.append(f"  step {index}: micro-batches [{micro}]; " + "; ".join(extra))
    return "\n".join(lines)


def final_width(model: ModelSpec) -> int:
    """The activation width after the body (the head's input width)."""
    width = model.width
    for node in iter_nodes(model.body):
        if isinstance(node, Block):
            width = node.width_out
    return width
