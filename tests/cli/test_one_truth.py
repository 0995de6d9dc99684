"""One truth per figure: the timeline's table and picture give one verdict from one bound (the
implementation's own where it has one), and name it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import matplotlib.figure
import pytest

from fsdp_conformance.cli import draw, timeline


def _panel(peaks: list[tuple[int, str, int]], bound: dict[str, int]) -> dict[str, Any]:
    rows = [
        {"iteration": i, "phase": phase, "resident": n, "bound": bound[phase], "at_instance": "x"}
        for i, phase, n in peaks
    ]
    samples = [
        {"index": index, "phase": row["phase"], "iteration": row["iteration"],
         "resident": row["resident"], "root_resident": 0}
        for index, row in enumerate(rows)
    ]  # fmt: skip
    return {
        "limit_all_gathers": True,
        "bound_name": "the test's bound",
        "bound": bound,
        "max_resident": max(row["resident"] for row in rows),
        "peaks": rows,
        "over": [row for row in rows if row["resident"] > row["bound"]],
        "samples": samples,
    }


def test_table_and_picture_agree_phase_by_phase(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # forward peak 3 over its bound 2, though below the backward bound 3: the picture once
    # compared the overall peak with the largest bound and said "within"
    panel = _panel([(1, "forward", 3), (1, "backward", 3)], {"forward": 2, "backward": 3})
    document = {"impl": "x", "layers": 6, "lag": "strict", "iterations": 1, "world_size": 2,
                "panels": [panel]}  # fmt: skip
    titles: list[str] = []
    save = matplotlib.figure.Figure.savefig

    def savefig(figure: Any, *args: Any, **kwargs: Any) -> None:
        titles.extend(ax.get_title() for ax in figure.axes)
        save(figure, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    draw.draw(document, str(tmp_path / "t.png"))
    table = timeline.render_timeline(document)
    expected = "over the test's bound in 1 of 2 phases (first: iteration 1 forward, peak 3 > 2)"
    assert [" ".join(title.split()) for title in titles] == [
        f"limit_all_gathers=True: peak 3 resident non-root buffers; {expected}"
    ]
    assert f"limit_all_gathers=True: {expected}" in table
    assert "bound: the test's bound" in table
    over_rows = [line for line in table.splitlines() if line.endswith("over the bound")]
    assert len(over_rows) == 1 and "forward" in over_rows[0]


def test_timeline_texts_lie_inside_the_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Measured by the drawn extents: a long verdict is wrapped, not clipped at the edges."""
    panel = _panel([(1, "forward", 3), (1, "backward", 3)], {"forward": 2, "backward": 3})
    panel["bound_name"] = ("the rate limiter's bound (2 instances, +1 for a prefetch) " * 3).strip()
    unlimited = {**panel, "limit_all_gathers": False}
    document = {"impl": "x", "layers": 6, "lag": "strict", "iterations": 1, "world_size": 2,
                "panels": [panel, unlimited]}  # fmt: skip
    drawn: list[tuple[str, Any, Any]] = []  # (text, its extent, the figure's) as saved
    titles: list[str] = []
    save = matplotlib.figure.Figure.savefig

    def savefig(figure: Any, *args: Any, **kwargs: Any) -> None:
        save(figure, *args, **kwargs)
        figure.canvas.draw()  # where each text lies as drawn
        renderer = figure.canvas.get_renderer()
        for text in draw.drawn_texts(figure):
            drawn.append((text.get_text(), text.get_window_extent(renderer), figure.bbox))
        titles.extend(" ".join(ax.get_title().split()) for ax in figure.axes)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    draw.draw(document, str(tmp_path / "t.png"))
    assert len(drawn) >= 10  # titles, suptitle, axis labels, phase labels, legend
    for text, extent, box in drawn:
        inside = box.x0 <= extent.x0 <= extent.x1 <= box.x1
        assert inside and box.y0 <= extent.y0 <= extent.y1 <= box.y1, (text, extent, box)
    assert all(draw.verdict(p) in title for p, title in zip((panel, unlimited), titles))


def test_fsdp2_timeline_is_held_to_its_own_bound(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_conformance.cli", "timeline", "--impl", "torch-fsdp2",
         "--iterations", "1", "--data", "t.json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads((tmp_path / "t.json").read_text())
    for panel in document["panels"]:
        assert panel["bound_name"] == "torch FSDP2's stream-ordered bound"
        assert panel["bound"] == {"forward": 3, "backward": 2}
        assert panel["over"] == [], panel["over"]
    assert "over the bound" not in done.stdout
    assert "within torch FSDP2's stream-ordered bound in every phase" in done.stdout


def test_terminal_matrix_wraps_long_reasons_instead_of_cutting_them() -> None:
    from fsdp_conformance.cli import report

    reason = (
        "adapter 'fairscale' does not support 'forward_prefetch': fairscale 0.4.13 has no "
        "forward prefetch; " * 3 + "install it with: pip install 'fsdp-conformance[fairscale]'"
    )
    cells = report.cells_from_records(
        [{"event": "test", "nodeid": "t.py::TestA::test_x[cfg-1]", "outcome": "skip",
          "detail": reason, "duration": 0.1}]
    )  # fmt: skip
    lines = report.render_text(cells, detail_width=80).splitlines()
    assert lines[1].startswith("  skip   cfg-1  adapter 'fairscale'")
    indent = lines[1].index("adapter")
    assert all(line.startswith(" " * indent) and len(line) <= indent + 80 for line in lines[2:])
    assert " ".join(line.strip() for line in lines[1:]).endswith("cfg-1  " + reason), (
        lines
    )  # every word, in order: nothing cut
