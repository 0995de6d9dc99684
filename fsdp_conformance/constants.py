"""The names shared by the CLI, the plugin, the harness, the suite and impl, defined once so
that they cannot drift apart. Import-light: no torch, no other module of the package.
"""

from __future__ import annotations

import enum

# How the ranks of a test run (``--fsdp-mode``)
MODES = ("process", "process-fresh", "thread")
DEFAULT_MODE = "process"
DEFAULT_TIMEOUT_S = 120.0

# The adapters known by name (``--fsdp-impl``, ``--impl``)
BUILTIN_ADAPTERS = ("impl", "torch-fsdp1", "torch-fsdp2", "fairscale", "deepspeed")

# How much of a suite check's config product runs (``--fsdp-coverage``)
COVERAGES = ("full", "pairwise")

# Environment variables
ENV_MODE = "FSDP_CONFORMANCE_MODE"
ENV_TIMEOUT = "FSDP_CONFORMANCE_TIMEOUT"
ENV_BACKEND = "FSDP_CONFORMANCE_BACKEND"
ENV_FAKE_GPUS = "FSDP_CONFORMANCE_FAKE_GPUS"  # pretend this many GPUs exist
ENV_GPU_LOCK_DIR = "FSDP_CONFORMANCE_GPU_LOCK_DIR"  # folder of the GPU lock files
ENV_CLI_RESULTS = "FSDP_CONFORMANCE_CLI_RESULTS"  # the CLI's records file
ENV_CLI_RERUN = "FSDP_CONFORMANCE_CLI_RERUN"  # `fsdp-conformance run` line a cell's re-run extends
# "1": the prefetch-order golden check writes the goldens instead of comparing
ENV_ACCEPT_GOLDENS = "FSDP_CONFORMANCE_ACCEPT_GOLDENS"
ENV_LAUNCHER = "FSDP_CONFORMANCE_LAUNCHER"  # ``--fsdp-launcher``
# "1" lifts the upper end of the built-in adapters' tested version ranges
ENV_UNTESTED_VERSIONS = "FSDP_CONFORMANCE_UNTESTED_VERSIONS"
LAUNCHERS = ("auto", "torchrun", "none")

# auto_wrap_policy value of the adapter vocabulary: wrap every submodule (always_wrap_policy)
ALWAYS_WRAP = "always"

# Profiler range around the rate limiter's wait (torch FSDP1's name: traces read alike)
RATE_LIMITER_RANGE = "FullyShardedDataParallel.rate_limiter"

# All-gathered buffers the rate limiter lets be resident: the instance computing now and the
# one whose all-gather is in flight (torch FSDP1's empirically chosen depth); an early forward
# prefetch may add one
MAX_INFLIGHT = 2


class Op(str, enum.Enum):
    """An operation an FSDP instance reports in a trace. It equals, prints and formats as its
    bare string value, so messages and goldens read the same for a member or a string."""

    ALL_GATHER = "all_gather"  # issue of an unshard
    ALL_GATHER_WAIT = "all_gather_wait"
    FREE = "free"  # the unsharded parameters are about to be freed
    # a buffer allocated outside an all-gather (e.g. FSDP2's unsharded parameters, filled by the
    # all-gather's copy-out); residency counts it like an all-gathered buffer
    ALLOC = "alloc"
    REDUCE_SCATTER = "reduce_scatter"  # gradient reduction of a sharded strategy
    ALL_REDUCE = "all_reduce"  # gradient reduction of an unsharded strategy
    RATE_LIMITER_WAIT = "rate_limiter_wait"  # the limiter waits for an older free
    # an all-gather issued ahead of its use (info: the target instance and the direction,
    # "forward", "backward_pre" or "backward_post")
    PREFETCH = "prefetch"
    COMPUTE = "compute"  # a module's forward or backward computation

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


REDUCE_OPS = (Op.REDUCE_SCATTER, Op.ALL_REDUCE)
COMM_OPS = (Op.ALL_GATHER, Op.FREE, Op.REDUCE_SCATTER, Op.ALL_REDUCE)  # what a comm trace records
