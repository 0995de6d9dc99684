"""SIGINT / SIGTERM to the CLI's process alone: how long until it ends, what it leaves behind.

Each trial starts ``fsdp-conformance <command>`` in its own session with a private TMPDIR and
working directory, waits until its rank processes run, waits a random 0-2 s more (so the signal
lands anywhere in a check), sends the signal to the CLI's pid only, and records: seconds until
the CLI exited, its exit code, the processes of its group or descended from it still alive 1 s
after, and what is left in its TMPDIR and working directory. The promise (docs/cli.md, "Signals
and temp files"): exit within ``BOUND_S``, nothing left.

    python benchmarks/bench_signals.py                        # 20 trials each of INT and TERM on run
    python benchmarks/bench_signals.py --command fuzz --trials 5 --load 4

``--load N`` runs N busy-looping processes meanwhile (a loaded machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil

BOUND_S = 10.0  # the promise: the CLI ends within this many seconds of the signal
START_WAIT_S = 240.0  # how long a trial waits for the ranks to start (loaded host)
# the commands a trial runs: each keeps rank processes busy for minutes
COMMANDS = {
    "run": ["run", "-n", "0", "-k", "test_matches_ddp"],
    "fuzz": ["fuzz", "--examples", "100000", "--max-seconds", "600"],
    "overlap": ["overlap", "--repeats", "1000"],
}
RANK_MARK = "fsdp_conformance.harness.rank import main"  # a rank started as an interpreter
ZYGOTE_MARK = "fsdp_conformance.harness.zygote import"  # a zygote, and the ranks it forked


@dataclasses.dataclass
class Trial:
    """What one signal did."""

    signal: str  # "SIGINT" or "SIGTERM"
    seconds: float  # from the signal to the CLI's exit (inf: it did not exit)
    returncode: int | None  # the CLI's exit code
    processes: list[str]  # "pid cmdline" of processes still alive after the exit
    leftovers: list[str]  # entries left in its TMPDIR and working directory
    ranks_seen: int  # rank processes running when the signal was sent

    @property
    def clean(self) -> bool:
        return self.seconds <= BOUND_S and not self.processes and not self.leftovers


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _is_rank(process: psutil.Process) -> bool:
    try:
        command = " ".join(process.cmdline())
        parent = process.parent()
        forked = parent is not None and ZYGOTE_MARK in " ".join(parent.cmdline())
        return RANK_MARK in command or (forked and ZYGOTE_MARK in command)
    except psutil.Error:
        return False


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _group(pgid: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid:
                found.append(process)
        except (OSError, psutil.Error):
            continue
    return found


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_trial(
    command: str,
    signum: int,
    workdir: str,
    delay_s: float | None = None,
    sigint_ignored: bool = False,
) -> Trial:
    """One trial of ``command`` (a key of ``COMMANDS``) interrupted by ``signum``, in
    ``workdir`` (its TMPDIR is ``workdir/tmp``, its cache ``workdir/cache``); with
    ``sigint_ignored`` the CLI starts with SIGINT ignored, as a shell's background job does."""
    cwd, tmp = os.path.join(workdir, "cwd"), os.path.join(workdir, "tmp")
    os.makedirs(cwd)
    os.makedirs(tmp)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(TMPDIR=tmp, XDG_CACHE_HOME=os.path.join(workdir, "cache"))
    cli = subprocess.Popen(
        [sys.executable, "-m", "fsdp_conformance.cli", *COMMANDS[command]],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_ignore_sigint if sigint_ignored else None,  # noqa: PLW1509
    )
    seen: dict[int, psutil.Process] = {}
    try:
        deadline = time.monotonic() + START_WAIT_S
        ranks: list[psutil.Process] = []
        while time.monotonic() < deadline and cli.poll() is None:
            ranks = [p for p in _descendants(cli.pid) if _is_rank(p)]
            if len(ranks) >= 2:
                break
            time.sleep(0.2)
        if len(ranks) < 2:
            raise RuntimeError(f"{command}: no ranks started within {START_WAIT_S:g} s")
        time.sleep(random.uniform(0.0, 2.0) if delay_s is None else delay_s)
        seen = {p.pid: p for p in _descendants(cli.pid)}
        sent = time.monotonic()
        os.kill(cli.pid, signum)
        try:
            cli.wait(timeout=BOUND_S * 3)
            seconds = time.monotonic() - sent
        except subprocess.TimeoutExpired:
            seconds = float("inf")
        # the promise is the whole run gone within the bound: wait for stragglers until then
        # (at least 1 s after the exit, so a process that would linger is seen)
        settled = time.monotonic() + 1.0
        deadline = max(sent + BOUND_S, settled)
        while True:
            time.sleep(0.2)
            for process in [*_descendants(cli.pid), *_group(cli.pid)]:
                seen.setdefault(process.pid, process)
            now = time.monotonic()
            if now >= deadline or (now >= settled and not any(map(_alive, seen.values()))):
                break
        left = []
        for process in seen.values():
            if _alive(process):
                try:
                    left.append(f"{process.pid} {' '.join(process.cmdline())[:120]}")
                except psutil.Error:
                    continue
        leftovers = [os.path.join("tmp", name) for name in sorted(os.listdir(tmp))]
        leftovers += [os.path.join("cwd", name) for name in sorted(os.listdir(cwd))]
        return Trial(signal.Signals(signum).name, seconds, cli.poll(), left, leftovers, len(ranks))
    finally:
        for process in [psutil.Process(cli.pid)] if cli.poll() is None else []:
            process.kill()
        for process in seen.values():
            if _alive(process):
                process.kill()
        cli.wait()


def _burn() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--command", choices=sorted(COMMANDS), default="run")
    parser.add_argument("--trials", type=int, default=20, help="per signal (default 20)")
    parser.add_argument("--signals", default="INT,TERM", help="comma-separated (default INT,TERM)")
    parser.add_argument("--load", type=int, default=0, help="busy-looping processes meanwhile")
    parser.add_argument(
        "--sigint-ignored",
        action="store_true",
        help="start the CLI with SIGINT ignored (a shell's background job)",
    )
    args = parser.parse_args()
    signums = [signal.Signals["SIG" + name.strip().upper()] for name in args.signals.split(",")]
    if args.trials < 1 or args.load < 0:
        parser.error("--trials >= 1, --load >= 0")
    print(
        f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
        f"{platform.machine()} {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
        f"command {args.command!r}, {args.trials} trials per signal, --load {args.load}",
        flush=True,
    )
    burners = [_burn() for _ in range(args.load)]
    results: list[Trial] = []
    try:
        for index in range(args.trials):
            for signum in signums:
                root = tempfile.mkdtemp(prefix="bench-signals-")
                try:
                    trial = run_trial(
                        args.command, signum, root, sigint_ignored=args.sigint_ignored
                    )
                finally:
                    shutil.rmtree(root, ignore_errors=True)
                results.append(trial)
                print(
                    f"{index + 1:3d} {trial.signal:8s} {trial.seconds:6.2f} s  exit "
                    f"{trial.returncode}  ranks {trial.ranks_seen}  processes left "
                    f"{len(trial.processes)}  files left {trial.leftovers or 0}"
                    + ("" if trial.clean else "  <-- " + "; ".join(trial.processes)),
                    flush=True,
                )
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    for name in sorted({trial.signal for trial in results}):
        mine = [trial for trial in results if trial.signal == name]
        times = sorted(trial.seconds for trial in mine)
        print(
            f"{name}: {sum(t.clean for t in mine)}/{len(mine)} clean; seconds to exit median "
            f"{times[len(times) // 2]:.2f}, max {times[-1]:.2f} (bound {BOUND_S:g}); "
            f"load average now {os.getloadavg()[0]:.1f}"
        )


if __name__ == "__main__":
    main()
