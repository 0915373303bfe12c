"""Memory planning: how many bytes a case needs, checked against the device before allocating."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from .errors import MemoryPlanError

GIB = 1024 ** 3
# Part of the free memory a plan may use; the rest covers allocator slack and library workspaces.
USABLE_FRACTION = 0.92


# A backend plan's item for the layer's packed weights, on the device once the layer is built.
PARAMETERS = "parameters"


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

    def without(self, *names: str) -> "MemoryPlan":
        """A new plan without the named items."""
        return MemoryPlan({k: v for k, v in self.items.items() if k not in names})

    def plus(self, other: "MemoryPlan | None", prefix: str = "") -> "MemoryPlan":
        """A new plan with other's items added, their names prefixed (same names summed)."""
        items = dict(self.items)
        for key, value in ({} if other is None else other.items).items():
            name = prefix + key
            items[name] = items.get(name, 0) + int(value)
        return MemoryPlan(items)


def free_bytes(device: torch.device) -> int:
    """Bytes this process could still allocate on device (CUDA: driver free + cached-unused)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached)
    # MemAvailable counts reclaimable page cache too; free pages alone undercount.
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 1 << 62


def usable_bytes(device: torch.device) -> int:
    """The part of the device's free memory a plan may use."""
    return int(free_bytes(device) * USABLE_FRACTION)


def fits(plan: MemoryPlan, device: torch.device, reserve_bytes: int = 0) -> bool:
    """Whether plan fits the usable free memory beside reserve_bytes of other buffers."""
    return plan.total + reserve_bytes <= usable_bytes(device)


def check_fits(plan: MemoryPlan, device: torch.device, what: str = "case") -> None:
    """Raise MemoryPlanError if plan does not fit the device's free memory."""
    available = usable_bytes(device)
    if plan.total > available:
        raise MemoryPlanError(
            f"{what} needs {plan.total / GIB:.1f} GiB on {device} but only "
            f"{available / GIB:.1f} GiB is usable ({plan.describe()})"
        )


def sequences_per_chunk(per_sequence_bytes: int, fixed_bytes: int, batch_size: int,
                        device: torch.device, budget_bytes: int | None = None) -> int:
    """Largest number of sequences whose working set fits beside fixed_bytes (at least 1)."""
    if budget_bytes is None:
        budget_bytes = usable_bytes(device)
    room = budget_bytes - fixed_bytes
    if per_sequence_bytes <= 0:
        return max(batch_size, 1)
    return max(1, min(batch_size, room // per_sequence_bytes))
