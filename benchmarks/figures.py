"""The measured figures the docs quote, kept in one file (docs/figures.json) and written into
README.md and docs/*.md between markers, so that no copy drifts:

    <!-- figure run-impl -->...generated text...<!-- /figure -->

``python benchmarks/bench_run.py --update-docs`` measures ``fsdp-conformance run --impl impl``,
records it here and rewrites every marked span (one command); ``python benchmarks/figures.py``
only rewrites the spans (after editing docs/figures.json). tests/test_docs_figures.py fails when
a span differs from its figure.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "figures.json"
MARKER = re.compile(r"<!-- figure ([\w-]+) -->(.*?)<!-- /figure -->", re.DOTALL)
# figure -> how the docs say it (str.format over its record in docs/figures.json)
TEMPLATES = {
    "run-impl": "{wall_s:.0f} s wall and {cpu_s:.0f} CPU-seconds (user + sys of every process) "
    "for {cells} cells on {machine}, load average {load:.1f} before the run ({date}, "
    "`{command}`): {units:.2f} calibration units (the run's CPU-seconds over the "
    "{calibration_cpu_s:.1f} of `benchmarks/bench_run.py`'s calibration workload, same machine)",
}


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def load() -> dict[str, dict[str, Any]]:
    return json.loads(DATA.read_text(encoding="utf-8"))


def render(text: str, figures: dict[str, dict[str, Any]]) -> str:
    """``text`` with every marked span written from its figure (KeyError: an unknown figure)."""

    def fill(match: re.Match[str]) -> str:
        name = match.group(1)
        return f"<!-- figure {name} -->{TEMPLATES[name].format(**figures[name])}<!-- /figure -->"

    return MARKER.sub(fill, text)


def rewrite(figures: dict[str, dict[str, Any]]) -> None:
    """Record ``figures`` in docs/figures.json and rewrite every document's marked spans."""
    DATA.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for path in documents():
        text = path.read_text(encoding="utf-8")
        if render(text, figures) != text:
            path.write_text(render(text, figures), encoding="utf-8")
            print(f"rewrote the figures in {path.relative_to(ROOT)}")


if __name__ == "__main__":
    rewrite(load())
