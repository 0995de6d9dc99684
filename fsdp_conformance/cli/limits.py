"""The cap on ``fsdp-conformance run -n N``: the smaller of the CPU count and the available
memory over what one xdist worker with its ``world_size`` rank processes takes.
"""

from __future__ import annotations

import contextlib
import os

# Memory budgeted for one pytest worker, and for one CPU rank process (torch and gloo, small
# models; also the CLI's world-size limit)
WORKER_BYTES = 300 * 2**20
RANK_BYTES = 512 * 2**20


def available_memory() -> int | None:
    """Bytes available to new processes (``MemAvailable``, else the free pages), or None."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def max_workers(world_size: int) -> tuple[int, str]:
    """The most xdist workers this machine holds for ``world_size``-rank tests, and why."""
    cpus = cpu_count()
    if (memory := available_memory()) is None:
        return cpus, f"{cpus} CPUs"
    per_worker = WORKER_BYTES + world_size * RANK_BYTES
    by_memory = max(1, memory // per_worker)
    reason = (
        f"{cpus} CPUs, {memory / 2**30:.1f} GiB available at "
        f"~{per_worker / 2**30:.1f} GiB per worker with {world_size} ranks"
    )
    return min(cpus, by_memory), reason


def check_workers(workers: int, world_size: int) -> None:
    """ValueError (one line, naming the cap) when ``-n workers`` exceeds it."""
    cap, reason = max_workers(world_size)
    if workers > cap:
        raise ValueError(
            f"-n {workers}: this machine holds at most {cap} workers ({reason}); "
            f"give -n {cap} or less"
        )
