"""The names shared by the CLI, the pytest plugin, the rank runtime, the suite and impl.

Each name is defined here once and imported everywhere else, so that a mode, a coverage, an
operation, an environment variable or the limiter's depth cannot drift between the modules that
use it. Import-light: no torch, no other module of the package.
"""

from __future__ import annotations

import enum

# How the ranks of a test run (``--fsdp-mode``): "process" reuses one rank-process set per
# world size, "process-fresh" starts a new set for every test, "thread" runs ranks as threads
MODES = ("process", "process-fresh", "thread")
DEFAULT_MODE = "process"
# Seconds a test may run in its ranks before it is failed with every rank's stack
# (``--fsdp-timeout``, ``FSDP_CONFORMANCE_TIMEOUT``)
DEFAULT_TIMEOUT_S = 120.0

# The adapters known by name (``--fsdp-impl``, ``--impl``); ``adapters/registry.py`` maps each
# to its class
BUILTIN_ADAPTERS = ("impl", "torch-fsdp1", "torch-fsdp2", "fairscale", "deepspeed")

# How much of a suite check's config product runs (``--fsdp-coverage``); the suite's configs
# module implements them
COVERAGES = ("full", "pairwise")

# Environment variables read where the option enters (plugin, CLI, rank runtime)
ENV_MODE = "FSDP_CONFORMANCE_MODE"
ENV_TIMEOUT = "FSDP_CONFORMANCE_TIMEOUT"
ENV_BACKEND = "FSDP_CONFORMANCE_BACKEND"
# pretend this many GPUs exist (the GPU pool logic then runs on a CPU host)
ENV_FAKE_GPUS = "FSDP_CONFORMANCE_FAKE_GPUS"
# folder of the cross-process GPU lock files
ENV_GPU_LOCK_DIR = "FSDP_CONFORMANCE_GPU_LOCK_DIR"
# file the CLI's collector plugin appends one JSON line per test to
ENV_CLI_RESULTS = "FSDP_CONFORMANCE_CLI_RESULTS"
# "1": the prefetch-order golden check writes the goldens instead of comparing
# (``--fsdp-accept-goldens`` sets it for the session)
ENV_ACCEPT_GOLDENS = "FSDP_CONFORMANCE_ACCEPT_GOLDENS"
# ``--fsdp-launcher``: whether tests run in place in the processes of an external launcher
# (torchrun) instead of in ranks the plugin spawns
ENV_LAUNCHER = "FSDP_CONFORMANCE_LAUNCHER"
# "1" lifts the upper end of the built-in adapters' tested version ranges
ENV_UNTESTED_VERSIONS = "FSDP_CONFORMANCE_UNTESTED_VERSIONS"
LAUNCHERS = ("auto", "torchrun", "none")

# auto_wrap_policy value of the adapter vocabulary: wrap every submodule (always_wrap_policy)
ALWAYS_WRAP = "always"

# Profiler range around the rate limiter's wait (the name torch FSDP1 uses, so that traces of
# the two implementations read alike)
RATE_LIMITER_RANGE = "FullyShardedDataParallel.rate_limiter"

# All-gathered buffers the rate limiter lets be resident: the instance computing now and the
# one whose all-gather is in flight (torch FSDP1's empirically chosen depth); an early forward
# prefetch may add one
MAX_INFLIGHT = 2


class Op(str, enum.Enum):
    """An operation an FSDP instance reports in a trace (compares equal to its string value).

    ``str()`` and format give the bare value (``"all_gather"``), so messages and goldens that
    print an op read the same whether it came as a member or as a string.
    """

    # issue of an unshard (all-gather of the sharded parameters)
    ALL_GATHER = "all_gather"
    # wait for an issued all-gather to complete
    ALL_GATHER_WAIT = "all_gather_wait"
    # the unsharded parameters are about to be freed
    FREE = "free"
    # a buffer allocated outside an all-gather (e.g. FSDP2's unsharded parameters, filled by the
    # all-gather's copy-out); residency counts it like an all-gathered buffer
    ALLOC = "alloc"
    # gradient reduction of a sharded strategy
    REDUCE_SCATTER = "reduce_scatter"
    # gradient reduction of an unsharded strategy
    ALL_REDUCE = "all_reduce"
    # the rate limiter waits for an older free to complete
    RATE_LIMITER_WAIT = "rate_limiter_wait"
    # an instance issues the next instance's all-gather ahead of its use (info: the target
    # instance and the direction, "forward", "backward_pre" or "backward_post")
    PREFETCH = "prefetch"
    # a module's forward or backward computation (observers record it beside the collectives)
    COMPUTE = "compute"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


# the ops that reduce gradients
REDUCE_OPS = (Op.REDUCE_SCATTER, Op.ALL_REDUCE)
# the ops a communication trace records
COMM_OPS = (Op.ALL_GATHER, Op.FREE, Op.REDUCE_SCATTER, Op.ALL_REDUCE)


# The collective functions of torch.distributed (every rank of the group takes part; point-to-point
# send / recv are not recorded: ranks need not make the same number of them).
TORCH_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
)
