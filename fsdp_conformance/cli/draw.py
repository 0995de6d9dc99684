"""Drawing ``fsdp-conformance timeline``: one panel per ``limit_all_gathers`` setting, the
resident unsharded buffers after every event as step curves, the phases shaded, the bound
dashed. matplotlib (an optional dependency) is imported here only.
"""

from __future__ import annotations

import math
from typing import Any

PHASE_COLOURS = {"forward": "#cfe3f7", "backward": "#f9dcc4"}


def verdict(panel: dict[str, Any]) -> str:
    """Whether the panel stays within its bound, phase by phase."""
    over = panel["over"]
    if not over:
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
            ([math.nan if v is None else v for v in bound], "#c0392b", "--", 1.5,
             f"bound: {panel['bound_name']}"),
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
        ax.set_ylabel("resident buffers")
        ax.set_ylim(0, top)
        ax.set_xlim(-0.5, max(index, default=0) + 0.5)
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8)
    axes[-1, 0].set_xlabel("event (all-gather, free, device progress, phase start)")
    figure.suptitle(
        f"{document['impl']}: {document['layers']} FSDP instances under a root, "
        f"{document['lag']} lagging device, {document['iterations']} iterations, "
        f"world size {document['world_size']}",
        fontsize=11,
    )
    figure.tight_layout()
    figure.savefig(out_file, dpi=110)
    drawn = len(figure.axes)
    plt.close(figure)
    return drawn
