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

ROOT = Path(__file__).resolve().parents[1]
REPORTS = ROOT / "experiments" / "reports"


@pytest.fixture
def figures(monkeypatch, tmp_path):
    """(figures written, output directory): the figures stay open for the checks."""
    optional("matplotlib")
    from difftransformer.apps.repro.report import pyplot

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
    for legend in fig.legends:
        box = legend.get_window_extent(renderer)
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1, f"{name}: the legend is cut off at the figure's edges"
        for ax in plots:
            assert not box.overlaps(ax.get_window_extent(renderer)), f"{name}: the legend overlaps an axes"


def check_all(kept: list, names: list[str]) -> None:
    assert len(kept) == len(names)
    for fig, name in zip(kept, names, strict=True):
        check_readable(fig, name)


def report(name: str) -> dict:
    return json.loads((REPORTS / name / "results.json").read_text())


def test_needle_figures(figures):
    from difftransformer.apps.repro import needle

    kept, out = figures
    needle._plots(report("needle"), out)
    check_all(kept, ["needle_depth_length", "needle_curves"])
    assert (out / "needle_curves.png").stat().st_size > 0


def test_icl_and_allocation_figures(figures):
    from difftransformer.apps.repro import allocation, icl
    from difftransformer.apps.repro.report import plot_curves

    kept, out = figures
    result = report("icl")
    icl._plot(result, out)
    plot_curves(result["runs"], out / "icl_curves.png", "accuracy, C=4", "in-context learning")
    allocation._plot(report("allocation"), out)
    check_all(kept, ["icl_shots", "icl_curves", "allocation_bars"])


def test_language_model_and_quantization_figures(figures):
    from difftransformer.apps.repro import lm, lm_report, quant

    kept, out = figures
    result = report("lm")
    lm_report._plot_scaling(result, lm.SCALES[result["scale"]["name"]], out)
    lm_report._plot_positions(result, out)
    lm_report._plot_sweep(result, out)
    quant._figures(report("quant"), out)
    check_all(kept, ["lm_scaling", "lm_positions", "lm_sweep", "quant_bits"])


@pytest.mark.slow
def test_demo_attention_and_outlier_figures(figures, prepared, tmp_path):
    from difftransformer.apps.analyze import analyze_attention
    from difftransformer.apps.analyze_outliers import analyze_outliers
    from difftransformer.apps.demo import run_demo
    from difftransformer.training.loop import train

    kept, out = figures
    run_demo(steps=4, eval_every=2, seq_len=64, batch_size=4, out=out / "demo", data=prepared, sample_tokens=4)
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
