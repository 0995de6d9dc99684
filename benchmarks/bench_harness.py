"""Per-test overhead of the rank runtime, measured through pytest.

For each mode, run a generated file of 2 and of 2 + N two-rank tests in a fresh pytest
process and report the slope (T(2 + N) - T(2)) / N: what one more test costs once the
session is running (the constant start-up cost cancels). Two bodies: a trivial test
(`pass`) and a barrier + all-reduce test. For comparison, torch's ``MultiProcessTestCase``
(spawn per test), when importable.

    python benchmarks/bench_harness.py            # N = 20
    python benchmarks/bench_harness.py --tests 5  # quicker, noisier
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time

TRIVIAL = "def test_{i}(dist):\n    pass\n\n"
COLLECTIVE = (
    "def test_{i}(dist):\n"
    "    dist.barrier()\n"
    "    t = torch.ones(8)\n"
    "    torch.distributed.all_reduce(t)\n"
    "    assert t[0].item() == dist.world_size\n\n"
)
TORCH_MPTC_HEADER = """
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.common_utils import FILE_SCHEMA


class TestSpawnPerTest(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def init(self):
        dist.init_process_group(
            "gloo", init_method=f"{FILE_SCHEMA}{self.file_name}",
            world_size=self.world_size, rank=self.rank,
        )

"""
TORCH_MPTC_TRIVIAL = (
    "    def test_{i}(self):\n        self.init()\n        dist.destroy_process_group()\n\n"
)
TORCH_MPTC_COLLECTIVE = (
    "    def test_{i}(self):\n"
    "        self.init()\n"
    "        dist.barrier()\n"
    "        t = torch.ones(8)\n"
    "        dist.all_reduce(t)\n"
    "        assert t[0].item() == self.world_size\n"
    "        dist.destroy_process_group()\n\n"
)


# Records when each test finished, for the in-run slope.
STAMP_CONFTEST = """
import os
import time


def pytest_runtest_logfinish(nodeid, location):
    with open(os.environ["BENCH_STAMPS"], "a") as out:
        out.write(f"{time.perf_counter()}\\n")
"""


def write_file(directory: str, name: str, body: str, count: int, header: str) -> str:
    path = os.path.join(directory, f"test_{name}_{count}.py")
    with open(path, "w") as out:
        out.write(header)
        out.writelines(body.format(i=i) for i in range(count))
    return path


def time_pytest(path: str, extra: list[str]) -> tuple[float, list[float]]:
    """Wall time of one pytest run, and the times at which its tests finished."""
    stamps = path + ".stamps"
    if os.path.exists(stamps):
        os.remove(stamps)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path, *extra]
    start = time.perf_counter()
    proc = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "BENCH_STAMPS": stamps},
    )
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
        )
    with open(stamps) as lines:
        finished = [float(line) for line in lines]
    return elapsed, finished


def measure(
    directory: str, name: str, body: str, header: str, extra: list[str], n: int, repeat: int
) -> tuple[float, float, float]:
    """(T(2), slope (T(2 + n) - T(2)) / n, in-run slope).

    Each wall time is the minimum of ``repeat`` runs (other load on the machine only ever
    adds time). The in-run slope is (finish of the last test - finish of the second) / n in
    the 2 + n run (median over the runs): the same per-test cost without the start-up noise.
    """
    small_path = write_file(directory, name, body, 2, header)
    large_path = write_file(directory, name, body, 2 + n, header)
    small = min(time_pytest(small_path, extra)[0] for _ in range(repeat))
    large_runs = [time_pytest(large_path, extra) for _ in range(repeat)]
    large = min(elapsed for elapsed, _ in large_runs)
    in_run = sorted((stamps[-1] - stamps[1]) / n for _, stamps in large_runs)
    return small, (large - small) / n, in_run[len(in_run) // 2]


def torch_mptc_available() -> bool:
    try:
        import numpy  # noqa: F401  (torch.testing._internal needs it)
        from torch.testing._internal.common_distributed import MultiProcessTestCase  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=20, help="N extra tests for the slope")
    parser.add_argument(
        "--slow-tests",
        type=int,
        default=5,
        help="N for the spawn-per-test runners (process-fresh, MultiProcessTestCase)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per timing (minimum taken)")
    parser.add_argument("--skip-torch", action="store_true", help="leave out MultiProcessTestCase")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-harness-") as directory:
        with open(os.path.join(directory, "conftest.py"), "w") as conftest:
            conftest.write(STAMP_CONFTEST)
        for mode in ("process", "thread", "process-fresh"):
            extra = [f"--fsdp-mode={mode}"]
            fresh = mode == "process-fresh"
            n, repeat = (args.slow_tests, 1) if fresh else (args.tests, args.repeat)
            key = mode.replace("-", "_")
            trivial = measure(directory, f"trivial_{key}", TRIVIAL, "", extra, n, repeat)
            collective = measure(
                directory, f"coll_{key}", COLLECTIVE, "import torch\n\n", extra, n, repeat
            )
            rows.append((f"fsdp-conformance {mode}", n, trivial, collective))
            print(f"{rows[-1][0]:<40} done", file=sys.stderr)
        if not args.skip_torch and torch_mptc_available():
            n = args.slow_tests
            trivial = measure(
                directory, "mptc_trivial", TORCH_MPTC_TRIVIAL, TORCH_MPTC_HEADER, [], n, 1
            )
            collective = measure(
                directory, "mptc_coll", TORCH_MPTC_COLLECTIVE, TORCH_MPTC_HEADER, [], n, 1
            )
            rows.append(("torch MultiProcessTestCase (spawn/test)", n, trivial, collective))
    import torch

    print(
        f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}, "
        f"world size 2, min of {args.repeat} runs for the reused runners"
    )
    print(
        "| runner | N | T(2 tests) s | trivial: slope s/test | trivial: in-run s/test "
        "| barrier+all_reduce: slope s/test | barrier+all_reduce: in-run s/test |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, n, trivial, collective in rows:
        print(
            f"| {name} | {n} | {trivial[0]:.2f} | {trivial[1]:.3f} | {trivial[2]:.3f} "
            f"| {collective[1]:.3f} | {collective[2]:.3f} |"
        )
    load = os.getloadavg()
    print(f"load average during the run: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


if __name__ == "__main__":
    main()
