"""Every figure the library writes, rendered and checked for what makes a figure readable: a title that says what
is compared, legends that cover no data (one figure legend below the axes) and fit in the figure, a colour bar for
every image, tick labels of at least 8 points. The experiments' figures are rendered from the committed reports'
results; the demo's and the analyses' from short runs. DIFFTX_KEEP_FIGURES=DIR also writes them there, to look
at."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import optional, small_config

from difftransformer.apps.figures import COLORS

ROOT = Path(__file__).resolve().parents[1]
REPORTS = ROOT / "experiments" / "reports"


@pytest.fixture
def figures(monkeypatch, tmp_path):
    """(figures written, output directory): the figures stay open for the checks."""
    optional("matplotlib")
    from difftransformer.apps.figures import pyplot

    plt = pyplot()
    real_close, kept = plt.close, []
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    out = tmp_path / "figures"
    out.mkdir()
    yield kept, out
    keep = os.environ.get("DIFFTX_KEEP_FIGURES")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for png in out.rglob("*.png"):
            shutil.copy(png, Path(keep) / png.name)
    for fig in kept:
        real_close(fig)


def check_readable(fig, name: str) -> None:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    title = fig._suptitle.get_text() if fig._suptitle is not None else ""
    assert len(title) > 15, f"{name}: no title that says what is compared"
    plots = [ax for ax in fig.axes if getattr(ax, "_colorbar", None) is None]
    scales = {(im.norm.vmin, im.norm.vmax, im.cmap.name) for ax in fig.axes for im in ax.images if im.colorbar}
    for ax in plots:
        assert ax.get_legend() is None, f"{name}: a legend inside the axes may cover data"
        for label in ax.get_xticklabels() + ax.get_yticklabels():
            if label.get_text() and label.get_visible():
                assert label.get_fontsize() >= 7.5, f"{name}: tick label {label.get_text()!r} is too small"
        for im in ax.images:  # each image's colours are read on a colour bar of the same scale
            assert (im.norm.vmin, im.norm.vmax, im.cmap.name) in scales, f"{name}: an image without a colour bar"
    from matplotlib.text import Text

    undrawn = set()  # the labels of ticks outside the view limits, which matplotlib does not draw
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not low - 1e-9 * abs(high - low) <= tick.get_loc() <= high + 1e-9 * abs(high - low):
                    undrawn |= {id(tick.label1), id(tick.label2)}
    for text in fig.findobj(Text):  # titles, labels, tick labels, colour-bar labels: none cut off at an edge
        if text.get_visible() and text.get_text().strip() and id(text) not in undrawn:
            box = text.get_window_extent(renderer)
            inside = fig.bbox.x0 - 1 <= box.x0 and box.x1 <= fig.bbox.x1 + 1 and fig.bbox.y0 - 1 <= box.y0
            assert inside and box.y1 <= fig.bbox.y1 + 1, f"{name}: {text.get_text()!r} is cut off at the figure's edge"
    for legend in fig.legends:
        for handle, label in zip(legend.legend_handles, legend.get_texts(), strict=True):
            kind = _kind(label.get_text())
            if kind is not None:
                assert _rgb(handle) == _rgb(COLORS[kind]), f"{name}: {label.get_text()!r} is not in {kind}'s colour"
        box = legend.get_window_extent(renderer)
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1, f"{name}: the legend is cut off at the figure's edges"
        for ax in plots:
            assert not box.overlaps(ax.get_window_extent(renderer)), f"{name}: the legend overlaps an axes"


def _kind(label: str) -> str | None:
    """The architecture a legend entry names by itself ("DIFF", "standard, validation"), None for any other."""
    first = label.split(",")[0].split(" (")[0].strip()
    return {"DIFF": "diff", "standard": "standard"}.get(first)


def _rgb(thing) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb

    if isinstance(thing, str):
        return to_rgb(thing)
    colour = thing.get_color() if hasattr(thing, "get_color") else thing.get_facecolor()
    if not isinstance(colour, str) and len(colour) and not isinstance(colour[0], float):
        colour = colour[0]  # a collection's first colour
    return to_rgb(colour[:3] if not isinstance(colour, str) else colour)


def check_all(kept: list, names: list[str]) -> None:
    assert len(kept) == len(names)
    for fig, name in zip(kept, names, strict=True):
        check_readable(fig, name)


def report(name: str) -> dict:
    return json.loads((REPORTS / name / "results.json").read_text())


COMMITTED = [p.parent for p in sorted(REPORTS.glob("*/results.json"))]
CONTEXT = sorted((ROOT / "benchmarks" / "results").glob("context-*.json"))


@pytest.mark.slow  # about 15 s in all (matplotlib): make test runs it, make test-quick leaves it
@pytest.mark.parametrize("source", [*COMMITTED, *CONTEXT], ids=lambda p: p.name)
def test_every_committed_figure_is_drawn_again_from_its_results(figures, source):
    """redraw (what re-renders the committed figures) draws, from a copy of the saved results alone, every figure
    committed beside them (allocation_rows.png aside: it needs the trained models), and each is readable."""
    from difftransformer.apps.repro.redraw import redraw

    kept, out = figures
    copy = out / source.name
    if source.suffix == ".json":
        shutil.copy(source, copy)
        committed = {source.with_suffix(".png").name}
    else:
        copy.mkdir()
        shutil.copy(source / "results.json", copy)
        committed = {p.name for p in source.glob("*.png")} - {"allocation_rows.png"}
    written = redraw(copy)
    assert {p.name for p in written if p.suffix == ".png"} == committed
    check_all(kept, [f"{source.name}: figure {i + 1} of {len(kept)}" for i in range(len(kept))])


@pytest.mark.slow
@pytest.mark.parametrize("source", COMMITTED, ids=lambda p: p.name)
def test_every_committed_report_is_the_text_its_results_give_now(source, tmp_path):
    """A committed report written again from its results by this version's code comes out the same: a change to a
    report's wording (#48: "30 to 30 demonstrations", "1 random feature tokens", a parameter fraction printed
    where no fit can give one) reaches the committed reports, or this fails."""
    from difftransformer.apps.repro.redraw import redraw

    copy = tmp_path / source.name
    shutil.copytree(source, copy)
    changed = [p.name for p in redraw(copy) if p.suffix == ".md"]
    assert not changed, f"{source.name}: {changed} differ from what its results give now: redraw it and commit"


@pytest.mark.slow
def test_demo_attention_and_outlier_figures(figures, prepared, tmp_path):
    from difftransformer.apps.analyze import analyze_attention
    from difftransformer.apps.analyze_outliers import analyze_outliers
    from difftransformer.apps.demo import run_demo
    from difftransformer.training.loop import train

    kept, out = figures
    run_demo(
        steps=4, eval_every=2, seq_len=64, batch_size=4, out=out / "demo", data=prepared, sample_tokens=4, part="lm"
    )
    check_all(kept, ["loss_curves", "lambda"])
    for kind in ("diff", "standard"):
        train(small_config(prepared, tmp_path / kind, attention=kind, max_steps=2, ckpt_interval=2), quiet=True)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def f(x):\n    return x + 1\n")
    kept.clear()
    assert analyze_attention(tmp_path / "diff", prompt, out / "maps.png").stat().st_size > 0  # checked below
    analyze_outliers([str(tmp_path / "diff"), str(tmp_path / "standard")], out / "outliers", 128, None, 4)
    check_all(kept, ["outliers"])


@pytest.mark.slow
def test_attention_map_figure(figures, prepared, tmp_path):
    from difftransformer.apps.analysis import attention_maps
    from difftransformer.apps.analyze import _figure
    from difftransformer.store.runs import load_run
    from difftransformer.training.loop import train

    train(small_config(prepared, tmp_path / "diff", max_steps=2, ckpt_interval=2), quiet=True)
    model, tokenizer = load_run(tmp_path / "diff")
    ids = tokenizer.encode("def f(x): return x")
    import torch

    maps = attention_maps(model, torch.tensor([ids]), both=True)[0]
    fig = _figure(maps, [tokenizer.decode([i]) for i in ids], 0, "diff")
    check_readable(fig, "attention maps")
    fig.savefig(figures[1] / "maps.png", dpi=110)
    assert len(fig.axes) == 2 * 3 * model.config.attention_heads  # three maps per head, each with a colour bar
