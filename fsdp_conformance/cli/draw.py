"""Drawing ``fsdp-conformance timeline``: one panel per ``limit_all_gathers`` setting, the
resident unsharded buffers after every event as step curves, the phases shaded, the bound
dashed. matplotlib (an optional dependency) is imported here only.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any

PHASE_COLOURS = {"forward": "#cfe3f7", "backward": "#f9dcc4"}


def verdict(panel: dict[str, Any]) -> str:
    """Whether the panel stays within its bound, phase by phase."""
    if not (over := panel["over"]):
        return f"within {panel['bound_name']} in every phase"
    first = over[0]
    return (
        f"over {panel['bound_name']} in {len(over)} of {len(panel['peaks'])} phases (first: "
        f"iteration {first['iteration']} {first['phase']}, peak {first['resident']} > "
        f"{first['bound']})"
    )


def _phase_spans(samples: list[dict[str, Any]]) -> list[tuple[str, int, int, int]]:
    """(phase, iteration, first index, last index) of each run of samples in one phase."""
    spans: list[tuple[str, int, int, int]] = []
    for sample in samples:
        key = (sample["phase"], sample["iteration"])
        if spans and spans[-1][:2] == key:
            phase, iteration, first, _ = spans[-1]
            spans[-1] = (phase, iteration, first, sample["index"])
        else:
            spans.append((*key, sample["index"], sample["index"]))
    return spans


def drawn_texts(figure: Any) -> list[Any]:
    """The figure's texts other than tick labels: titles, axis labels, phase labels, legend."""
    texts = list(figure.texts)
    for ax in figure.axes:
        legend = ax.get_legend()
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        texts += legend.get_texts() if legend is not None else []
    return [text for text in texts if text.get_text().strip()]


def _fit_titles(figure: Any) -> None:
    """Lay the figure out, wrapping each title until its drawn extent lies inside the figure."""
    titles = [ax.title for ax in figure.axes] + list(figure.texts)
    for _ in range(8):
        figure.tight_layout()
        figure.canvas.draw()  # the titles' places are decided while drawing
        renderer, box = figure.canvas.get_renderer(), figure.bbox
        extents = [title.get_window_extent(renderer) for title in titles]
        if not (wide := [t for t, e in zip(titles, extents) if e.x0 < box.x0 or e.x1 > box.x1]):
            return
        for title in wide:
            width = max(len(line) for line in title.get_text().splitlines())
            title.set_text(textwrap.fill(" ".join(title.get_text().split()), width * 4 // 5))


def draw(document: dict[str, Any], out_file: str) -> int:
    """Draw the panels of ``document`` into ``out_file`` (PNG, SVG, PDF by its suffix); the
    number of panels (axes) drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = document["panels"]
    figure, axes = plt.subplots(len(panels), 1, figsize=(13, 3.4 * len(panels)), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        samples = panel["samples"]
        # each panel its own scale: the limited curve stays readable next to the unlimited one
        top = max(panel["max_resident"], *panel["bound"].values()) * 1.15 + 1
        index = [sample["index"] for sample in samples]
        for phase, iteration, first, last in _phase_spans(samples):
            if phase in PHASE_COLOURS:
                ax.axvspan(first - 0.5, last + 0.5, color=PHASE_COLOURS[phase], lw=0)
                label = f"{'fwd' if phase == 'forward' else 'bwd'} {iteration}"
                ax.text((first + last) / 2, top * 0.98, label, ha="center", va="top", fontsize=8)
        bound = [panel["bound"].get(sample["phase"]) for sample in samples]
        curves = (
            ([math.nan if v is None else v for v in bound], "#c0392b", "--", 1.5, "bound"),
            ([s["resident"] for s in samples], "#1f4e79", "-", 2, "resident non-root buffers"),
            ([s["root_resident"] for s in samples], "#7f7f7f", "-", 1, "resident root buffers"),
        )  # fmt: skip
        for values, colour, style, width, label in curves:
            ax.step(index, values, where="post", color=colour, ls=style, lw=width, label=label)
        ax.set_title(
            f"limit_all_gathers={panel['limit_all_gathers']}: peak {panel['max_resident']} "
            f"resident non-root buffers; {verdict(panel)}",
            fontsize=10,
        )
        ax.set(ylabel="resident buffers", ylim=(0, top), xlim=(-0.5, max(index, default=0) + 0.5))
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8)
    axes[-1, 0].set_xlabel("event (all-gather, free, device progress, phase start)")
    figure.suptitle(
        f"{document['impl']}: {document['layers']} FSDP instances under a root, "
        f"{document['lag']} lagging device, {document['iterations']} iterations, "
        f"world size {document['world_size']}",
        fontsize=11,
    )
    _fit_titles(figure)
    # the words drawn, in the file (a test compares docs/timeline.png with a fresh drawing)
    description = "\n".join(text.get_text() for text in drawn_texts(figure))
    figure.savefig(out_file, dpi=110, metadata={"Description": description})
    drawn = len(figure.axes)
    plt.close(figure)
    return drawn
