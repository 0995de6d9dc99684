"""Execution order of the instances under one root, and the prefetch targets it implies:
forward prefetch follows the first iteration's pre-forward order (static graph), backward
prefetch the reverse of this iteration's post-forward order."""

from __future__ import annotations

from typing import Any


class ExecOrder:
    def __init__(self) -> None:
        self.pre_forward_order: list[Any] = []
        self.post_forward_order: list[Any] = []
        self.is_first_iter = True  # until the first iteration's backward has finished

    def next_iter(self) -> None:
        self.post_forward_order = []

    def end_first_iter(self) -> None:
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
