"""The reproduction suite's building blocks on known cases: generators, the allocation metric, the order protocol,
and the commands end to end on a tiny setting."""

import json
from dataclasses import replace

import pytest
import torch
from conftest import optional

from difftransformer import TransformerLM
from difftransformer.apps.analysis import allocation, attention_maps, span_masks
from difftransformer.apps.cli import main
from difftransformer.apps.repro import allocation as allocation_exp
from difftransformer.apps.repro import icl, needle, suite
from difftransformer.apps.repro.fit import FitSpec, save_model
from difftransformer.apps.repro.tasks import (
    EXAMPLE_FEATURES,
    FEATURES_PER_CLASS,
    ICL_EXAMPLE,
    ICL_LABELS,
    IGNORE,
    MARK,
    QRY,
    VOCAB,
    demo_order,
    icl_batch,
    icl_episodes,
    needle_batch,
)
from difftransformer.core.config import ModelConfig
from difftransformer.errors import InputError


def test_needle_batch_layout():
    nb = needle_batch(torch.Generator().manual_seed(0), 64, 40, 4, 2, depth=0.5)
    hay = 40 - 3 * 2
    assert (nb.needle_start == round(0.5 * (hay - 3))).all()
    for i in range(64):
        t = nb.tokens[i]
        marks = (t[:hay] == MARK).nonzero().flatten().tolist()
        assert len(marks) == 4 and int(nb.needle_start[i]) in marks  # filler never holds the marker
        keys, values = t[[m + 1 for m in marks]], t[[m + 2 for m in marks]]
        assert len(set(keys.tolist())) == 4 and len(set(values.tolist())) == 4
        assert set(keys.tolist()).isdisjoint(values.tolist())
        start = int(nb.needle_start[i])
        # the first query asks the needle at the requested depth; the second asks a different one
        assert t[hay] == QRY and t[hay + 1] == t[start + 1] and t[hay + 2] == t[start + 2] == nb.answer[i]
        assert t[hay + 3] == QRY and t[hay + 4] != t[hay + 1]
        assert sorted(nb.other_values[i].tolist() + [int(nb.answer[i])]) == sorted(values.tolist())
        assert nb.answer_pos[i] == hay + 1 and nb.targets[i, hay + 1] == nb.answer[i]
        assert (nb.targets[i, :hay] == IGNORE).all()
    first = needle_batch(torch.Generator().manual_seed(0), 2, 40, 2, 1, depth=0.0)
    last = needle_batch(torch.Generator().manual_seed(0), 2, 40, 2, 1, depth=1.0)
    assert (first.needle_start == 0).all() and (last.needle_start == 40 - 3 - 3).all()
    again = needle_batch(torch.Generator().manual_seed(0), 64, 40, 4, 2, depth=0.5)
    assert torch.equal(again.tokens, nb.tokens)  # the same seed gives the same data, whatever model trains on it


def test_disjoint_needle_vocabulary_keeps_answers_out_of_the_filler():
    from difftransformer.apps.repro.tasks import NEEDLE_FILLER, NEEDLE_KEYS, NEEDLE_VALUES

    nb = needle_batch(torch.Generator().manual_seed(3), 64, 48, 3, 2, vocab="disjoint")
    hay = 48 - 3 * 2
    for i in range(64):
        t = nb.tokens[i].tolist()
        marks = [p for p in range(hay) if t[p] == MARK]
        needle_pos = {p for m in marks for p in (m, m + 1, m + 2)}
        assert len(marks) == 3
        assert all(t[m + 1] in NEEDLE_KEYS and t[m + 2] in NEEDLE_VALUES for m in marks)
        assert all(t[p] in NEEDLE_FILLER for p in range(hay) if p not in needle_pos)  # no key or value in filler
        prompt = t[: int(nb.answer_pos[i]) + 1]
        assert prompt.count(int(nb.answer[i])) == 1  # the answer is in its needle only: nothing leaks
        assert prompt.count(t[hay + 1]) == 2  # the asked key: in its needle and in the query
    noisy = needle_batch(torch.Generator().manual_seed(3), 64, 48, 3, 2, vocab="disjoint", key_noise=0.3)
    hay_tokens = torch.cat([noisy.tokens[i, :hay] for i in range(64)])
    filler_or_key = hay_tokens[hay_tokens != MARK]
    share = ((filler_or_key >= NEEDLE_KEYS[0]) & (filler_or_key <= NEEDLE_KEYS[-1])).float().mean().item()
    assert 0.25 < share < 0.35  # 30% of the filler became distractor keys (and 3 of 39 tokens are needle keys)


@pytest.mark.parametrize(
    "args, message",
    [
        ((10, 3, 4), "need 1 <= R <= N"),
        ((10, 3, 1), "too short"),
        ((64, 16, 2, None, "disjoint"), "at most about 60% of the haystack; use a length of at least 84"),
        ((64, 31, 1), "at most 30 needles"),
        ((64, 21, 1, None, "disjoint"), "at most 20 needles"),
        ((64, 2, 1, None, "mixed"), "unknown needle vocabulary 'mixed'"),
        ((64, 2, 1, None, "shared", 0.1), "needs the disjoint vocabulary"),
        ((64, 2, 1, None, "disjoint", 1.5), "key_noise must be in"),
    ],
)
def test_needle_batch_rejects_impossible_settings(args, message):
    with pytest.raises(ValueError, match=message):
        needle_batch(torch.Generator(), 2, *args)


def test_needles_fill_the_most_the_haystack_allows():
    """At the limit (a haystack of 5N - 2 tokens) every draw places all N needles (the placement used to loop
    forever when the needles could not all fit where the first ones had gone), each answer once, none overlapping."""
    nb = needle_batch(torch.Generator().manual_seed(0), 64, 64, 12, 2, vocab="disjoint")  # haystack 58 = 5 * 12 - 2
    hay = nb.tokens[:, :58]
    assert ((hay == MARK).sum(1) == 12).all()
    starts = (hay == MARK).nonzero()[:, 1].view(64, 12)
    assert (starts.diff(dim=1) >= 3).all()  # row-major nonzero: sorted starts, at least a needle apart


def test_needle_sampler_follows_its_curriculum_and_trains_every_query():
    """Stage by stage, each batch holds one of that stage's N (counted as MARKs per row), with R = N queries under
    "all" and R = min(queries, N) otherwise; every query trains its key and its value (2R targets per row)."""
    spec = FitSpec(seq_len=48, steps=9, task=dict(queries="all", vocab="disjoint", curriculum=[[3, [1]], [6, [2, 3]]]))
    sample, gen = needle.sampler(spec), torch.Generator().manual_seed(0)
    seen = []
    for step in range(9):
        tokens, targets = sample(gen, 8)
        n = (tokens == MARK).sum(1)
        assert (n == n[0]).all() and ((tokens == QRY).sum(1) == n).all()
        assert ((targets != IGNORE).sum(1) == 2 * n).all()
        values = tokens[:, 2:][tokens[:, :-2] == MARK]
        assert ((values >= 20) & (values < 40)).all()  # the disjoint vocabulary's values
        seen.append((step, int(n[0])))
    assert [n for s, n in seen if s < 3] == [1, 1, 1]
    assert {n for s, n in seen if s >= 3} <= {2, 3} and len({n for s, n in seen if s >= 3}) == 2  # after: last stage
    one_query = needle.sampler(replace(spec, task=dict(needles=[4], queries=2)))  # shared vocabulary, no curriculum
    tokens, targets = one_query(gen, 8)
    assert ((tokens == MARK).sum(1) == 4).all() and ((tokens == QRY).sum(1) == 2).all()
    assert ((targets != IGNORE).sum(1) == 4).all()


@pytest.mark.parametrize("scale", ["cpu", "gpu"])
def test_each_needle_scale_draws_its_training_batches_and_evaluation_sets(scale):
    """Every N a scale trains on fits its context with its queries, and every evaluation set it asks for exists."""
    spec = needle.SCALES[scale]
    sample, gen = needle.sampler(spec), torch.Generator().manual_seed(0)
    counts = set()
    for _ in range(12):
        tokens, _targets = sample(gen, 2)
        assert tokens.shape == (2, spec.seq_len)
        counts.add(int((tokens[0] == MARK).sum()))
    assert counts == set(spec.task["needles"])
    words = needle.vocabulary(spec.task)
    for n, r in needle.NR_GRID:
        needle.eval_set(n, r, spec.seq_len, 2, **words)
    for length in spec.task["lengths"]:
        needle.eval_set(*needle.GRID_NEEDLES, length, 2, 0.5, **words)
    for level in spec.task.get("eval_key_noise", []):
        needle.eval_set(*needle.GRID_NEEDLES, spec.seq_len, 2, vocab=words["vocab"], key_noise=level)


@pytest.mark.parametrize(
    "task, message",
    [
        (dict(queries="all", curriculum=[[5, [2]], [3, [4]]]), "until_steps must increase"),
        (dict(queries="all", curriculum=[[5, []]]), "non-empty list of"),
        (dict(queries="all", curriculum=[5, [2]]), "non-empty list of"),
        (dict(queries=0, needles=[2]), "positive number or"),
        (dict(queries=1, needles=[2], eval_key_noise=[0.5]), 'needs `vocab` "disjoint"'),
    ],
)
def test_needle_sampler_refuses_bad_task_options(task, message):
    with pytest.raises(InputError, match=message):
        needle.sampler(FitSpec(task=task))


def test_each_architecture_trains_at_its_own_learning_rate_when_given_one():
    from difftransformer.apps.repro.fit import fit

    spec = FitSpec(d_model=16, n_layers=1, n_heads=2, seq_len=16, steps=3, lr={"diff": 4e-3, "standard": 1e-3})
    assert spec.for_attention("standard").lr == 1e-3 and spec.for_attention("diff").lr == 4e-3
    assert replace(spec, lr=2e-3).for_attention("diff").lr == 2e-3  # one number: both
    sample = needle.sampler(replace(spec, task=dict(needles=[1], queries=1)))
    record, by_dict = fit("standard", 0, spec, sample, lambda m: 0.0)
    assert record["lr"] == 1e-3
    sample = needle.sampler(replace(spec, task=dict(needles=[1], queries=1)))
    _, by_number = fit("standard", 0, replace(spec, lr=1e-3), sample, lambda m: 0.0)  # the same training, bit for bit
    for (name, a), b in zip(by_dict.state_dict().items(), by_number.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    _, at_diffs_rate = fit("standard", 0, replace(spec, lr=4e-3), sample, lambda m: 0.0)
    assert not torch.equal(by_dict.embed.weight, at_diffs_rate.embed.weight)
    with pytest.raises(InputError, match="not for 'diff': add one"):
        replace(spec, lr={"standard": 1e-3}).for_attention("diff")


class _Predicts(torch.nn.Module):
    """A stand-in model whose prediction at every position is a given token per sequence."""

    def __init__(self, tokens):
        super().__init__()
        self.tokens = tokens

    def forward(self, x):
        logits = torch.zeros(x.shape[0], x.shape[1], 64)
        logits[torch.arange(x.shape[0]), :, self.tokens] = 1.0
        return logits


def test_needle_outcome_shares():
    nb = needle_batch(torch.Generator().manual_seed(1), 8, 40, 3, 2)
    guess = nb.answer.clone()
    guess[4:6] = nb.other_values[4:6, 0]  # two answer another needle's value
    guess[6:] = MARK  # two answer something else
    shares = needle.outcomes(_Predicts(guess), nb)
    assert shares == {"correct": 0.5, "other_needle": 0.25, "in_context": 0.25, "not_in_context": 0.0}


def test_answer_kinds_on_hand_made_predictions():
    """Filler 5 3, needles [MARK 7 9] and [MARK 8 11], query [QRY 7] -> 9; token 40 comes only after the prompt."""
    from difftransformer.apps.repro.tasks import NeedleBatch

    row = torch.tensor([5, MARK, 7, 9, 3, MARK, 8, 11, QRY, 7, 9, 40])
    nb = NeedleBatch(
        tokens=row.expand(6, -1),
        targets=torch.full((6, 12), IGNORE),
        answer_pos=torch.full((6,), 9),
        answer=torch.full((6,), 9),
        other_values=torch.full((6, 1), 11),
        needle_start=torch.full((6,), 1),
    )
    kinds = needle.answer_kinds(torch.tensor([9, 11, 3, 8, 50, 40]), nb)
    assert {k: v.tolist() for k, v in kinds.items()} == {
        "correct": [True, False, False, False, False, False],
        "other_needle": [False, True, False, False, False, False],
        "in_context": [False, False, True, True, False, False],  # filler, another needle's key
        "not_in_context": [False, False, False, False, True, True],  # never seen; seen only after the prompt
    }


def test_icl_answer_kinds_on_hand_made_predictions():
    """Episodes of 2 classes and 4 demonstrations: a prediction is right, another label the demonstrations show,
    another token of the prompt (a feature), or a token the prompt does not hold (a label no demonstration shows)."""
    eps = icl_episodes(torch.Generator().manual_seed(0), 4, 2, 4, balanced=True)  # both labels shown twice
    batch = icl_batch(eps)
    wrong_label = eps.label_tokens.gather(1, 1 - eps.query_class[:, None])[:, 0]
    unseen = torch.tensor([t for t in range(ICL_LABELS, VOCAB) if t not in eps.label_tokens.flatten()][:1])
    guess = torch.stack((batch.answer[0], wrong_label[1], batch.tokens[2, 0], unseen[0]))
    shares = icl.outcomes(_Predicts(guess), eps)
    assert shares == {"correct": 0.25, "other_label": 0.25, "in_context": 0.25, "not_in_context": 0.25}
    eps.demo_classes[3] = eps.query_class[3]  # row 3 now shows only the query's own label: the other one is unseen
    guess[3] = wrong_label[3]
    assert icl.outcomes(_Predicts(guess), eps)["not_in_context"] == 0.25


def test_allocation_on_a_hand_made_map():
    # one sequence, two heads, 6 positions; the row read is position 5, the answer span [1, 3), the context [0, 4)
    maps = torch.zeros(1, 2, 6, 6)
    maps[0, 0, 5] = torch.tensor([0.1, 0.3, 0.2, 0.1, 0.0, 0.3])  # softmax-like: the query's own 0.3 counts nowhere
    maps[0, 1, 5] = torch.tensor([0.2, -0.4, 0.5, -0.1, 0.0, 0.1])  # signed, like a differential map
    out = allocation(maps, torch.tensor([5]), *span_masks(torch.tensor([[1, 3]]), torch.tensor([4]), 6))
    torch.testing.assert_close(out["answer"], torch.tensor([[0.5, 0.1]]))
    torch.testing.assert_close(out["noise"], torch.tensor([[0.2, 0.1]]))
    torch.testing.assert_close(out["answer_abs"], torch.tensor([[0.5, 0.9]]))
    torch.testing.assert_close(out["noise_abs"], torch.tensor([[0.2, 0.3]]))


@pytest.mark.parametrize("attention", ["diff", "standard"])
def test_attention_maps_are_the_maps_that_mix_the_values(attention):
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, attention=attention)).eval()
    tokens = torch.randint(0, 64, (2, 10))
    layers = attention_maps(model, tokens, both=True)
    assert len(layers) == 2
    for layer, block in zip(layers, model.layers, strict=True):
        assert layer.mixed.shape == (2, block.attn.num_heads, 10, 10)
        assert torch.all(layer.mixed.triu(1) == 0)  # causal
        if attention == "diff":
            torch.testing.assert_close(layer.softmax.sum(-1), torch.ones(2, 2, 2, 10))
            expected = layer.softmax[:, :, 0] - layer.lam * layer.softmax[:, :, 1]
            torch.testing.assert_close(layer.mixed, expected)
            assert layer.lam == pytest.approx(block.attn.lambda_full().item())
        else:
            torch.testing.assert_close(layer.mixed.sum(-1), torch.ones(2, 4, 10))
    # the hooks are gone afterwards: a plain forward returns logits as before
    assert model(tokens).shape == (2, 10, 64)


def test_icl_episode_labels_follow_classes():
    eps = icl_episodes(torch.Generator().manual_seed(0), 16, 4, 12)
    batch = icl_batch(eps)
    width, nf = ICL_EXAMPLE, EXAMPLE_FEATURES
    for i in range(16):
        feats = eps.demo_features[i]
        for j in range(12):
            c = int(eps.demo_classes[i, j])
            label = batch.tokens[i, width * j + nf]
            assert label == eps.label_tokens[i, c] == batch.targets[i, width * j + nf - 1]
            assert torch.equal(batch.tokens[i, width * j : width * j + nf], feats[j])
            # a demonstration's features are its class's own: no demonstration of another class shares them
            others = feats[eps.demo_classes[i] != c].flatten().tolist()
            assert set(feats[j].tolist()).isdisjoint(others) and len(set(feats[j].tolist())) == nf
        assert batch.answer[i] == eps.label_tokens[i, eps.query_class[i]] == batch.targets[i, -1]
        assert torch.equal(batch.tokens[i, -nf:], eps.query_features[i])
    assert batch.tokens.shape == (16, width * 12 + nf) and (batch.query_pos == width * 12 + nf - 1).all()
    assert (batch.targets != IGNORE).sum() == 16 * 13  # every demonstration's label and the query's
    assert len(set(eps.label_tokens[0].tolist())) == 4 and FEATURES_PER_CLASS == 1


def test_icl_training_episodes_vary_in_length_and_bad_counts_are_refused():
    gen = torch.Generator().manual_seed(0)
    lengths = {icl.sample(gen, 2, [2, 4], [4, 6])[0].shape[1] for _ in range(60)}
    assert lengths == {ICL_EXAMPLE * k + EXAMPLE_FEATURES for k in (4, 5, 6)}
    task = dict(icl.SCALES["cpu"].task)
    for shots, message in [
        (30, r"`shots` must be \[fewest, most\]"),
        ([6, 4], "1 <= fewest <= most"),
        ([4, 40], r"40 demonstrations do not fit a context of 64 \(at most 31\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            icl.check_shots({**task, "shots": shots}, 64)
    with pytest.raises(ValueError, match="32 demonstrations do not fit"):
        icl.check_shots({**task, "order_shots": 32}, 64)
    icl.check_shots(task, 64)  # the cpu scale's own counts fit


def test_demo_orders():
    eps = icl_episodes(torch.Generator().manual_seed(0), 8, 4, 12, balanced=True)
    classes = eps.demo_classes
    for arrangement in ("random", "grouped", "alternating"):
        order = demo_order(torch.Generator().manual_seed(3), classes, arrangement)
        assert torch.equal(order.sort(-1).values, torch.arange(12).expand(8, 12))  # a permutation
        again = demo_order(torch.Generator().manual_seed(3), classes, arrangement)
        assert torch.equal(order, again)
        arranged = classes.gather(1, order)
        if arrangement == "grouped":  # 4 runs of 3 equal classes
            assert (arranged.view(8, 4, 3) == arranged.view(8, 4, 3)[..., :1]).all()
        if arrangement == "alternating":  # each round of 4 holds every class once, in the same class order
            rounds = arranged.view(8, 3, 4)
            assert (rounds.sort(-1).values == torch.arange(4)).all() and (rounds == rounds[:, :1]).all()
    with pytest.raises(ValueError, match="unknown arrangement"):
        demo_order(torch.Generator(), classes, "sorted")
    assert icl.spread([0.5, 0.62, 0.55]) == pytest.approx(12.0)


TINY = FitSpec(d_model=32, n_layers=2, n_heads=4, steps=3, batch_size=4, eval_every=2)


@pytest.fixture
def tiny_scales(monkeypatch):
    monkeypatch.setitem(needle.SCALES, "cpu", replace(TINY, task=dict(needle.SCALES["cpu"].task, eval_size=8)))
    monkeypatch.setitem(
        icl.SCALES, "cpu", replace(TINY, task=dict(icl.SCALES["cpu"].task, eval_size=8, eval_shots=[1, 4]))
    )
    monkeypatch.setattr(allocation_exp, "SIZE", 4)
    monkeypatch.setattr(icl, "ORDER_SEEDS", 2)


def test_an_experiments_models_are_run_directories(tmp_path, tiny_scales):
    """A trained model is saved as a run directory that load_run reads back to the same outputs; the training loop
    is the library's (same losses as optimizer_step on the same batches); a 0.1 model file gets a clear error."""
    from difftransformer.apps.repro.fit import find_models, fit
    from difftransformer.store.runs import load_run

    spec = needle.SCALES["cpu"]
    record = needle.train_job("diff", 0, spec, tmp_path)
    found = find_models(tmp_path, "needle")
    assert list(found) == [("diff", 0)] and found[("diff", 0)] == tmp_path / "models" / "needle-diff-seed0"
    model, tokenizer = load_run(found[("diff", 0)])
    assert tokenizer.encode("60 5") == [60, 5]
    _, trained = fit("diff", 0, spec, needle.sampler(spec), lambda m: 0.0)  # trained again: the same weights
    x = needle.eval_set(2, 1, spec.seq_len, 4).tokens
    with torch.no_grad():
        assert torch.equal(model(x), trained(x))
    assert record["eval"]["by_nr"] and record["config"]["attention"] == "diff"
    assert list(record["eval"]["by_key_noise"]) == ["0.0", "0.1", "0.25", "0.5", "0.75", "0.9"]  # the cpu levels
    assert list(record["eval"]["by_needles"]) == ["8", "10", "12"]
    (tmp_path / "models" / "needle-standard-seed0.pt").write_bytes(b"old")
    with pytest.raises(ValueError, match="model file of difftransformer 0.1 .* run the experiment again"):
        find_models(tmp_path, "needle")


@pytest.mark.slow
def test_repro_all_writes_every_report(tmp_path, tiny_scales, capsys, monkeypatch, corpus_dir):
    optional("matplotlib")
    from test_lm_study import TOY

    from difftransformer.apps.repro import lm

    monkeypatch.setitem(lm.SCALES, "cpu", replace(TOY, name="cpu", vocab_size=300))
    monkeypatch.setattr(lm, "DEFAULT_CORPORA", (str(corpus_dir),))
    monkeypatch.setattr(lm.corpus, "pydocs_documents", lambda: iter(["The built-in corpus, in short. " * 20] * 5))
    from difftransformer.apps.repro import quant

    monkeypatch.setitem(quant.SCALES, "cpu", dict(loss_windows=1, outlier_windows=1))
    monkeypatch.setattr(quant, "CALIB_SAMPLES", 2)
    monkeypatch.setattr(quant, "CALIB_CHECK", ())
    out = tmp_path / "reports"
    assert main(["repro", "all", "--seeds", "2", "--workers", "1", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    for title in ("## Multi-needle retrieval", "## Attention allocation", "## In-context learning", "## Language mod",
                  "## Activation outliers and quantization"):  # fmt: skip
        assert title in report
    assert json.loads((out / "quant" / "results.json").read_text())["study"] == str(out / "lm")
    for name in ("needle_depth_length.png", "needle_curves.png"):
        assert (out / "needle" / name).stat().st_size > 1000
    assert (out / "allocation" / "allocation_bars.png").is_file() and (out / "icl" / "icl_shots.png").is_file()
    result = json.loads((out / "needle" / "results.json").read_text())
    pairs = {(a, s) for a in ("diff", "standard") for s in (0, 1)}
    assert {(e["attention"], e["seed"]) for e in result["evals"]} == pairs
    assert [c["step"] for c in result["runs"][0]["curve"]] == [0, 2, 3]
    alloc = json.loads((out / "allocation" / "results.json").read_text())
    assert alloc["evals"][0]["model"].startswith(str(out / "needle" / "models"))  # reused, not retrained
    assert not (out / "allocation" / "models").exists()
    # nothing already written is overwritten
    assert main(["repro", "icl", "--out", str(out)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err


@pytest.mark.slow
def test_a_synthetic_study_writes_one_tensorboard_run_per_model(tmp_path, tiny_scales):
    """needle with --log-to tensorboard: one run per trained model, whose events are the curves of results.json."""
    event_accumulator = optional("tensorboard.backend.event_processing.event_accumulator")
    out = tmp_path / "n"
    argv = ["repro", "needle", "--seeds", "1", "--workers", "1", "--log-to", "jsonl,tensorboard", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads((out / "results.json").read_text())
    runs = sorted(p.name for p in (out / "tensorboard").iterdir())
    assert runs == ["needle-diff-seed0", "needle-standard-seed0"]
    for run in result["runs"]:
        events = event_accumulator.EventAccumulator(str(out / "tensorboard" / f"needle-{run['attention']}-seed0"))
        events.Reload()
        accuracy = [(e.step, e.value) for e in events.Scalars("eval/accuracy")]
        assert accuracy == [(c["step"], pytest.approx(c["accuracy"])) for c in run["curve"]]
        losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
        assert losses == [(c["step"], pytest.approx(c["loss"])) for c in run["curve"] if c["loss"] is not None]


@pytest.mark.slow
def test_repro_allocation_needs_matching_models(tmp_path, tiny_scales, capsys):
    assert main(["repro", "needle", "--seeds", "1", "--workers", "1", "--out", str(tmp_path / "n")]) == 0
    args = ["repro", "allocation", "--seeds", "2", "--models", str(tmp_path / "n"), "--out", str(tmp_path / "a")]
    assert main(args) == 2
    assert "lacks the needle models of seed(s) [1]" in capsys.readouterr().err
    assert main(["repro", "needle", "--seeds", "0", "--out", str(tmp_path / "x")]) == 2
    capsys.readouterr()
    assert main(["repro", "quant", "--out", str(tmp_path / "q")]) == 2  # the library names `models`, the CLI its flag
    assert "give its directory (--models: e.g. reports/lm)" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"give its directory \(`models`: e.g. reports/lm\)"):
        suite.run("quant", tmp_path / "q")
    with pytest.raises(ValueError, match="unknown experiment"):
        suite.run("outliers", tmp_path / "y")


def test_analyze_attention(tmp_path, capsys):
    optional("matplotlib")
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16))
    path = save_model(model, {"attention": "diff", "seed": 0}, tmp_path, "needle", FitSpec(steps=5))
    assert path == tmp_path / "models" / "needle-diff-seed0"
    prompt = tmp_path / "p.txt"
    prompt.write_text("60 5 7 61 5")
    out = tmp_path / "reports" / "maps.png"  # a folder that does not exist yet (as in the README's command)
    assert main(["analyze", "attention", "--run", str(path), "--prompt-file", str(prompt), "--out", str(out)]) == 0
    assert out.stat().st_size > 1000
    nothing = tmp_path / "none" / "maps.png"  # a failed call creates no folder
    argv = ["analyze", "attention", "--run", str(path), "--prompt-file", str(prompt), "--out", str(nothing)]
    assert main([*argv, "--layer", "9"]) == 2 and not nothing.parent.exists()
    capsys.readouterr()
    cases = [
        (out, "already exists"),  # never overwritten
        (tmp_path / "long.png", "longer than the model's context of 16"),
        (tmp_path / "bad.png", "not valid UTF-8"),
        (tmp_path / "word.png", "'x' is not a token id: this model reads whitespace-separated ids from 0 to 63"),
        (tmp_path / "range.png", "'64' is not a token id"),
    ]
    for target, message in cases:
        if "longer" in message:
            prompt.write_text(" ".join(["1"] * 17))
        if "UTF-8" in message:
            prompt.write_bytes(b"1 2 \xff")
        if "token id" in message:
            prompt.write_text("1 x 2" if "'x'" in message else "1 64")
        argv = ["analyze", "attention", "--run", str(path), "--prompt-file", str(prompt), "--out", str(target)]
        assert main(argv) == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_saved_models_are_evaluated_again_without_training(tmp_path, tiny_scales, monkeypatch):
    """`repro needle --models DIR` scores DIR's models as a training run does (the same evaluations, curves kept),
    trains nothing, and refuses models trained with other options, missing models and a missing report."""
    optional("matplotlib")
    from difftransformer.apps.repro import suite

    suite.run("needle", tmp_path / "trained", seeds=1, workers=1)
    trained = json.loads((tmp_path / "trained" / "results.json").read_text())
    from difftransformer.apps.repro import fit as fit_module

    for module, name in ((needle, "fit"), (fit_module, "train_pairs")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("evaluating again must not train"))
    suite.run("needle", tmp_path / "again", seeds=1, models=tmp_path / "trained")
    again = json.loads((tmp_path / "again" / "results.json").read_text())
    assert again["evals"] == trained["evals"] and again["runs"] == trained["runs"]
    assert again["models"] == str(tmp_path / "trained")
    assert "evaluated again (nothing trained here)" in (tmp_path / "again" / "section.md").read_text()
    suite.run("needle", tmp_path / "bits", seeds=1, models=tmp_path / "trained", logit_bits=2)
    assert json.loads((tmp_path / "bits" / "results.json").read_text())["spec"]["logit_bits"] == 2
    cases = [
        (dict(seeds=2), FileNotFoundError, r"lacks the needle models of seed\(s\) \[1\]"),
        (dict(steps=5), ValueError, "trained with steps = 3, the cpu scale has 5"),
        (dict(models=tmp_path / "again" / "models"), FileNotFoundError, "results.json is missing"),
    ]
    for i, (options, error, message) in enumerate(cases):
        with pytest.raises(error, match=message):
            suite.run("needle", tmp_path / f"bad{i}", **{"seeds": 1, "models": tmp_path / "trained", **options})
    monkeypatch.setitem(needle.SCALES, "cpu", replace(needle.SCALES["cpu"], init_std=0.05))
    with pytest.raises(ValueError, match="trained with init_std = 0.02, the cpu scale has 0.05"):
        suite.run("needle", tmp_path / "init", seeds=1, models=tmp_path / "trained")


@pytest.mark.slow
def test_logit_bits_change_the_final_evaluation_only(tmp_path, tiny_scales, monkeypatch):
    from difftransformer.apps.repro import suite
    from difftransformer.apps.repro.fit import scaled_spec
    from difftransformer.core.attention.logits import active_probe

    suite.run("needle", tmp_path / "two", seeds=1, workers=1, logit_bits=2)
    seen = []  # the probe active in each final evaluation, the training and its learning curve run without one
    monkeypatch.setattr(needle, "evaluate", lambda model, spec: {"probe": repr(active_probe())})
    monkeypatch.setattr(needle, "curve_score", lambda *a, **k: seen.append(active_probe()) or 0.0)
    for bits in (None, 2):
        spec = scaled_spec(needle.SCALES, "cpu", logit_bits=bits)
        run = needle.train_job("diff", 0, spec, tmp_path / f"bits{bits}")
        assert run["eval"]["probe"] == ("None" if bits is None else "LogitQuantizer(bits=2, granularity='row')")
    assert seen and all(probe is None for probe in seen)
    assert json.loads((tmp_path / "two" / "results.json").read_text())["spec"]["logit_bits"] == 2
    assert "quantized to 2 bits" in (tmp_path / "two" / "section.md").read_text()


def test_curve_table_names_when_each_model_first_reached_0_9():
    from difftransformer.apps.repro import report

    def run(attention, accs):
        curve = [{"step": 10 * i, "seconds": 2.0 * i, "accuracy": a} for i, a in enumerate(accs)]
        return {"attention": attention, "seed": 0, "seconds": curve[-1]["seconds"], "curve": curve}

    table = report.curve_table([run("standard", [0.1, 0.5, 0.3]), run("diff", [0.0, 0.2, 0.95, 0.9])], "acc")
    rows = table.splitlines()[4:]
    assert rows == [
        "| DIFF | 0 | 0.90 | 0.95 | 20 (4) | 6 | 0.200 |",
        "| standard | 0 | 0.30 | 0.50 | never | 4 | 0.200 |",
    ]


def test_one_seed_is_never_given_a_spread():
    """#48: "mean and sd over seeds" above one seed's numbers, "+- 0.000" in its cells, "1 random feature tokens"."""
    from difftransformer.apps.repro import report

    assert report.mean_sd([0.5]) == "0.500" and report.mean_sd([0.5, 0.7]) == "0.600 +- 0.141"
    assert report.mean_std([0.5]) == "0.50" and report.mean_std([0.5, 0.7]) == "0.60 +- 0.14 (0.50-0.70)"
    assert report.over_seeds([0]) == "One seed (0): its values, no spread."
    assert report.over_seeds([0, 1, 2]) == "Mean +- standard deviation over the 3 seeds."
    assert report.seeds_label([3]) == "seed 3 alone" and report.seeds_label([0, 1]) == "mean and sd over 2 seeds"
    assert report.count(1, "random feature token") == "1 random feature token" and report.count(4, "shot") == "4 shots"


@pytest.mark.parametrize("experiment", ["needle", "icl"])
def test_a_one_seed_report_claims_no_spread_anywhere(experiment):
    """The committed 5-seed results cut to seed 0: the report's text has no "+-" and says "seed 0 alone" (its stress
    and order tables once said "mean +- standard deviation over seeds" whatever the seeds)."""
    import importlib
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "experiments" / "reports" / experiment
    result = json.loads((root / "results.json").read_text())
    result["seeds"], result["evals"] = [0], [e for e in result["evals"] if e["seed"] == 0]
    text = importlib.import_module(f"difftransformer.apps.repro.{experiment}").markdown(result)
    assert "+-" not in text and "seed 0 alone" in text and "One seed (0)" in text
