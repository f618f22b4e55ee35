"""The demo's first part (#56): DIFF and standard trained side by side on in-context learning, their accuracy and
where their last layer's attention goes, drawn, reported and read against the committed study."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import optional

from difftransformer.apps import demo, demo_icl
from difftransformer.apps.analysis import LayerMaps
from difftransformer.apps.cli import demo as cli_demo
from difftransformer.apps.repro import icl
from difftransformer.apps.repro.tasks import ICL_EXAMPLE
from difftransformer.core.model import TransformerLM
from difftransformer.errors import Interrupted
from difftransformer.store.runs import load_run

ROOT = Path(__file__).resolve().parents[1]


def _measured_with(monkeypatch, query_row) -> dict:
    """measure() of a model whose last layer's map at the query is query_row(episodes, context length) (B, T)."""
    eps = icl.episodes(demo_icl.CLASSES, demo_icl.SHOTS, demo_icl.SIZE)
    t = ICL_EXAMPLE * demo_icl.SHOTS + 1
    maps = torch.zeros(demo_icl.SIZE, 2, t, t)
    maps[:, :, -1] = query_row(eps, t)[:, None]
    monkeypatch.setattr(demo_icl, "attention_maps", lambda model, tokens: [LayerMaps(maps, None, None)])
    return demo_icl.measure(TransformerLM(demo_icl.spec().model_config("standard")).eval())


def test_the_answer_is_the_demonstrations_of_the_querys_class(monkeypatch):
    """measure()'s masks against shares counted from the episodes' classes: a map spread evenly over the
    demonstrations gives the answer the share of the query's class among them (and the query's own weight counts
    nowhere); a map on one demonstration of the query's class gives the answer all of it."""
    eps = icl.episodes(demo_icl.CLASSES, demo_icl.SHOTS, demo_icl.SIZE)
    own = (eps.demo_classes == eps.query_class[:, None]).float()  # (B, k)
    share = own.mean(1).mean().item()

    def even(_eps, t):
        row = torch.full((demo_icl.SIZE, t), 1 / (t - 1))
        row[:, -1] = 0.5  # the query itself
        return row

    m = _measured_with(monkeypatch, even)
    assert m["shares"]["answer"] == pytest.approx(share, abs=1e-6)
    assert m["shares"]["noise"] == pytest.approx(1 - share, abs=1e-6)
    assert m["even"] == pytest.approx(share, abs=1e-6)
    first = own[0].repeat_interleave(ICL_EXAMPLE).bool().tolist()
    assert m["example"]["answer"] == first and len(m["example"]["row"]) == len(first)

    def on_one_label(_eps, t):  # the label of the first demonstration of the query's class, with weight 1
        row = torch.zeros(demo_icl.SIZE, t)
        has = own.any(1)
        row[has, own[has].argmax(1) * ICL_EXAMPLE + 1] = 1.0
        return row

    m = _measured_with(monkeypatch, on_one_label)
    assert m["shares"]["answer"] == pytest.approx(own.any(1).float().mean().item(), abs=1e-6)
    assert m["shares"]["noise"] == 0 and m["shares"]["noise_abs"] == 0


@pytest.mark.slow  # a process or more of its own (the fast tier, make test-quick, stays within a minute)
def test_part_one_trains_both_side_by_side_draws_and_reports(tmp_path, capsys):
    optional("matplotlib")
    result = demo.run_demo(out=tmp_path / "demo", part="icl", icl_steps=4)["icl"]
    out = capsys.readouterr().out
    part = tmp_path / "demo" / "icl"
    assert json.loads((part / "results.json").read_text()) == json.loads(json.dumps(result))
    assert (part / "attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = result["runs"]
    assert sorted(runs) == ["diff", "standard"] and result["steps"] == 4
    for kind in runs:
        assert [p["step"] for p in runs[kind]["curve"]] == [0, 4]
        model = load_run(part / "models" / f"icl-{kind}")[0]
        assert model.config.attention == kind and model.config.d_model == 64
    assert "(2 processes, one thread each) for 4 steps; 4 of the 1500 steps the default takes" in out
    line = f"accuracy: DIFF {runs['diff']['accuracy']:.2f}, standard {runs['standard']['accuracy']:.2f}"
    assert line in out and "(higher is better)" in out
    for kind, name in (("diff", "DIFF"), ("standard", "standard")):
        sh = runs[kind]["shares"]
        assert f"{name}: answer {sh['answer']:+.2f}, noise {sh['noise']:+.2f}" in out
    report = (tmp_path / "demo" / "report.md").read_text()
    assert report.startswith("# Demo, part 1: in-context learning") and "(icl/attention.png)" in report
    assert line in report


def _fake_run(attention: str) -> dict:
    return {
        "attention": attention,
        "curve": [{"step": 0, "accuracy": 0.0}, {"step": 2, "accuracy": 0.5}],
        "accuracy": 0.5,
        "accuracy_8": 0.25,
        "shares": {"answer": 0.3, "noise": -0.1, "answer_abs": 0.3, "noise_abs": 0.2},
        "even": 0.25,
        "example": {"row": [0.1, -0.1], "answer": [True, False]},
    }


def test_a_finished_part_one_is_kept_and_an_interrupted_one_says_how_to_go_on(tmp_path, monkeypatch):
    """Ctrl-C in part 1 names the command that goes on; the folder is then an interrupted demo; a finished part 1
    is read back, not trained again."""
    optional("matplotlib")

    def stopped(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_icl, "run_pairs", stopped)
    with pytest.raises(Interrupted, match=re.escape(f"difftx demo --resume --out {tmp_path / 'demo'} runs it again")):
        demo.run_demo(out=tmp_path / "demo", part="both")
    assert demo.interrupted(tmp_path / "demo")

    monkeypatch.setattr(demo_icl, "run_pairs", lambda *a, **k: [_fake_run("diff"), _fake_run("standard")])
    first = demo_icl.run(tmp_path / "part", steps=2)
    monkeypatch.setattr(demo_icl, "run_pairs", stopped)  # trained again, it would stop
    assert demo_icl.run(tmp_path / "part", steps=2) == json.loads(json.dumps(first))  # read back: lists, not tuples


def test_the_command_line_knows_the_parts_and_the_default_steps():
    assert cli_demo.PARTS == demo.PARTS and cli_demo.ICL_STEPS == demo_icl.STEPS


def test_the_printed_study_numbers_are_the_committed_reports():
    """study_lines reads results.json; the numbers must be report.md's (C=4, 24 shots, rounded)."""
    table = (ROOT / "experiments" / "reports" / "icl" / "report.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| C | model | 1 shot"))
    column = [c.strip() for c in header.split("|")].index(f"{demo_icl.SHOTS} shots")
    want = {}
    for name in ("DIFF", "standard"):
        row = next(line for line in table.splitlines() if line.startswith(f"| {demo_icl.CLASSES} | {name} |"))
        want[name] = float([c.strip() for c in row.split("|")][column].split()[0])
    (line,) = demo_icl.study_lines(1500)
    assert f"DIFF {want['DIFF']:.2f}, standard {want['standard']:.2f}" in line, line
    assert "experiments/reports/icl/report.md: 5 seeds, 6000 steps" in line


@pytest.mark.slow
def test_part_one_is_the_committed_studys_seed_zero_pair(tmp_path):
    """The claim the demo prints: its models are the study's seed-0 runs, stopped early. Their learning curves at
    step 500 against the committed ones (256 episodes: one episode is 0.004; other CPUs round differently)."""
    study = json.loads((ROOT / "experiments" / "reports" / "icl" / "results.json").read_text())
    runs = demo_icl.run_pairs(
        demo_icl.partial(demo_icl.train_job, steps=500, out=tmp_path), [0], 2, 500, "icl", "the study's start"
    )
    for run in runs:
        committed = next(r for r in study["runs"] if (r["attention"], r["seed"]) == (run["attention"], 0))
        at = {p["step"]: p["accuracy"] for p in committed["curve"]}
        mine = {p["step"]: p["accuracy"] for p in run["curve"]}
        assert mine[500] == pytest.approx(at[500], abs=0.02), run["attention"]
