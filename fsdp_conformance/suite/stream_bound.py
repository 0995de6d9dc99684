"""The memory bound of a stream-ordered FSDP (torch FSDP2), derived from its algorithm.

[Note: stream-ordered bound]
torch FSDP2 bounds memory by stream order, not by blocking the CPU. Per unshard it holds the
all-gather output and the unsharded parameters copied out of it ([Note: FSDP2 buffers]).
Forward holds the current output, the previous one (kept for the copy-in overlap until
``wait_for_unshard`` returns) and the unsharded parameters: 3; backward drops each output after
its copy-out: 2. Measured tables: docs/memory_bound.md."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StreamOrderedBound:
    """Resident non-root buffers allowed per phase: all-gather outputs in flight + unsharded."""

    forward_outputs: int = 2
    backward_outputs: int = 1
    unsharded: int = 1
    name: str = "stream-ordered bound"  # in failure messages

    def _outputs(self, phase: str) -> int:
        return self.forward_outputs if phase == "forward" else self.backward_outputs

    def bound(self, phase: str) -> int:
        return self._outputs(phase) + self.unsharded

    def explain(self, phase: str) -> str:
        return (
            f"{self.name}: {self._outputs(phase)} all-gather outputs in flight + "
            f"{self.unsharded} unsharded"
        )

    def shard_grad_op_forward(self, layers: int) -> int:
        """The most non-root buffers iteration 1's forward may hold without reshard after
        forward: every unsharded set kept + the outputs in flight."""
        return layers + self.forward_outputs


FSDP2_BOUND = StreamOrderedBound(name="torch FSDP2's stream-ordered bound")
