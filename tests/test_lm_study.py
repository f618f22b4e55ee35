"""The language-model study (`difftx repro lm`): its measurements, fits, document split, plan and resume."""

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import metric_rows, optional

from difftransformer.apps.repro import lm, lm_measure, lm_report, lm_study
from difftransformer.apps.repro.scaling import PowerLaw, fit_power_law, fraction_needed
from difftransformer.errors import ConfigError, InputError
from difftransformer.store.data import TokenData, is_val_document, prepare
from difftransformer.store.tokenizer import ByteTokenizer
from difftransformer.training.evaluate import token_losses

# recall hits ------------------------------------------------------------------------------------------------------


def test_recall_hits_order_2_by_hand():
    # targets are tokens 1..9; (5, 6, 7) repeats at token 6; (5, 6) returns at token 9 but followed by 8, not 7
    window = [5, 6, 7, 9, 5, 6, 7, 5, 6, 8]
    assert np.flatnonzero(lm_measure.recall_hits(window, order=2)).tolist() == [5]


def test_recall_hits_order_1_by_hand():
    # bigrams seen before: (5, 6) at token 5 and 8, (6, 7) at token 6
    window = [5, 6, 7, 9, 5, 6, 7, 5, 6, 8]
    assert np.flatnonzero(lm_measure.recall_hits(window, order=1)).tolist() == [4, 5, 7]


def test_recall_hits_need_a_whole_prefix_and_an_earlier_occurrence():
    assert not lm_measure.recall_hits([3, 3, 3], order=2).any()  # (3, 3, 3) first occurs at the last token
    assert lm_measure.recall_hits([3, 3, 3, 3], order=2).tolist() == [False, False, True]
    assert lm_measure.recall_hits(torch.tensor([1, 2, 1, 2, 1, 2]), order=2).tolist() == [0, 0, 0, 1, 1]


def test_split_by_recall_averages_each_slice():
    windows = torch.tensor([[5, 6, 7, 5, 6, 7], [1, 2, 3, 4, 5, 6]])  # hits: window 0, targets 4 (token 6) and ...
    hits = np.stack([lm_measure.recall_hits(w) for w in windows])
    assert hits.tolist() == [[False, False, False, False, True], [False] * 5]
    losses = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.25], [2.0, 2.0, 2.0, 2.0, 2.0]])
    result = lm_measure.split_by_recall(losses, windows)
    assert result["recall_loss"] == 0.25 and result["recall_tokens"] == 1
    assert result["other_loss"] == pytest.approx(14 / 9) and result["other_tokens"] == 9
    assert result["loss"] == pytest.approx(14.25 / 10)


# per-position loss -------------------------------------------------------------------------------------------------


class CountingModel(torch.nn.Module):
    """Predicts token + 1 with a logit margin of c * position over the other vocab entries: the loss at position p
    on a counting sequence is log(1 + (V - 1) exp(-c p))."""

    def __init__(self, vocab: int, c: float) -> None:
        super().__init__()
        self.vocab, self.c = vocab, c
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, tokens):
        b, t = tokens.shape
        logits = torch.zeros(b, t, self.vocab)
        margin = self.c * torch.arange(t, dtype=torch.float32).expand(b, t)
        logits.scatter_(2, ((tokens + 1) % self.vocab)[..., None], margin[..., None])
        return logits


def test_per_position_loss_of_a_stand_in_model():
    vocab, c, t = 50, 0.1, 16
    windows = torch.arange(t + 1).repeat(3, 1)
    losses = token_losses(CountingModel(vocab, c), windows, batch=2)
    expected = [math.log(1 + (vocab - 1) * math.exp(-c * p)) for p in range(t)]
    assert losses.shape == (3, t)
    torch.testing.assert_close(losses[1], torch.tensor(expected))
    buckets = lm_measure.per_position(losses, bucket=4)
    assert buckets == pytest.approx([sum(expected[i : i + 4]) / 4 for i in range(0, t, 4)], rel=1e-5)


def test_document_windows_start_at_long_documents(tmp_path):
    # byte tokenizer: each document is its bytes and the end token (256)
    val_docs = ["a" * 10, "b" * 40, "c" * 3, "d" * 33, "e" * 100]
    docs = [d for v in val_docs for d in ("z" * 50, v)]  # with val_every=2 the odd documents are validation
    data = tmp_path / "data"
    prepare(docs, ByteTokenizer(), data, val_every=2, split="documents")
    val = TokenData(data, "val")
    windows = lm_measure.document_windows(val, eot_id=256, seq_len=32)
    assert [chr(w[0]) for w in windows.tolist()] == ["b", "d", "e"]  # documents of at least 33 tokens
    assert windows.shape == (3, 33)
    assert windows[1].tolist() == [ord("d")] * 33  # the whole 33-token document, no end token inside
    assert lm_measure.document_windows(val, eot_id=256, seq_len=32, limit=2).shape[0] == 2


# fits ---------------------------------------------------------------------------------------------------------------


def test_power_law_fit_recovers_a_known_curve():
    xs = [1e5, 4e5, 1.6e6]
    fit = fit_power_law(xs, [7.0 * x**-0.08 for x in xs])
    assert fit.a == pytest.approx(7.0) and fit.b == pytest.approx(0.08)


def test_fraction_needed_has_a_closed_form():
    # same exponent, a lower constant: the candidate needs (5/6)^(1/b) of the reference's x, at every x
    candidate, reference = PowerLaw(5.0, 0.1), PowerLaw(6.0, 0.1)
    for x in (1e4, 1e7):
        assert fraction_needed(candidate, reference, x) == pytest.approx((5 / 6) ** 10)
    assert fraction_needed(reference, candidate, 1e5) == pytest.approx((6 / 5) ** 10)  # worse: more than 100%
    assert math.isnan(fraction_needed(PowerLaw(5.0, -0.01), reference, 1e5))  # loss rising with x: never reached


def test_fit_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError):
        fit_power_law([1.0, 1.0], [2.0, 3.0])
    with pytest.raises(ValueError):
        fit_power_law([1.0, 2.0], [0.0, 3.0])


# document-level split ---------------------------------------------------------------------------------------------


def test_document_split_puts_no_document_on_both_sides(tmp_path):
    docs = [f"document {i} " + chr(ord("A") + i % 26) * (20 + 7 * i) for i in range(60)]
    data = tmp_path / "data"
    manifest = prepare(docs, ByteTokenizer(), data, val_every=10, split="documents")
    assert manifest["split"] == "documents"
    assert manifest["documents_per_split"] == {"train": 54, "val": 6}
    tok = ByteTokenizer()
    for split in ("train", "val"):
        stream = TokenData(data, split).window(0, TokenData(data, split).n_tokens).tolist()
        texts, current = [], []
        for t in stream:
            if t == tok.eot_id:
                texts.append(tok.decode(current))
                current = []
            else:
                current.append(t)
        assert not current  # the split ends with a whole document
        expected = [d for i, d in enumerate(docs) if is_val_document(i, 10) == (split == "val")]
        assert texts == expected


def test_document_split_needs_documents_on_both_sides(tmp_path):
    with pytest.raises(ConfigError, match="val_every"):
        prepare(["one document", "two"], ByteTokenizer(), tmp_path / "d", val_every=10, split="documents")
    with pytest.raises(ConfigError, match="split"):
        prepare(["x" * 200], ByteTokenizer(), tmp_path / "d", split="paragraphs")


@pytest.mark.slow
def test_data_prepare_cli_splits_by_documents(tmp_path, corpus_dir):
    import subprocess

    from conftest import difftx

    cmd = difftx("data", "prepare", "--input", str(corpus_dir), "--out", str(tmp_path / "d"), "--split",
                 "documents", "--val-every", "5")  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["split"] == "documents" and manifest["documents_per_split"]["val"] > 0


# the plan ----------------------------------------------------------------------------------------------------------


def test_the_cpu_plan_meets_the_issue():
    scale = lm.SCALES["cpu"]
    best = {"diff": 3e-3, "standard": 6e-3}
    sizes = [lm.count_parameters(_config(scale, s), exclude_embeddings=True) for s in scale.sizes]
    assert max(sizes) / min(sizes) >= 4  # sizes span 4x or more in non-embedding parameters
    assert scale.seq_len >= 1024 and len(scale.lrs) >= 3 and len(scale.steps) >= 2
    grid = lm.grid_runs(scale, best, [0, 1, 2])
    assert len({r.name for r in grid}) == len(grid)
    for size in scale.sizes:
        for steps in scale.steps:
            assert {r.variant for r in grid if r.size == size and r.steps == steps} >= {"diff", "standard"}
    seeded = {(r.variant, r.seed) for r in grid if r.size == scale.reference and r.steps == scale.steps[0]}
    assert {("diff", s) for s in range(3)} | {("standard", s) for s in range(3)} | {("diff_v2", 0)} == seeded
    assert all(r.lr == best[lm.VARIANTS[r.variant][2]] for r in grid)  # each at its own architecture's best rate
    ablations = lm.ablation_runs(scale, best, [0, 1, 2])
    assert {r.variant for r in ablations} == {"diff", "standard", *lm.ABLATIONS}
    assert all(sum(r.variant == v for r in ablations) == 3 for v in lm.ABLATIONS)


def test_the_gpu_plan_reaches_100m_parameters():
    scale = lm.SCALES["gpu"]
    totals = [lm.count_parameters(_config(scale, s)) for s in scale.sizes]
    non_embedding = [lm.count_parameters(_config(scale, s), exclude_embeddings=True) for s in scale.sizes]
    assert max(totals) >= 100_000_000 and max(non_embedding) / min(non_embedding) >= 4
    assert scale.device == "cuda" and scale.seq_len >= 1024 and len(scale.lrs) >= 3


def _config(scale, size):
    from difftransformer.core.config import ModelConfig

    run = lm.Run(size, 1, "standard", 1e-3, 0)
    return ModelConfig.preset("tiny", vocab_size=scale.vocab_size, **run.model_overrides(scale))


def test_matched_runs_differ_only_in_the_attention(tmp_path):
    scale = lm.SCALES["cpu"]
    configs = {
        v: lm.Run("M", 240, v, 3e-3, 1).train_config(scale, tmp_path, tmp_path / v).to_dict() for v in lm.VARIANTS
    }
    base = configs["diff"]
    for variant, cfg in configs.items():
        changed = {k for k in cfg if cfg[k] != base[k]}
        assert changed <= {"attention", "model"}, variant
        options = {k: v for k, v in cfg["model"].items() if base["model"].get(k) != v}
        assert options == lm.VARIANTS[variant][1]


def test_best_lrs_needs_the_whole_sweep():
    scale = lm.SCALES["cpu"]
    runs = lm.sweep_runs(scale)
    losses = {r.name: {"val": {"loss": 5.0 - r.lr * (1 if r.variant == "diff" else -1)}} for r in runs}
    assert lm.best_lrs(scale, losses) == {"diff": max(scale.lrs), "standard": min(scale.lrs)}
    del losses[runs[0].name]
    with pytest.raises(InputError, match="--part sweep"):
        lm.best_lrs(scale, losses)


# a whole study at toy size: runs, resume, report ------------------------------------------------------------------

TOY = lm.Scale(
    name="toy",
    sizes={"A": (16, 1, 4), "B": (32, 2, 4)},
    reference="B",
    seq_len=32,
    batch_size=2,
    steps=(4, 2),
    lrs=(1e-3, 3e-3),
    vocab_size=257,
    eval_tokens=128,
    device="cpu",
    workers=1,
    threads=None,
    val_every=5,
    ckpt_every=2,
)


@pytest.fixture
def toy_study(tmp_path, monkeypatch):
    monkeypatch.setitem(lm.SCALES, "toy", TOY)
    out = tmp_path / "study"
    lm.open_study(out, TOY, [0, 1])
    docs = [f"{i} the differential transformer cancels attention noise " * (1 + i % 4) for i in range(40)]
    prepare(docs, ByteTokenizer(), out / "data", val_every=TOY.val_every, split="documents")
    return out


@pytest.mark.slow
def test_a_toy_study_runs_resumes_and_reports(toy_study):
    optional("matplotlib")
    result = lm_study.run(toy_study, "toy", seeds=[0, 1], workers=1)
    assert result["incomplete"] == []
    measures = lm.read_measures(toy_study)
    expected = {r.name for r in lm.sweep_runs(TOY)}
    best = result["best_lr"]
    expected |= {r.name for r in lm.grid_runs(TOY, best, [0, 1]) + lm.ablation_runs(TOY, best, [0, 1])}
    assert set(measures) == expected
    for name, m in measures.items():
        assert (toy_study / "runs" / name / "model_config.json").is_file()
        assert math.isfinite(m["val"]["loss"]) and m["val"]["recall_tokens"] + m["val"]["other_tokens"] > 0
    section = (toy_study / "section.md").read_text()
    for text in ("Learning-rate sweep", "Parameter fraction", "Token fraction", "Paired difference",
                 "Recall slices", "Per-position loss", "Ablations", "62.2%", "63.7%", "3.122"):  # fmt: skip
        assert text in section
    for figure in ("lm_scaling.png", "lm_positions.png", "lm_sweep.png"):
        assert (toy_study / figure).stat().st_size > 0
    assert len(result["paired"]["differences"]) == 2
    assert {row["variant"] for row in result["ablations"]} == {"diff", "standard", *lm.ABLATIONS}

    from difftransformer.apps.demo import study_context  # what `make demo` prints beside its own numbers

    context = "\n".join(study_context(toy_study / "results.json", norm_path=None))
    assert f"DIFF - standard {result['paired']['interval'][0]:+.4f} nats" in context
    assert "as many differential heads" in context and "of 4 (size, budget) points" in context
    assert "no committed" in study_context(toy_study / "missing.json")[0]

    # interrupted: one run lost its measurement, another stopped at its first checkpoint (step 2 of 4)
    from difftransformer.training.loop import Trainer

    victim = lm.Run("B", 4, "diff", best["diff"], 1)
    (toy_study / "measures" / f"{victim.name}.json").unlink()
    partial = lm.Run("A", 4, "standard", best["standard"], 0)
    (toy_study / "measures" / f"{partial.name}.json").unlink()
    run_dir = toy_study / "runs" / partial.name
    shutil.rmtree(run_dir)
    trainer = Trainer(partial.train_config(TOY, toy_study / "data", run_dir), quiet=True)
    trainer.fit(until=2)
    trainer.close()
    before = (toy_study / "runs" / victim.name / "metrics.jsonl").read_text()
    again = lm_study.run(toy_study, "toy", parts=("grid",), seeds=[0, 1], workers=1)
    assert set(lm.read_measures(toy_study)) == expected
    assert (toy_study / "runs" / victim.name / "metrics.jsonl").read_text() == before  # measured, not retrained
    assert lm.read_measures(toy_study)[victim.name]["val"] == measures[victim.name]["val"]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # resumed at step 2, to its end
    assert lm.read_measures(toy_study)[partial.name]["val"] == measures[partial.name]["val"]  # an exact resume
    assert again["paired"] == result["paired"]

    committed = toy_study.parent / "committed"  # the report without models and data, and a study continued from it
    assert lm_report.export(toy_study, committed)["paired"] == result["paired"]
    assert sorted(p.name for p in (committed / "curves").iterdir()) == sorted(f"{n}.jsonl" for n in expected)
    assert not (committed / "runs").exists() and not (committed / "data").exists()
    elsewhere = toy_study.parent / "elsewhere"
    lm.open_study(elsewhere, TOY, [0, 1])
    shutil.copytree(committed / "measures", elsewhere / "measures")
    shutil.copytree(toy_study / "data", elsewhere / "data")
    assert lm_study.run(elsewhere, "toy", seeds=[0, 1], workers=1)["paired"] == result["paired"]
    assert not (elsewhere / "runs").exists()  # every run was measured already: nothing trained


def test_measures_of_other_data_are_refused(tmp_path):
    (tmp_path / "measures").mkdir()
    for name, data in (("a", "1111"), ("b", "2222"), ("c", None)):
        record = {"name": name} | ({"data": data} if data else {})
        (tmp_path / "measures" / f"{name}.json").write_text(json.dumps(record))
    with pytest.raises(InputError, match="trained on different data"):
        lm.read_measures(tmp_path)
    (tmp_path / "measures" / "b.json").unlink()
    assert set(lm.read_measures(tmp_path)) == {"a", "c"}


def test_a_study_directory_keeps_its_plan(toy_study):
    other = dataclasses.replace(TOY, steps=(8, 4))
    with pytest.raises(InputError, match="another plan"):
        lm.open_study(toy_study, other, [0, 1])
    with pytest.raises(InputError, match="another plan"):
        lm.open_study(toy_study, TOY, [0, 1, 2])
    assert lm.open_study(toy_study, TOY, [0, 1])["seeds"] == [0, 1]


def test_a_new_study_refuses_a_directory_with_other_things(tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not empty"):
        lm.open_study(tmp_path / "busy", TOY, [0])
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"


def test_missing_corpus_names_the_fetch_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="difftx data fetch sotu --out data/sotu"):
        lm.study_documents([tmp_path / "sotu"])


@pytest.mark.slow
def test_the_report_of_a_partial_study(toy_study):
    lm_study.run(toy_study, "toy", parts=("sweep",), seeds=[0, 1], workers=1)
    result = lm_report.analyse(TOY, [0, 1], lm.read_measures(toy_study))
    assert result["incomplete"] == ["grid", "ablations"] and "grid" not in result
    assert "Not yet run" in (toy_study / "section.md").read_text()
    with pytest.raises(InputError, match="sweep is not complete"):
        lm.best_lrs(TOY, {})


@pytest.mark.slow
def test_a_diverged_run_is_recorded_and_never_picked(toy_study, monkeypatch):
    from difftransformer.errors import TrainingDiverged
    from difftransformer.training.loop import Trainer

    fit = Trainer.fit

    def unstable(self, until=None):
        if self.cfg.lr == max(TOY.lrs) and self.cfg.attention == "standard":
            raise TrainingDiverged("5 steps in a row had a non-finite loss")
        return fit(self, until)

    monkeypatch.setattr(Trainer, "fit", unstable)
    result = lm_study.run(toy_study, "toy", parts=("sweep",), seeds=[0, 1], workers=1)
    bad = lm.Run("B", 4, "standard", max(TOY.lrs), 0)
    assert "non-finite" in lm.read_measures(toy_study)[bad.name]["diverged"]
    assert result["best_lr"]["standard"] == min(TOY.lrs)
    assert "| standard | " in (section := (toy_study / "section.md").read_text()) and "diverged" in section


STUDY_SCRIPT = """
import dataclasses, sys
sys.path.insert(0, {tests!r})
from test_lm_study import TOY
from difftransformer.store.data import prepare
from difftransformer.errors import Interrupted
from difftransformer.apps.repro import lm, lm_study
from difftransformer.store.tokenizer import ByteTokenizer

from pathlib import Path

if __name__ == "__main__":  # spawned workers import this file again
    out = sys.argv[1]
    scale = dataclasses.replace(TOY, steps=(4000, 2000), ckpt_every=20)
    lm.SCALES["toy"] = scale
    lm.open_study(Path(out), scale, [0])
    docs = [f"{{i}} the differential transformer cancels attention noise " * 3 for i in range(40)]
    prepare(docs, ByteTokenizer(), Path(out, "data"), val_every=5, split="documents")
    try:
        lm_study.run(out, "toy", parts=("sweep",), seeds=[0], workers=2)
    except Interrupted as err:
        print(err, file=sys.stderr)
        sys.exit(128 + err.signum)
"""


@pytest.mark.slow
def test_ctrl_c_stops_a_parallel_study_at_checkpoints(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "study.py"
    script.write_text(STUDY_SCRIPT.format(tests=str(Path(__file__).parent)))
    out = tmp_path / "study"
    proc = subprocess.Popen([sys.executable, str(script), str(out)], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while len(list(out.glob("runs/*/checkpoints/step_*"))) < 2 and time.time() < deadline:
        time.sleep(0.2)
    assert len(list(out.glob("runs/*/checkpoints/step_*"))) >= 2, "two runs should have started"
    proc.send_signal(signal.SIGINT)  # the terminal's Ctrl-C reaches the study's own process only
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "run the same command to continue" in err
    steps = {p.parent.parent.name: int(p.name.removeprefix("step_")) for p in out.glob("runs/*/checkpoints/step_*")}
    assert len(steps) == 2 and all(0 < s < 4000 for s in steps.values()), steps  # stopped mid-run, checkpointed
    assert not list(out.glob("measures/*.json"))
    time.sleep(1.5)
    later = {p.parent.parent.name: int(p.name.removeprefix("step_")) for p in out.glob("runs/*/checkpoints/step_*")}
    assert later == steps  # nothing trains on after the study stopped


@pytest.mark.slow
def test_quant_study_on_the_pairs_of_a_toy_study(toy_study, tmp_path, monkeypatch):
    optional("matplotlib")
    from difftransformer.apps.repro import quant

    lm_study.run(toy_study, "toy", parts=("sweep", "grid"), seeds=[0, 1], workers=1)
    monkeypatch.setitem(quant.SCALES, "cpu", dict(loss_windows=2, outlier_windows=1))
    monkeypatch.setattr(quant, "CALIB_SAMPLES", 4)
    monkeypatch.setattr(quant, "CALIB_CHECK", (2,))
    out = tmp_path / "quant"
    result = quant.run(out, "cpu", [0, 1], workers=2, models=toy_study)
    assert [(p["size"], p["seed"]) for p in result["pairs"]] == [("A", 0), ("B", 0), ("B", 1)]
    for pair in result["pairs"]:
        for arch in ("diff", "standard"):
            m = pair[arch]
            assert m["attention"] == arch and m["val_tokens"] == 2 * TOY.seq_len
            assert m["outlier_tokens"] == TOY.seq_len
            assert set(m["logit_bits_loss"]) == {"16", "8", "6", "4"}
            assert abs(m["logit_bits_loss"]["16"] - m["loss"]) < 1e-4
            checked = pair["size"] == "B" and pair["seed"] == 0  # the reference size
            extra = {"w8a8-absmax-2", "w8a8-percentile-4"} if checked else set()
            assert set(m["ptq_loss"]) == {"w8a16", "w4a16", "w8a8"} | extra
    assert result["correlations"]["logit_top1_vs_4bit_logit_increase"]["n"] == 6
    section = (out / "section.md").read_text()
    assert "| paper 3B | DIFF | 38.8 |" in section and "4-bit DIFF matches 6-bit Transformer" in section
    assert (out / "quant_bits.png").stat().st_size > 1000
    stamps = {p.name: p.stat().st_mtime_ns for p in (out / "measures").iterdir()}
    assert quant.run(out, "cpu", [0, 1], workers=1, models=toy_study)["pairs"] == result["pairs"]
    assert {p.name: p.stat().st_mtime_ns for p in (out / "measures").iterdir()} == stamps  # nothing re-measured
    with pytest.raises(InputError, match="holds measurements of another plan"):
        quant.run(out, "gpu", [0, 1], workers=1, models=toy_study)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mine.txt").write_text("keep")
    with pytest.raises(InputError, match="is not empty and holds no quant.json"):
        quant.run(tmp_path / "other", "cpu", [0, 1], workers=1, models=toy_study)
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["mine.txt"]


def test_quant_study_needs_a_finished_pair(toy_study, tmp_path):
    from difftransformer.apps.repro import quant

    with pytest.raises(InputError, match="the learning-rate sweep is not complete"):
        quant.run(tmp_path / "q", "cpu", [0], 1, models=toy_study)
    with pytest.raises(FileNotFoundError, match="holds no language-model study"):
        quant.run(tmp_path / "q", "cpu", [0], 1, models=tmp_path)


@pytest.mark.slow
def test_the_study_writes_one_tensorboard_run_per_model(toy_study):
    from test_tracking import expected_scalars, same, tensorboard_scalars

    lm_study.run(toy_study, "toy", parts=("sweep",), seeds=[0, 1], workers=1, log_to="jsonl,tensorboard")
    runs = sorted((toy_study / "runs").iterdir())
    assert [r.name for r in runs] == sorted(r.name for r in lm.sweep_runs(TOY))
    for run in runs:
        same(tensorboard_scalars(run / "tensorboard"), expected_scalars(metric_rows(run)), rel=1e-6)


def test_log_to_is_checked_before_a_study_starts(tmp_path):
    from difftransformer.apps.repro import suite

    with pytest.raises(InputError, match="log_to` must be a comma-separated list"):
        suite.run("lm", tmp_path / "lm", log_to="tensorbaord")
    with pytest.raises(InputError, match="log_to` wandb applies to lm"):
        suite.run("needle", tmp_path / "needle", log_to="tensorboard,wandb")
    with pytest.raises(InputError, match="log_to` applies to the studies that train: lm, needle, icl, not quant"):
        suite.run("quant", tmp_path / "quant", log_to="tensorboard")
    assert not any(tmp_path.iterdir())


REPORTS = Path(__file__).resolve().parents[1] / "experiments" / "reports"
LM_REPORTS = sorted(p.parent for p in REPORTS.glob("lm*/measures"))  # the studies exported by lm_report.export


@pytest.mark.slow
@pytest.mark.parametrize("committed", LM_REPORTS, ids=[p.name for p in LM_REPORTS])
def test_the_committed_report_is_rebuilt_from_its_measures(tmp_path, committed):
    """experiments/reports/lm (and lm-norm): results.json, section.md and every figure, written again from the
    committed plans and measures alone (what `lm_report.export` keeps), are the committed files to the byte; a report
    edited by hand or left behind its code fails here."""
    optional("matplotlib")
    copy = tmp_path / committed.name
    shutil.copytree(committed, copy, ignore=shutil.ignore_patterns("*.png", "results.json", "section.md"))
    lm_report.write_study(copy)
    written = sorted(p.name for p in copy.iterdir() if p.is_file())
    assert written == sorted(p.name for p in committed.iterdir() if p.is_file())
    for name in written:
        assert (copy / name).read_bytes() == (committed / name).read_bytes(), f"{name} differs: run redraw, commit"


def test_the_demos_closing_block_says_which_way_each_interval_points():
    """#56: "+0.3055 nats", "-0.7831 nats vs DIFF" without saying lower or higher. Each interval now ends in words,
    read off the committed study: DIFF behind the standard model at size M, the ablation without the norm ahead of
    DIFF, and one that spans zero."""
    from difftransformer.apps.demo import _loss_word, study_context

    assert _loss_word(0.05, 0.56, "DIFF", "the standard model") == "DIFF's loss is higher (worse)"
    assert _loss_word(-1.2, -0.3, "the variant", "DIFF") == "the variant's loss is lower (better)"
    assert _loss_word(-0.1, 0.2, "the variant", "DIFF") == "within the seed noise"
    text = "\n".join(study_context())
    paired = r"DIFF - standard \+[\d.]+ nats \(95% interval \+[\d.]+ to \+[\d.]+\): DIFF's loss is higher"
    assert re.search(paired, text)
    assert re.search(r"without the per-head norm: -[\d.]+ nats vs DIFF \(95% interval -[\d.]+ to -[\d.]+; \d+ steps\): "
                     r"the variant's loss is lower \(better\)", text)  # fmt: skip
    assert "as many differential heads as standard heads" in text and "within the seed noise" in text
