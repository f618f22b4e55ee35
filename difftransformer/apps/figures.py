"""One figure style for every figure the project draws (the demo, the experiments, the analyses, the benchmarks):
the colour of each architecture and variant (DIFF red and the standard model blue everywhere), the fonts, and one
legend below the axes that fits the figure's width. Every figure is drawn with ``pyplot()`` and written by
``finish()``."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from difftransformer.errors import InputError, install_hint
from difftransformer.fsutil import write_atomic

PLOT_EXTRA = install_hint("plot")  # what installs matplotlib, in every message that asks for it

# One colour per model kind, in every figure; the variants of the language-model study have their own.
COLORS = {
    "diff": "tab:red",
    "standard": "tab:blue",
    "diff_v2": "tab:olive",
    "diff_v2-matched": "tab:green",
    "diff-no-head-norm": "tab:orange",
    "diff-norm-gain": "tab:purple",
    "diff-matched": "tab:purple",  # the same idea as diff-norm-gain: the per-head norm started at the matched gain
    "standard-head-norm": "tab:cyan",
}
# Lines that stand for heads or layers of one model, not for an architecture: colours none of COLORS uses
HEADS = ("tab:brown", "tab:pink", "tab:gray", "black", "goldenrod", "teal", "indigo", "darkkhaki")
STYLE = {  # matplotlib rcParams: the fonts and lines of every figure
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 9,
    "figure.titlesize": 12,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "lines.linewidth": 1.5,
    "savefig.facecolor": "white",
}


def has_pyplot() -> bool:
    """Whether matplotlib is installed, so that pyplot() can draw (checked without importing it)."""
    return importlib.util.find_spec("matplotlib") is not None


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (figures are written, never shown), in the project's style."""
    try:
        import matplotlib
    except ImportError:
        raise InputError(f"the figures need matplotlib: {PLOT_EXTRA}") from None

    matplotlib.use("Agg")
    matplotlib.rcParams.update(STYLE)
    import matplotlib.pyplot as plt

    return plt


def finish(fig, path: Path, title: str, dpi: int = 110) -> None:
    """Give ``fig`` its title and one legend below the axes (so that it hides no data: one entry per label, from
    every axes), lay it out, write it to ``path`` and close it. The figures of the demo, the experiments and the
    analyses all end here."""
    handles: dict[str, object] = {}
    for ax in fig.axes:
        if ax.get_legend() is not None:
            ax.get_legend().remove()
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if not label.startswith("_"):
                handles.setdefault(label, handle)
    fig.set_layout_engine("constrained")
    fig.suptitle(title, fontsize=12)
    if handles:
        ncol = len(handles) if len(handles) <= 6 else min(5, math.ceil(len(handles) / 2))
        renderer = fig.canvas.get_renderer()
        while True:  # as many columns as fit the figure's width (a wider legend is cut off at both edges)
            legend = fig.legend(
                handles.values(), handles.keys(), loc="outside lower center", ncol=ncol, fontsize=9, frameon=False
            )
            if ncol == 1 or legend.get_window_extent(renderer).width <= 0.98 * fig.bbox.width:
                break
            legend.remove()
            ncol -= 1
    for ax in fig.axes:
        ax.tick_params(labelsize=9)
    try:
        write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format=Path(path).suffix[1:] or None))
    finally:
        pyplot().close(fig)


def readable_log_axis(ax, axis: str = "x") -> None:
    """Ticks of a log axis at 1, 2 and 5 per decade, labelled 200k, 1M (no overlapping minor labels)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    def short(value: float, _pos) -> str:
        for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if value >= size:
                return f"{value / size:g}{unit}"
        return f"{value:g}"

    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    target.set_major_formatter(FuncFormatter(short))
    target.set_minor_formatter(NullFormatter())
