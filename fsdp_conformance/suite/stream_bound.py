"""The memory bound of a stream-ordered FSDP (torch FSDP2), derived from its algorithm.

[Note: stream-ordered bound]
torch FSDP2 (2.8.0 to 2.15.0) never blocks the CPU to bound memory; it bounds it by stream order. Per
unshard it holds two buffers of one instance's unsharded size: the all-gather output and the
unsharded parameters copied out of it ([Note: FSDP2 buffers] in
``fsdp_conformance/adapters/_fsdp2_device.py``). A freed block counts as resident until a
caching allocator could reuse it ([Note: stream-ordered reuse]). Non-root buffers, per phase:

- forward: the all-gather output of the instance being unsharded, the previous instance's
  output (kept so that this copy-in does not overwrite memory the previous all-gather still
  uses -- ``[Note: Overlapping all-gather copy-in and all-gather]`` -- and dropped only when
  ``wait_for_unshard`` returns, after the copy-out of the current one, because a local variable
  holds it until then), and the current instance's unsharded parameters (the previous
  instance's were freed at its post-forward reshard, on the current stream, so at once):
  **2 outputs in flight + 1 unsharded = 3**. With explicit forward prefetch the next output is
  issued once the previous one is dropped: still 3.
- backward: the all-gather output is dropped at the end of each copy-out (no deferral outside
  forward), after the all-gather streams waited on the copy-out event; the next instance is
  prefetched while the current one's unsharded parameters compute: **1 output in flight + 1
  unsharded = 2**, whatever the explicit prefetch lists name (one target at a time).

Measured (docs/memory_bound.md): forward 3 and backward 2 in every iteration, under both lag
variants and every prefetch mapping. torch 2.15 drops the previous output before the copy-out
(``release_all_gather_state_for_comm_reuse``): a forward without explicit prefetch then holds 2,
within the bound (``_fsdp2_internals.releases_previous_output_before_copy_out`` detects it).
``reshard_after_forward=False`` (SHARD_GRAD_OP) keeps all unsharded parameters through forward:
forward is exempt, as for the other implementations, and its first forward holds ``layers``
unsharded buffers plus at most ``forward_outputs`` outputs in flight
(``memory_bound.check_shard_grad_op_forward`` checks both bounds).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StreamOrderedBound:
    """Resident non-root buffers allowed per phase: all-gather outputs in flight + unsharded."""

    # all-gather outputs in flight in forward (the current + the previous, kept for overlap)
    forward_outputs: int = 2
    # all-gather outputs in flight in backward
    backward_outputs: int = 1
    # unsharded parameter sets resident (the instance computing)
    unsharded: int = 1
    # how the bound is named in failure messages
    name: str = "stream-ordered bound"

    def bound(self, phase: str) -> int:
        """The most non-root buffers allowed resident in ``phase`` ("forward" / "backward")."""
        outputs = self.forward_outputs if phase == "forward" else self.backward_outputs
        return outputs + self.unsharded

    def explain(self, phase: str) -> str:
        outputs = self.forward_outputs if phase == "forward" else self.backward_outputs
        return f"{self.name}: {outputs} all-gather outputs in flight + {self.unsharded} unsharded"

    def shard_grad_op_forward(self, layers: int) -> int:
        """Iteration 1 forward peak without reshard after forward: every unsharded set kept."""
        return layers + self.forward_outputs


# torch FSDP2 2.13.0 (see [Note: stream-ordered bound])
FSDP2_BOUND = StreamOrderedBound(name="torch FSDP2's stream-ordered bound")
