"""Memory planning: how many bytes a case needs, checked against the device before allocating."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .errors import MemoryPlanError

GIB = 1024 ** 3
# Part of the free memory a plan may use; the rest covers allocator slack and library workspaces.
USABLE_FRACTION = 0.92


@dataclass
class MemoryPlan:
    """Named byte counts that a forward allocates on its device."""

    items: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Sum of all items, in bytes."""
        return int(sum(self.items.values()))

    def describe(self) -> str:
        """Human-readable breakdown, largest first."""
        parts = sorted(self.items.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in parts)


def free_bytes(device: torch.device) -> int:
    """Bytes this process could still allocate on device (CUDA: driver free + cached-unused)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62


def check_fits(plan: MemoryPlan, device: torch.device, what: str = "case") -> None:
    """Raise MemoryPlanError if plan does not fit the device's free memory."""
    available = int(free_bytes(device) * USABLE_FRACTION)
    if plan.total > available:
        raise MemoryPlanError(
            f"{what} needs {plan.total / GIB:.1f} GiB on {device} but only "
            f"{available / GIB:.1f} GiB is usable ({plan.describe()})"
        )


def sequences_per_chunk(per_sequence_bytes: int, fixed_bytes: int, batch_size: int,
                        device: torch.device, budget_bytes: int | None = None) -> int:
    """Largest number of sequences whose working set fits beside fixed_bytes (at least 1)."""
    if budget_bytes is None:
        budget_bytes = int(free_bytes(device) * USABLE_FRACTION)
    room = budget_bytes - fixed_bytes
    if per_sequence_bytes <= 0:
        return max(batch_size, 1)
    return max(1, min(batch_size, room // per_sequence_bytes))
