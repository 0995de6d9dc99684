"""The generated case: a picklable, printable description of a model, a wrap plan, a wrap config
and a training program (``FuzzCase``). Every field is a plain value (ints, strings, bools,
tuples, frozen dataclasses of them), so ``repr(case)`` is Python that rebuilds the case
(``repro.py`` holds it literally) and every rank builds the identical model from the case alone.

[Note: the generated model]
A ``ModelSpec`` is a tree of nodes applied in order to an activation ``h`` of shape
``(batch, width)``; every node's forward is ``node(h, tokens, it)`` (``tokens``: an int64
batch, ``it``: the index of the step the forward belongs to) and returns ``h`` packed in the node's
``output`` container ("tensor", "tuple", "list", "dict" or "dataclass"), which its parent
unpacks. Leaves (``Block``):

  linear     Linear(width_in, width_out, bias); sizes include 1 (fewer elements than ranks)
             and odd ones; ``tie`` > 0: the weight is shared with every other block of that tie
             id (same shape)
  layernorm  LayerNorm(width)
  act        Tanh: no parameters
  embed      h + Embedding(vocab, width)(tokens % vocab)
  twice      Linear(width, width) called twice in one forward: h + lin(tanh(lin(h)))
  branch     h + Linear(width, width)(h) only when ``it % period == 0`` (unused otherwise).
             Usage changes between steps, never within one: a parameter used inside
             ``no_sync`` but unused by the step's synchronising backward has no agreed outcome
             (DDP reduces the accumulated gradient; an FSDP whose post-backward hook runs per
             used flat parameter never reduces it), so the generator does not draw it

``frozen`` blocks have ``requires_grad=False``; ``checkpoint`` nodes are called through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` by their parent. ``Seq`` nodes
hold children (nesting). The model always ends in a trainable ``Linear(width, 2)`` head.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

# dtype names of the mixed-precision policy -> torch attribute
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
OUTPUT_KINDS = ("tensor", "tuple", "list", "dict", "dataclass")
BLOCK_KINDS = ("linear", "layernorm", "act", "embed", "twice", "branch")


@dataclasses.dataclass(frozen=True)
class Block:
    """One leaf module (see [Note: the generated model])."""

    kind: str
    width_in: int
    width_out: int
    bias: bool = True
    tie: int = 0  # > 0: linear weight shared with the other blocks of this tie id
    frozen: bool = False
    checkpoint: bool = False
    output: str = "tensor"
    period: int = 2  # branch: used when it % period == 0
    vocab: int = 0  # embed: number of embeddings


@dataclasses.dataclass(frozen=True)
class Seq:
    """A container node: its children applied in order."""

    nodes: tuple[Union[Block, "Seq"], ...]
    checkpoint: bool = False
    output: str = "tensor"


Node = Union[Block, Seq]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The whole model: input width, body, init seed (explicit generator, no global RNG)."""

    width: int
    body: Seq
    seed: int = 0
    output: str = "tensor"  # the root's output container


@dataclasses.dataclass(frozen=True)
class Step:
    """One optimizer step: micro-batches (False = backward inside no_sync), clipping, eval."""

    micro: tuple[bool, ...] = (True,)
    clip: float | None = None  # max_norm of clip_grad_norm_ before optimizer.step
    eval: bool = False  # an evaluation forward under no_grad after the step
    # after optimizer.step: the adapter's full state dict taken and loaded back into the model
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
        plan: module paths (of the unwrapped model) wrapped as nested instances before the root
            wrap; wrapped innermost first.
        config: the wrap config as sorted (key, value) pairs ([Note: config vocabulary]).
        program: the training program.
        precision: the mixed-precision policy as sorted (key, dtype name) pairs, keys among
            param_dtype / reduce_dtype / buffer_dtype, names among ``DTYPES``; () = float32.
        meta: the model is built on the meta device, wrapped, materialised
            (``Adapter.materialize``) and loaded with the weights the CPU build has.
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
        """What the case exercises: block kinds, "frozen", "tie", "checkpoint", output kinds
        ("output:dict"), "no_sync", "accumulate:synced" (a step whose gradients are reduced
        before its last micro-batch), "clip", "eval", "nested", "checkpoint:wrapped" (a
        checkpointed node that is or holds an instance), "branch:wrapped" (a branch that is an
        instance),
        "instance-output:KIND" (what the root or a wrapped node returns its activation in),
        config keys ("config:KEY=VALUE"), the mixed-precision policy ("precision:bf16" for
        param_dtype, "precision:reduce=fp32", "precision:buffer=bf16"), "state_dict:round_trip"
        and "init:meta".
        Adapters' ``Deviation(check="fuzz.generated", applies=...)`` select cases with it."""
        used: set[str] = set()
        for node in iter_nodes(self.model.body):
            if isinstance(node, Block):
                used.add(node.kind)
                if node.frozen:
                    used.add("frozen")
                if node.tie:
                    used.add("tie")
            if node.checkpoint:
                used.add("checkpoint")
            used.add(f"output:{node.output}")
        used.add(f"output:{self.model.output}")
        for step in self.program.steps:
            if not all(step.micro):
                used.add("no_sync")
            if any(step.micro[:-1]):
                used.add("accumulate:synced")  # a synchronising backward, then more
            if step.clip is not None:
                used.add("clip")
            if step.eval:
                used.add("eval")
            if step.round_trip:
                used.add("state_dict:round_trip")
        if any(a != b and b.startswith(a + ".") for a in self.plan for b in self.plan):
            used.add("nested")
        used.add(f"instance-output:{self.model.output}")  # the root's
        for path, node in node_paths(self.model.body):
            if node.checkpoint and any(p == path or p.startswith(path + ".") for p in self.plan):
                used.add("checkpoint:wrapped")  # the checkpoint runs around an instance
            if path not in self.plan:
                continue
            used.add(f"instance-output:{node.output}")
            if isinstance(node, Block) and node.kind == "branch":
                used.add("branch:wrapped")  # the branch is itself an instance
        used.update(f"config:{key}={value}" for key, value in self.config)
        policy = dict(self.precision)
        if "param_dtype" in policy:
            used.add(f"precision:{policy['param_dtype']}")
        used.update(
            f"precision:{key.removesuffix('_dtype')}={name}"
            for key, name in self.precision
            if key != "param_dtype"
        )
        if self.meta:
            used.add("init:meta")
        return frozenset(used)

    def size(self) -> int:
        """A rough size (nodes + plan + steps + micro-batches), for progress lines."""
        return (
            sum(1 for _ in iter_nodes(self.model.body))
            + len(self.plan)
            + sum(
                len(step.micro) + (step.clip is not None) + step.eval + step.round_trip
                for step in self.program.steps
            )
            + len(self.precision)
            + self.meta
        )


def iter_nodes(seq: Seq):
    """Every node under ``seq`` (pre-order, ``seq`` itself excluded)."""
    for node in seq.nodes:
        yield node
        if isinstance(node, Seq):
            yield from iter_nodes(node)


def node_paths(seq: Seq, prefix: str = "body") -> list[tuple[str, Node]]:
    """(module path in the built model, node) for every node under ``seq``, pre-order."""
    out: list[tuple[str, Node]] = []
    for index, node in enumerate(seq.nodes):
        path = f"{prefix}.nodes.{index}"
        out.append((path, node))
        if isinstance(node, Seq):
            out += node_paths(node, path)
    return out


# ---------------------------------------------------------------------------- printing
def describe(case: FuzzCase, world_size: int | None = None) -> str:
    """The case as readable text: the model as code-like lines, the plan, config and program."""
    lines = ["model (input width %d, init seed %d):" % (case.model.width, case.model.seed)]
    if case.meta:
        lines[0] += (
            "  # built on the meta device, wrapped, adapter.materialize(), then loaded with "
            "these weights"
        )
    wrapped = set(case.plan)

    def render(seq: Seq, prefix: str, indent: int) -> None:
        for index, node in enumerate(seq.nodes):
            path = f"{prefix}.nodes.{index}"
            marks = []
            if path in wrapped:
                marks.append("WRAPPED")
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
                lines.append(f"{pad}{path} = {_block_text(node)}{suffix}")

    render(case.model.body, "body", 1)
    lines.append(
        f"  head = Linear({_final_width(case.model.body, case.model.width)}, 2)"
        + (f"   # root returns {case.model.output}" if case.model.output != "tensor" else "")
    )
    lines.append("loss = output.float().pow(2).mean() per micro-batch")
    lines.append(
        "wrap plan (innermost first, then the root): "
        + (", ".join(sorted(case.plan, key=lambda p: -p.count("."))) or "root only")
    )
    config = ", ".join(f"{k}={v!r}" for k, v in case.config) or "defaults"
    lines.append(f"config: {config}")
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
        extra = []
        if step.clip is not None:
            extra.append(f"clip_grad_norm_({step.clip:g})")
        extra.append("optimizer.step()")
        if step.round_trip:
            extra.append("load_state_dict(state_dict()) (the full state dict, round trip)")
        if step.eval:
            extra.append("eval forward under no_grad")
        lines.append(f"  step {index}: micro-batches [{micro}]; " + "; ".join(extra))
    return "\n".join(lines)


def _block_text(block: Block) -> str:
    kind = block.kind
    if kind == "linear":
        text = f"Linear({block.width_in}, {block.width_out}, bias={block.bias})"
    elif kind == "layernorm":
        text = f"LayerNorm({block.width_in})"
    elif kind == "act":
        text = "Tanh()"
    elif kind == "embed":
        text = f"h + Embedding({block.vocab}, {block.width_in})(tokens % {block.vocab})"
    elif kind == "twice":
        text = (
            f"h + lin(tanh(lin(h))), lin = Linear({block.width_in}, {block.width_in})"
            "  # called twice"
        )
    else:
        text = (
            f"h + Linear({block.width_in}, {block.width_in})(h) if it % {block.period} == 0 "
            "else h  # unused in some forwards"
        )
    if block.tie:
        text += f"  # weight tied (tie {block.tie})"
    if block.frozen:
        text += "  # frozen"
    return text


def _final_width(seq: Seq, width: int) -> int:
    for node in seq.nodes:
        width = _final_width(node, width) if isinstance(node, Seq) else node.width_out
    return width


def final_width(model: ModelSpec) -> int:
    """The activation width after the body (the head's input width)."""
    return _final_width(model.body, model.width)
