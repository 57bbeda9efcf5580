"""Figure layout that keeps every legend and label inside the image, at any size: ``tight_layout``
does not know about a figure legend, and one with a fixed number of columns can be wider than its
figure. :func:`outside_figure` lists what still sticks out (the tests call it on every drawing).
"""
from __future__ import annotations

from typing import List, Sequence

#: Margin kept free around a figure legend, in inches.
PAD_IN = 0.12


def agg_pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path) -> None:
    """Write ``fig`` to ``path`` as PNG and close it (also when the write fails)."""
    try:
        fig.savefig(path, format="png")
    finally:
        agg_pyplot().close(fig)


def legend_below(fig, handles: Sequence, fontsize: float = 8, max_columns: int = 5):
    """Place a legend of ``handles`` below the axes, inside ``fig``; return it.

    Call it after everything else is drawn: it resizes the figure and runs ``tight_layout``.
    """
    renderer = fig.canvas.get_renderer()
    width, height = fig.get_size_inches()
    legend = None
    for columns in range(max(1, min(max_columns, len(handles))), 0, -1):
        if legend is not None:
            legend.remove()
        legend = fig.legend(handles=list(handles), loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=columns,
                            frameon=False, fontsize=fontsize)
        box = legend.get_window_extent(renderer)
        if box.width / fig.dpi <= width - 2 * PAD_IN:
            break
    width = max(width, box.width / fig.dpi + 2 * PAD_IN)
    legend_in = box.height / fig.dpi + PAD_IN
    fig.set_size_inches(width, height + legend_in)
    legend.set_bbox_to_anchor((0.5, PAD_IN / 2 / (height + legend_in)), transform=fig.transFigure)
    fig.tight_layout(rect=(0, legend_in / (height + legend_in), 1, 1))
    return legend


def outside_figure(fig, slack_px: float = 1.0) -> List[str]:
    """What reaches outside the canvas of ``fig``: each legend, each title, axis label and tick
    label that is drawn, and matplotlib's own tight box of everything drawn. Empty when all fits."""
    fig.canvas.draw()  # positions of axis labels and ticks are settled while drawing
    renderer = fig.canvas.get_renderer()
    bounds = fig.bbox
    named = [("legend", legend) for legend in fig.legends]
    for ax in fig.axes:
        if ax.get_legend() is not None:
            named.append(("axes legend", ax.get_legend()))
        texts = [ax.title, ax.xaxis.label, ax.yaxis.label, *_drawn_tick_labels(ax.xaxis),
                 *_drawn_tick_labels(ax.yaxis)]
        named += [(f"text {t.get_text()!r}", t) for t in texts if t.get_visible() and t.get_text()]
    named += [(f"text {t.get_text()!r}", t) for t in fig.texts if t.get_visible() and t.get_text()]
    boxes = [(what, a.get_window_extent(renderer)) for what, a in named]
    tight = fig.get_tightbbox(renderer)
    boxes.append(("everything drawn", tight.transformed(fig.dpi_scale_trans)))
    out = []
    for what, box in boxes:
        if (box.x0 < bounds.x0 - slack_px or box.y0 < bounds.y0 - slack_px
                or box.x1 > bounds.x1 + slack_px or box.y1 > bounds.y1 + slack_px):
            out.append(f"{what} at x {box.x0:.0f}..{box.x1:.0f}, y {box.y0:.0f}..{box.y1:.0f} "
                       f"outside {bounds.width:.0f}x{bounds.height:.0f}")
    return out


def _drawn_tick_labels(axis) -> list:
    """The tick labels of ``axis`` that are drawn: those whose tick lies in the view interval."""
    lo, hi = sorted(axis.get_view_interval())
    eps = (hi - lo) * 1e-9
    return [label for loc, label in zip(axis.get_majorticklocs(), axis.get_majorticklabels())
            if lo - eps <= loc <= hi + eps]
