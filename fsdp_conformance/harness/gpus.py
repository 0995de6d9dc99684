"""GPUs for rank sets: how many there are, and a cross-process pool so that no GPU serves two
tests at once: one ``flock``-ed lock file per GPU (a lock dies with its process, so a crashed
worker never strands a GPU), removed with its folder when released.
``FSDP_CONFORMANCE_FAKE_GPUS=N`` pretends N GPUs exist (the ranks then run gloo on CPU with
``dist.gpu_ids`` set).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import tempfile
import time
from typing import Any

from fsdp_conformance import constants

# Seconds between attempts to take GPUs that other workers hold.
POLL_S = 0.05


def fake_gpu_count() -> int | None:
    text = os.environ.get(constants.ENV_FAKE_GPUS, "").strip()
    return int(text) if text else None


def gpu_count() -> int:
    """GPUs visible to this process (the fake count when set); imports torch only on hosts
    with GPU device files."""
    if (fake := fake_gpu_count()) is not None:
        return fake
    devices = glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd")
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "" or not devices:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpus_needed(item: Any) -> int:
    """The GPUs a pytest item needs: ``gpus(n)`` markers n, ``cuda`` at least 1 (its ranks share
    one GPU where there are fewer GPUs than ranks)."""
    marker = item.get_closest_marker("gpus")
    needed = int(marker.args[0]) if marker is not None and marker.args else 0
    return max(needed, 1) if item.get_closest_marker("cuda") is not None else needed


def shortage(needed: int, available: int, where: str = "") -> str:
    """The skip reason of a test that needs more GPUs than are ``available``."""
    return f"needs {needed} GPU{'s' * (needed > 1)}, {available} available{where}"


def lock_dir_path() -> str:
    """Where the per-GPU lock files are (``FSDP_CONFORMANCE_GPU_LOCK_DIR``, else one folder in
    the temp directory per user)."""
    return os.environ.get(constants.ENV_GPU_LOCK_DIR) or os.path.join(
        tempfile.gettempdir(), f"fsdp-conformance-gpu-locks-{os.getuid()}"
    )


class GpuLease:
    """GPUs held by one test (``ids``, in rank order) through their open lock files."""

    def __init__(self, ids: tuple[int, ...], files: list) -> None:
        self.ids = ids
        self._files = files

    def release(self) -> None:
        """Unlock and remove the lock files, and their folder once empty: nothing is left."""
        for file in self._files:
            with contextlib.suppress(OSError):
                os.unlink(file.name)  # while locked: a waiter that opened it sees it unlinked
            file.close()
        if self._files:
            with contextlib.suppress(OSError):  # (not empty: other workers hold GPUs)
                os.rmdir(os.path.dirname(self._files[0].name))
        self._files = []


def _lock(path: str) -> Any:
    """The locked, still-linked lock file at ``path``, or None while another worker holds it."""
    try:
        file = open(path, "a")  # noqa: SIM115
    except FileNotFoundError:  # a releasing worker just removed the folder
        return None
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(file.fileno()).st_nlink == 0:
            raise OSError("unlinked by the worker that held it")
    except OSError:
        file.close()
        return None
    return file


def acquire_gpus(count: int, total: int, timeout: float, prefer: tuple[int, ...] = ()) -> GpuLease:
    """Take ``count`` of the ``total`` GPUs, all or none, ``prefer`` first (those a pooled
    rank set uses); :class:`TimeoutError` when they are not free within ``timeout`` seconds."""
    directory = lock_dir_path()
    order = list(dict.fromkeys([*prefer, *range(total)]))
    deadline = time.monotonic() + timeout
    while True:
        os.makedirs(directory, exist_ok=True)
        held: dict[int, Any] = {}  # GPU -> its locked file
        for gpu in order:
            if (file := _lock(os.path.join(directory, f"gpu{gpu}.lock"))) is not None:
                held[gpu] = file
                if len(held) == count:
                    return GpuLease(tuple(held), list(held.values()))
        # all or none: never hold some GPUs while waiting for more
        GpuLease((), list(held.values())).release()
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"could not get {count} of {total} GPUs within {timeout:g} s "
                f"(other pytest workers hold them; lock files in {directory})"
            )
        time.sleep(POLL_S)
