"""What this machine can hold: the cap on ``fsdp-conformance run -n N``.

Each pytest-xdist worker runs its own rank processes (``world_size`` of them, each with
torch imported), so workers beyond the CPU count only queue, and workers beyond the memory
start swapping or get killed. The cap is the smaller of the CPU count and the available
memory divided by what one worker with its ranks takes.
"""

from __future__ import annotations

import os

# Memory budgeted for one pytest worker, and for one CPU rank process (torch and gloo
# imported, small models); the CLI's world-size limit budgets the same 512 MiB per rank.
WORKER_BYTES = 300 * 2**20
RANK_BYTES = 512 * 2**20


def available_memory() -> int | None:
    """Bytes of memory available to new processes (``MemAvailable``: free + reclaimable cache;
    else the free pages), None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # sysconf names missing on this platform
        return None


def cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def max_workers(world_size: int) -> tuple[int, str]:
    """The most xdist workers this machine holds for ``world_size``-rank tests, and why."""
    cpus = cpu_count()
    memory = available_memory()
    if memory is None:
        return cpus, f"{cpus} CPUs"
    per_worker = WORKER_BYTES + world_size * RANK_BYTES
    by_memory = max(1, memory // per_worker)
    reason = (
        f"{cpus} CPUs, {memory / 2**30:.1f} GiB available at "
        f"~{per_worker / 2**30:.1f} GiB per worker with {world_size} ranks"
    )
    return min(cpus, by_memory), reason


def check_workers(workers: int, world_size: int) -> None:
    """Raise ValueError (one line, naming the cap) when ``-n workers`` exceeds it."""
    cap, reason = max_workers(world_size)
    if workers > cap:
        raise ValueError(
            f"-n {workers}: this machine holds at most {cap} workers ({reason}); "
            f"give -n {cap} or less"
        )
