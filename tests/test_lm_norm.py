"""The norm part of the language-model study (`difftx repro lm --part norm`, issue #49): its plan (each variant what it
names, every run at the whole budget), its learning-rate grid, and its report's statistics (paired contrasts, Holm,
TOST at the margin), checked against values computed here by hand or by scipy."""

import dataclasses
import json
import math
import os
import random
import statistics

import pytest
import torch
from conftest import optional
from test_lm_long import TOY as LONG_TOY

from difftransformer.apps.repro import lm, lm_long, lm_norm, lm_norm_report, lm_report, stats
from difftransformer.core.head_norm_gain import matched_gains
from difftransformer.core.model import TransformerLM, count_parameters
from difftransformer.errors import InputError

PLAN = lm_norm.decided_plan(lm_norm.PLANS["cpu"])


def test_every_run_is_a_whole_budget_run_with_the_final_schedule(tmp_path):
    """Tuning cannot favour a side: a tuning run is the final run of its rate and seed (same steps, warm-up, decay)."""
    assert PLAN.steps[0] == PLAN.steps[1] == lm_long.PLANS["cpu"].steps[0]
    state = lm_norm.tuning(PLAN, {})
    for v, st in state.items():
        rates = st["rates"]
        assert len(rates) == 3 and all(math.isclose(b / a, 2.0) for a, b in zip(rates, rates[1:], strict=False)), v
    runs = lm_norm.tune_runs(PLAN, state)
    assert len(runs) == 7 * 3 * PLAN.tune_seeds and {r.steps for r in runs} == {PLAN.steps[0]}
    for run in runs:
        cfg = run.train_config(PLAN, tmp_path, tmp_path / run.name)
        assert cfg.max_steps == PLAN.steps[0] and cfg.warmup_steps == round(PLAN.warmup_fraction * PLAN.steps[0])


def test_the_variants_are_what_they_name():
    configs = {v: lm_long._config(PLAN, v) for v in lm_norm.NORM_VARIANTS}
    counts = {v: count_parameters(c, exclude_embeddings=True) for v, c in configs.items()}
    assert all(abs(n / counts["standard"] - 1) < 0.01 for n in counts.values()), counts
    torch.manual_seed(0)
    models = {v: TransformerLM(c) for v, c in configs.items()}
    rule = matched_gains(configs["diff"])
    for layer, gain in enumerate(rule):
        matched = models["diff-matched"].layers[layer].attn
        fixed = models["diff-matched-fixed"].layers[layer].attn
        paper = models["diff"].layers[layer].attn
        assert torch.all(matched.subln.weight == torch.tensor(gain, dtype=torch.float32))
        assert torch.all(fixed.subln.weight == 1) and fixed.head_scale == gain and matched.head_scale == 1.0
        assert torch.all(paper.subln.weight == 1)
    standard_rule = matched_gains(configs["standard-head-norm-matched"])
    lam = [b.attn.lambda_init for b in models["diff"].layers]
    assert standard_rule == pytest.approx([g * (1 - x) for g, x in zip(rule, lam, strict=True)], rel=1e-12)
    assert models["diff-no-head-norm"].layers[0].attn.subln is None
    assert configs["diff_v2-matched"].attention == "diff_v2"


def _measures(losses: dict[str, dict[float, list[float]]]) -> dict:
    """Measured runs with the given final losses (rate -> per seed) and a two-point curve ending at that loss."""
    out = {}
    total = PLAN.steps[0] * PLAN.seq_len * PLAN.batch_size
    for v, by_rate in losses.items():
        for lr, xs in by_rate.items():
            for s, x in enumerate(xs):
                name = lm.Run(lm_norm.SIZE, PLAN.steps[0], v, lr, s).name
                curve = [[PLAN.steps[0] // 2, total // 2, x + 0.5], [PLAN.steps[0], total, x]]
                out[name] = {"val": {"loss": x}, "curve": curve}
    return out


def test_a_best_rate_at_an_edge_grows_the_grid_and_final_runs_reuse_the_tuning_runs():
    grid = {v: {lr: [4.0 + lr, 4.0 + lr] for lr in PLAN.grids[v]} for v in lm_norm.NORM_VARIANTS}
    state = lm_norm.tuning(PLAN, _measures(grid))  # the lowest rate is best everywhere: every grid grows downwards
    for v, st in state.items():
        assert st["rates"][0] == PLAN.grids[v][0] / 2 and not st["done"], v
    grid["standard"][PLAN.grids["standard"][0] / 2] = [4.5, 4.5]  # the new rate is worse: 3e-3 is inside
    state = lm_norm.tuning(PLAN, _measures(grid))
    assert state["standard"]["best"] == 3e-3 and state["standard"]["done"] and not state["standard"]["at_edge"]
    with pytest.raises(lm.InputError, match="not complete"):
        lm_norm.final_runs(PLAN, state)
    for v in lm_norm.NORM_VARIANTS:
        low = PLAN.grids[v][0] / 2
        grid[v][low] = [4.5, 4.5]
    state = lm_norm.tuning(PLAN, _measures(grid))
    finals = lm_norm.final_runs(PLAN, state)
    tuned = {r.name for r in lm_norm.tune_runs(PLAN, state)}
    assert len(finals) == 7 * PLAN.final_seeds
    assert sum(r.name in tuned for r in finals) == 7 * PLAN.tune_seeds  # seeds 0 and 1 are the tuning runs


def test_paired_test_against_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    diffs = [0.011, -0.004, 0.007, 0.002, 0.009]
    row = stats.paired_test(diffs, 0.025, 1 - 0.05 / 8)
    t = scipy_stats.ttest_1samp(diffs, 0.0)
    assert row["p_zero"] == pytest.approx(t.pvalue, rel=1e-6)
    upper = scipy_stats.ttest_1samp(diffs, 0.025, alternative="less").pvalue
    lower = scipy_stats.ttest_1samp(diffs, -0.025, alternative="greater").pvalue
    assert row["p_tost"] == pytest.approx(max(upper, lower), rel=1e-6)
    half = scipy_stats.t.ppf(1 - 0.05 / 16, 4) * statistics.stdev(diffs) / math.sqrt(5)
    assert (row["low"], row["high"]) == pytest.approx((statistics.fmean(diffs) - half, statistics.fmean(diffs) + half))
    assert stats.holm([0.01, 0.04, 0.03, 0.2]) == pytest.approx([0.04, 0.09, 0.09, 0.2])


def test_holm_levels_reject_exactly_where_holm_does():
    """By hand: 0.01 is tested at 0.05 / 4, 0.03 at 0.05 / 3 (fails), so 0.04 and 0.2 keep 0.05 / 3; and on random
    families, p below its level exactly where Holm's adjusted p is below 0.05, every level between Bonferroni's and
    0.05."""
    assert stats.holm_levels([0.01, 0.04, 0.03, 0.2], 0.05) == pytest.approx([0.0125, 0.05 / 3, 0.05 / 3, 0.05 / 3])
    assert stats.holm_levels([0.001, 0.004, 0.02], 0.05) == pytest.approx([0.05 / 3, 0.025, 0.05])
    rng = random.Random(0)
    for _ in range(500):
        ps = [rng.random() ** 3 for _ in range(rng.randint(1, 8))]
        levels = stats.holm_levels(ps, 0.05)
        assert [p < level for p, level in zip(ps, levels, strict=True)] == [a < 0.05 for a in stats.holm(ps)]
        assert all(0.05 / len(ps) <= level <= 0.05 for level in levels)


@pytest.mark.slow
def test_the_report_says_equivalent_different_or_neither(tmp_path, monkeypatch, capsys):
    """Five seeds each: one variant within a hair of the baseline (equivalent at 0.025), one 0.3 above (higher),
    one noisy (neither: 'not distinguishable at' its interval's largest bound); an interval excludes zero exactly
    where the contrast is called lower or higher."""
    optional("matplotlib")  # write_study draws the figures too
    base = [3.70, 3.68, 3.71, 3.69, 3.72]
    finals = {v: [x + 0.3 for x in base] for v in lm_norm.NORM_VARIANTS}
    finals["standard"] = base
    finals["diff-matched"] = [x + d for x, d in zip(base, [0.001, -0.002, 0.0015, -0.001, 0.0005], strict=True)]
    finals["diff_v2-matched"] = [x + d for x, d in zip(base, [0.05, -0.06, 0.04, -0.05, 0.03], strict=True)]
    grid = {}
    for v in lm_norm.NORM_VARIANTS:
        low, mid, high = PLAN.grids[v]
        grid[v] = {low: [x + 0.1 for x in finals[v][:2]], mid: finals[v], high: [x + 0.1 for x in finals[v][:2]]}
    measures = _measures(grid)
    lm_norm.open_norm(tmp_path, lm_norm.PLANS["cpu"])
    (tmp_path / "measures").mkdir()
    for name, m in measures.items():
        (tmp_path / "measures" / f"{name}.json").write_text(json.dumps(m))
    (tmp_path / "timings.json").write_text(json.dumps({"long": 999.0, "norm-tune": 7200.0, "norm-final": 3600.0}))
    result = lm_report.write_study(tmp_path)["norm"]
    rows = {(r["first"], r["second"]): r for r in result["contrasts"]}
    assert len(rows) == len(lm_norm_report.CONTRASTS)
    assert rows["diff-matched", "standard"]["verdict"] == "equivalent within +-0.025"
    assert rows["diff", "standard"]["verdict"] == "higher"
    noisy = rows["diff_v2-matched", "standard"]
    assert noisy["verdict"] == f"not distinguishable at +-{max(abs(noisy['low']), abs(noisy['high'])):.3f}"
    assert all(r["p_zero_holm"] >= r["p_zero"] for r in rows.values())
    for r in rows.values():
        assert (r["low"] > 0 or r["high"] < 0) == (r["verdict"] in ("lower", "higher")), r
        low, high = r["simultaneous"]  # Bonferroni's, at least as wide
        assert low <= r["low"] + 1e-12 and r["high"] <= high + 1e-12
    text = (tmp_path / "section.md").read_text()
    assert "equivalent within +-0.025" in text and "| yes |" in text
    assert "two runs at a time: tune 2.0 h, final 1.0 h, 3.0 of the issue's 8 hours" in text  # not the long part's
    assert "Training: " in text and "so far" not in text  # every variant has all its seeds
    assert all((tmp_path / f).is_file() for f in lm_norm_report.FIGURES)

    from difftransformer.apps.demo import study_context  # what `make demo` prints beside its own numbers

    context = "\n".join(study_context(tmp_path / "results.json"))
    matched = rows["diff-matched", "standard"]
    assert "width 64, 5 layers, 1 differential head, 1407 steps, 5 seeds" in context
    assert (f"DIFF V1 with the matched gain (learning rate {PLAN.grids['diff-matched'][1]:g}): "
            f"{matched['mean']:+.4f} nats ({matched['low']:+.4f} to {matched['high']:+.4f}): equivalent within "
            "+-0.025") in context  # fmt: skip
    assert "DIFF V1 as published" in context and ": higher" in context
    assert "long budget" not in context  # the norm part, tuned fairly, answers instead of the long part
    study = tmp_path / "lm" / "results.json"  # the study's report without the norm part: read from its own report
    study.parent.mkdir()
    study.write_text("{}")
    beside = "\n".join(study_context(study, norm_path=tmp_path / "results.json"))
    assert f"per-head norm part (`--part norm`, {os.path.relpath(tmp_path / 'section.md')})" in beside
    assert f"{matched['mean']:+.4f} nats ({matched['low']:+.4f} to {matched['high']:+.4f})" in beside
    assert "per-head norm part" not in "\n".join(study_context(study, norm_path=None))

    from difftransformer.apps import demo  # and what `difftx presets` prints after its table, from the same report
    from difftransformer.apps.cli import main
    from difftransformer.core import config

    monkeypatch.setattr(demo, "NORM_STUDY", tmp_path / "results.json")
    monkeypatch.setattr(config, "PRESETS", {"tiny": config.PRESETS["tiny"]})
    capsys.readouterr()
    assert main(["presets"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-5:] == demo.norm_context()  # the demo's lines, unindented
    assert printed[-3].startswith("  DIFF V1 with the matched gain") and f"{matched['mean']:+.4f} nats (" in printed[-3]
    assert printed[-2].startswith("  DIFF V2 with the standard model's parameter count (learning rate ")
    assert printed[-2].endswith(f"nats ({noisy['low']:+.4f} to {noisy['high']:+.4f}): {noisy['verdict']}")
    assert printed[-1].startswith("  so start a small DIFF V1 model's per-head norm at the matched gain")
    rows["diff-matched", "diff"]["verdict"] = "not distinguishable at +-0.300"  # the rule not shown to help V1
    assert not any("so start" in line for line in lm_norm_report.summary(result, "here"))
    monkeypatch.setattr(demo, "NORM_STUDY", tmp_path / "missing" / "results.json")
    assert main(["presets"]) == 0
    assert "per-head norm part" not in (out := capsys.readouterr().out) and "so start a small" not in out


def test_export_keeps_what_the_destination_holds_and_refuses_a_run_of_the_same_name_that_differs(tmp_path):
    """A norm study exported beside another part's report: the destination's timings stay beside the study's, and a
    measure of the same name with other numbers (a run trained by other code) stops the export before it writes."""
    optional("matplotlib")  # write_study draws the tuning figure
    study, dest = tmp_path / "study", tmp_path / "dest"
    lm_norm.open_norm(study, lm_norm.PLANS["cpu"])
    (study / "measures").mkdir()
    low, mid, high = PLAN.grids["diff-matched"]
    measures = _measures({"diff-matched": {low: [3.8, 3.81], mid: [3.7, 3.71], high: [3.8, 3.82]}})
    for name, m in measures.items():
        (study / "measures" / f"{name}.json").write_text(json.dumps(m))
    (study / "timings.json").write_text(json.dumps({"norm-tune": 100.0}))
    name = next(iter(measures))
    (dest / "measures").mkdir(parents=True)
    (dest / "timings.json").write_text(json.dumps({"long": 50.0}))
    (dest / "measures" / f"{name}.json").write_text(json.dumps({**measures[name], "val": {"loss": 3.9}}))
    before = {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()}

    with pytest.raises(InputError, match=rf"differ from the study's under the same name \(measures/{name}.json\)"):
        lm_report.export(study, dest)
    assert {p: p.read_bytes() for p in dest.rglob("*") if p.is_file()} == before  # nothing written

    (dest / "measures" / f"{name}.json").unlink()
    result = lm_report.export(study, dest)
    assert json.loads((dest / "timings.json").read_text()) == {"long": 50.0, "norm-tune": 100.0}
    assert sorted(p.stem for p in (dest / "measures").iterdir()) == sorted(measures)
    assert (dest / lm_norm.NORM_PLAN).read_bytes() == (study / lm_norm.NORM_PLAN).read_bytes()
    assert result["norm"]["tuning"]["diff-matched"]["best"] == mid
    assert lm_report.export(study, dest)["norm"] == result["norm"]  # exporting again: the same files, no clash


# a whole toy norm part ---------------------------------------------------------------------------------------------

TOY = lm_norm.NormScale(
    **{f.name: getattr(LONG_TOY, f.name) for f in dataclasses.fields(lm_long.LongScale)},
    variants=("diff-matched", "diff-matched-fixed"),
    grids=dict.fromkeys(("diff-matched", "diff-matched-fixed"), (4e-3, 8e-3, 1.6e-2)),
    final_seeds=3,
)
TOY = dataclasses.replace(TOY, name="toy-norm", steps=(12, 12), evals=4)


@pytest.mark.slow
def test_a_toy_norm_part_tunes_runs_its_seeds_reports_and_resumes(tmp_path, monkeypatch):
    """Tuning at the whole budget, the grid grown until each best is inside (or the grid is full), the final seeds
    beyond the tuning ones, the report from the measures; the same command again trains nothing."""
    from test_lm_long import _toy_data

    from difftransformer.apps.repro import lm_study

    optional("matplotlib")
    monkeypatch.setitem(lm_norm.PLANS, "toy", TOY)
    out = tmp_path / "study"
    lm_norm.open_norm(out, TOY)
    _toy_data(out)
    result = lm_study.run_norm(out, "toy", workers=1)
    measures = lm.read_measures(out)
    for v, st in result["tuning"].items():
        assert st["inside"] or len(st["rates"]) == lm_norm.MAX_RATES, v
        best = st["best"]
        for s in range(TOY.final_seeds):
            assert lm.Run("X", 12, v, best, s).name in measures, (v, s)
    tuned = sum(len(st["rates"]) for st in result["tuning"].values()) * TOY.tune_seeds
    assert len(measures) == tuned + 2 * (TOY.final_seeds - TOY.tune_seeds)  # the tuning seeds are final seeds
    assert {(r["first"], r["second"]) for r in result["contrasts"]} == {("diff-matched", "diff-matched-fixed")}
    assert "### Contrasts" in (out / "section.md").read_text()
    assert all((out / f).stat().st_size > 1000 for f in lm_norm_report.FIGURES)
    before = {p.name: p.stat().st_mtime_ns for p in (out / "measures").iterdir()}
    lm_study.run_norm(out, "toy", workers=1)
    assert {p.name: p.stat().st_mtime_ns for p in (out / "measures").iterdir()} == before


def test_repro_lm_runs_the_norm_part_only_when_asked(tmp_path, monkeypatch):
    from difftransformer.apps.repro import lm_study, suite

    calls = []

    def norm(out, *args):
        calls.append(("norm", out.name))
        out.mkdir(parents=True, exist_ok=True)
        (out / "section.md").write_text("norm")

    monkeypatch.setattr(lm_study, "run", lambda out, scale, parts, *a: calls.append(("short", parts)))
    monkeypatch.setattr(lm_study, "run_norm", norm)
    text = suite.run("lm", tmp_path / "a", seeds=1, parts=("norm",))
    assert calls == [("norm", "a")] and "norm" in text.read_text()
