"""Execution order of the instances under one root, and the prefetch targets it implies.

Forward prefetch follows the pre-forward order recorded on the first iteration (static
graph); backward prefetch follows the reverse of this iteration's post-forward order,
which is the order the pre-backward hooks fire in.
"""

from __future__ import annotations

from typing import Any


class ExecOrder:
    """Recorded orders of one root's FSDP instances."""

    def __init__(self) -> None:
        # instances in the order their pre-forward ran on the first iteration
        self.pre_forward_order: list[Any] = []
        # instances in the order their post-forward ran on the current iteration
        self.post_forward_order: list[Any] = []
        # True until the first iteration's backward has finished
        self.is_first_iter = True

    def next_iter(self) -> None:
        """Start a new iteration (called in the root's pre-forward)."""
        self.post_forward_order = []

    def end_first_iter(self) -> None:
        """Freeze the pre-forward order (called at the end of backward)."""
        self.is_first_iter = False

    def record_pre_forward(self, instance: Any) -> None:
        if self.is_first_iter and instance not in self.pre_forward_order:
            self.pre_forward_order.append(instance)

    def record_post_forward(self, instance: Any) -> None:
        if instance not in self.post_forward_order:
            self.post_forward_order.append(instance)

    def forward_prefetch_target(self, instance: Any) -> Any | None:
        """The instance that runs forward after ``instance`` (None on the first iteration)."""
        if self.is_first_iter or instance not in self.pre_forward_order:
            return None
        index = self.pre_forward_order.index(instance) + 1
        return self.pre_forward_order[index] if index < len(self.pre_forward_order) else None

    def backward_prefetch_target(self, instance: Any) -> Any | None:
        """The instance whose backward runs after ``instance``'s."""
        if instance not in self.post_forward_order:
            return None
        index = self.post_forward_order.index(instance) - 1
        return self.post_forward_order[index] if index >= 0 else None
