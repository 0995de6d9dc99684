"""Generate docs/compatibility.md: `fsdp-conformance run` per torch release x built-in adapter.

For each torch release it builds (or reuses) a virtual environment with that torch, the test
requirements and fairscale 0.4.13, installs this checkout into it editable *without
dependencies* (so pip never swaps the torch), asks every built-in adapter for its
``support_problem()`` there, runs ``fsdp-conformance run --impl <adapter> --json ...`` and
records the counts, the first failure and the wall time. Results are kept per (release,
adapter) as JSON under ``--results``, so releases can be run one at a time and the document
re-rendered from all of them (``--render-only``).

    python benchmarks/compat_matrix.py --torch 2.8.0 2.13.0 2.14.1 2.15.0 \\
        --venvs ~/.cache/fsdp-compat --reuse 2.13.0=/path/to/venv -n 2

A pip configuration that caps torch (as on the project VM) is bypassed for the torch install
with ``--no-pip-config`` (``PIP_CONFIG_FILE=/dev/null`` for that one command). CUDA wheels run on
a CPU-only host (every check here runs on CPU with gloo).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
ADAPTERS = ("impl", "torch-fsdp1", "torch-fsdp2", "fairscale", "deepspeed")
TEST_REQUIREMENTS = (
    "pytest>=8,<10",
    "pytest-xdist>=3.5",
    "psutil",
    "matplotlib",
    "hypothesis",
    "fairscale==0.4.13",
    "deepspeed==0.19.8",
)
OUTCOME_ORDER = ("pass", "fail", "xfail", "xpass", "skip", "error")

PROBE = """
import json, sys, torch
from fsdp_conformance.adapters import get_adapter
out = {"torch": torch.__version__, "problems": {}}
for name in sys.argv[1:]:
    try:
        out["problems"][name] = get_adapter(name).support_problem()
    except Exception as error:  # an adapter that cannot even be resolved
        out["problems"][name] = f"cannot resolve: {type(error).__name__}: {error}"
print(json.dumps(out))
"""


def _pip(venv: pathlib.Path, *args: str, no_config: bool = False) -> None:
    env = dict(os.environ, DS_BUILD_OPS="0")  # deepspeed installs without building its ops
    if no_config:
        env["PIP_CONFIG_FILE"] = os.devnull
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args],
                   check=True, env=env)


def ensure_venv(version: str, venvs: pathlib.Path, reuse: dict[str, str],
                no_pip_config: bool) -> pathlib.Path:
    """The venv for ``version``: reused, or built (torch first, then the rest without it)."""
    venv = pathlib.Path(reuse[version]) if version in reuse else venvs / f"torch-{version}"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        _pip(venv, f"torch=={version}", no_config=no_pip_config)
        # with the torch pinned in the same command, fairscale's torch requirement is met
        _pip(venv, f"torch=={version}", *TEST_REQUIREMENTS, no_config=no_pip_config)
    _pip(venv, "--no-deps", "-e", str(ROOT))
    return venv


def probe(venv: pathlib.Path) -> dict:
    result = subprocess.run([str(venv / "bin" / "python"), "-c", PROBE, *ADAPTERS],
                            check=True, capture_output=True, text=True, timeout=600)
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_adapter(venv: pathlib.Path, adapter: str, workers: int, out: pathlib.Path) -> dict:
    matrix = out.with_suffix(".matrix.json")
    command = [str(venv / "bin" / "fsdp-conformance"), "run", "--impl", adapter,
               "-n", str(workers), "--json", str(matrix)]
    start = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - start
    record = {"adapter": adapter, "exit": result.returncode, "wall_s": round(wall),
              "workers": workers,
              "command": " ".join(["fsdp-conformance", *command[1:-2]])}
    if matrix.exists():
        document = json.loads(matrix.read_text())
        record["summary"] = document.get("summary", {})
        cells = document.get("cells", [])
        failures = [cell for cell in cells if cell["outcome"] in ("fail", "error")]
        skips = [cell for cell in document.get("cells", []) if cell["outcome"] == "skip"]
        if failures:
            first = failures[0]
            record["first_failure"] = f"{first['check']}[{first['configuration']}]: " + (
                first["detail"].splitlines() or [""])[0][:300]
        record.update(_skip_summary(cells))
    else:
        record["output_tail"] = (result.stdout + result.stderr)[-2000:]
    return record


def _skip_summary(cells: list[dict]) -> dict:
    """``{"all_skipped": "<n> x <most common reason>"}`` when every cell skipped, else {}."""
    skips = [cell["detail"] for cell in cells if cell["outcome"] == "skip"]
    if not skips or len(skips) != len(cells):
        return {}
    reason, count = max(((r, skips.count(r)) for r in set(skips)), key=lambda item: item[1])
    return {"all_skipped": f"{count} of {len(cells)} with: {reason}"}


def _counts(record: dict) -> str:
    summary = record.get("summary")
    if summary is None:
        return f"no matrix (exit {record['exit']})"
    parts = [f"{summary[key]} {key}" for key in OUTCOME_ORDER if summary.get(key)]
    parts += [f"{value} {key}" for key, value in summary.items()
              if key not in OUTCOME_ORDER and value and key != "total"]
    return ", ".join(parts) or "nothing ran"


INTRO = """# Compatibility: torch releases x built-in adapters

Generated by `benchmarks/compat_matrix.py` (never edited by hand); CI runs torch 2.13.0 (CPU
build). Each cell is `fsdp-conformance run --impl <adapter> -n <workers>` on that torch, in its
own virtual environment with this checkout installed editable without dependencies: exit code,
the matrix's counts, the wall time and workers, and the first failure if any. CUDA wheels run
on a CPU-only host (gloo): the checks that need a GPU skip, saying so.

## Declared support ranges

| adapter | torch | other | torch internals, verified on the tested releases |
|---|---|---|---|
| `impl` | >=2.8.0, <2.16 | | none (public torch API) |
| `torch-fsdp1` | >=2.8.0, <2.16 | | `adapters/_fsdp1_internals.py` |
| `torch-fsdp2` | >=2.13.0, <2.16 | | `adapters/_fsdp2_internals.py` |
| `fairscale` | >=2.8.0, <2.16 | fairscale 0.4.13 | `adapters/_fairscale_device.py` |
| `deepspeed` | >=2.13.0, <2.15 | deepspeed >=0.19.0, <0.20 (0.19.8 tested) | none (its own patch points: `written_for="deepspeed 0.19.8"`) |

Tested releases: torch 2.8.0, 2.13.0, 2.14.1, 2.15.0. torch-fsdp2 starts at 2.13.0, the first
release tested whose `fully_shard` the adapter drives correctly on CPU. On 2.8.0 the adapter
does drive it (2.8 keeps one parameter group per state, `_fsdp_param_group`, 2.13 on a list,
`_fsdp_param_groups`: both are detected), but
FSDP2 2.8 itself takes twice DDP's gradient steps at world size 2 on CPU (consistent with its
fp32 reduce-scatter using `ReduceOp.AVG`, which gloo appears to sum): every parity
check with DDP fails (losses e.g. FSDP -3.86 vs DDP -1.53 at step
2), and a one-rank mesh fails with "Could not resolve the process group registered under the
name 1". That run, before the range was declared (2026-11-23, -n 2, 2195 s): exit 1, 137 pass,
90 fail (86 `test_matches_ddp`, 4 `test_mixed_precision_matches_fp32_ddp`), 4 xfail, 12 skip.
With the declared range every torch-fsdp2 cell on 2.8 skips with the version line (the table).
Releases 2.9 to 2.12 were not run.

The ranges live in `fsdp_conformance/adapters/_support.py` (`Adapter.support_problem()`); on a
torch outside its range every cell of that adapter skips with one line naming the installed
and the supported versions. The upper end is the newest minor release tested;
`FSDP_CONFORMANCE_UNTESTED_VERSIONS=1` lifts it (never the lower end) to try a newer torch --
a moved torch internal then fails with one error naming it and the releases verified.
Releases older than 2.8.0 were not run (the oldest release declared is the oldest tested).
torch 2.13.0 (CPU build) is CI's release: the project's tests and `docs/conformance.md` (every
check x implementation, `fsdp-conformance conformance`) run on it; a cell "not run" below was
not reached by this matrix in its time budget.
"""


def render(results: list[dict], workers: int, requested: tuple[str, ...] = ()) -> str:
    versions = sorted({r["torch_requested"] for r in results} | set(requested),
                      key=lambda v: tuple(int(x) for x in v.split(".")[:3]))
    lines = [INTRO, "## The matrix", ""]
    header = "| torch | " + " | ".join(f"`{a}`" for a in ADAPTERS) + " |"
    lines += [header, "|---|" + "---|" * len(ADAPTERS)]
    notes = []
    for version in versions:
        row = [f"{version}"]
        for adapter in ADAPTERS:
            match = [
                r for r in results if r["torch_requested"] == version and r["adapter"] == adapter
            ]
            if not match:
                row.append("not run")
                continue
            record = match[0]
            workers = record.get("workers", "?")
            wall = f"{record['wall_s']} s, -n {workers}"
            text = f"exit {record['exit']}: {_counts(record)} ({wall})"
            if record.get("all_skipped"):
                text += " -- every cell skipped: " + record["all_skipped"]
            if record.get("first_failure"):
                notes.append(f"- torch {version}, `{adapter}`: first failure "
                             f"`{record['first_failure']}`")
            row.append(text)
        lines.append("| " + " | ".join(row).replace("\n", " ") + " |")
    lines += ["", "Installed builds: " + ", ".join(
        sorted({f"{r['torch_requested']} = `{r['torch_installed']}`" for r in results})) + "."]
    lines += ["", "## First failures", ""] + (notes or ["None."])
    dates = sorted({r["date"] for r in results})
    machines = sorted({r["machine"] for r in results})
    commits = sorted({r.get("commit", "?") for r in results})
    lines += ["", "## Where and when", "",
              f"Run between {dates[0]} and {dates[-1]} UTC; machine: {'; '.join(machines)}; checkout "
              f"{', '.join(commits)}. Wall times are of a shared machine (other jobs ran on the "
              "same cores): upper bounds.", ""]
    return "\n".join(lines)


def _commit() -> str:
    if os.environ.get("COMPAT_COMMIT"):  # the checkout was copied out of its repository
        return os.environ["COMPAT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("COMPAT_COMMIT", "?")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", nargs="+", default=["2.8.0", "2.13.0", "2.14.1", "2.15.0"])
    parser.add_argument("--adapters", nargs="+", default=list(ADAPTERS), choices=ADAPTERS)
    parser.add_argument("--venvs", type=pathlib.Path,
                        default=pathlib.Path.home() / ".cache" / "fsdp-conformance-compat")
    parser.add_argument("--reuse", action="append", default=[], metavar="VERSION=VENV")
    parser.add_argument("--results", type=pathlib.Path, default=ROOT / "build" / "compat")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "compatibility.md")
    parser.add_argument("-n", type=int, default=2, dest="workers")
    parser.add_argument("--no-pip-config", action="store_true",
                        help="PIP_CONFIG_FILE=/dev/null for the installs (lifts a torch cap)")
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args(argv)
    reuse = dict(item.split("=", 1) for item in args.reuse)
    args.results.mkdir(parents=True, exist_ok=True)
    if not args.render_only:
        for version in args.torch:
            venv = ensure_venv(version, args.venvs, reuse, args.no_pip_config)
            probed = probe(venv)
            for adapter in args.adapters:
                out = args.results / f"{version}-{adapter}.json"
                print(f"torch {version}: {adapter} ...", flush=True)
                record = run_adapter(venv, adapter, args.workers, out)
                record.update(
                    torch_requested=version,
                    torch_installed=probed["torch"],
                    support_problem=probed["problems"].get(adapter),
                    date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
                    machine=f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
                    f"{platform.python_version()}",
                    commit=_commit(),
                )
                out.write_text(json.dumps(record, indent=2))
                print(f"  exit {record['exit']}, {_counts(record)}, {record['wall_s']} s",
                      flush=True)
    results = []
    for path in sorted(args.results.glob("*-*.json")):
        if path.name.endswith(".matrix.json"):
            continue
        record = json.loads(path.read_text())
        matrix = path.with_suffix(".matrix.json")
        if matrix.exists():  # recomputed: the skip summary of older records
            record.pop("all_skipped", None)
            record.update(_skip_summary(json.loads(matrix.read_text()).get("cells", [])))
        results.append(record)
    args.out.write_text(render(results, args.workers, tuple(args.torch)))
    print(f"wrote {args.out}")
    failed = [r for r in results if r["exit"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
