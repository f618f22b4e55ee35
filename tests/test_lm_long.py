"""The long part of the language-model study (`difftx repro lm --part long`): its plan, its learning-rate grid, the
block statistics, the matched gain, the curves' token fractions, and a whole toy study killed and resumed."""

import dataclasses
import json
import math
import shutil

import pytest
import torch
from conftest import optional

from difftransformer.apps.repro import lm, lm_blocks, lm_long, lm_long_report, lm_report, lm_study
from difftransformer.core.attention.diff import differential_attention
from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM, count_parameters
from difftransformer.errors import InputError
from difftransformer.store.data import prepare
from difftransformer.store.tokenizer import ByteTokenizer

# the plan ----------------------------------------------------------------------------------------------------------


def _plan(name):
    plan = lm_long.PLANS[name]
    options = {"diff_v2-matched": {"ffn_dim": lm_long.matched_ffn_dim(plan)}, "diff-norm-gain": {"head_norm_gain": 0.1}}
    return dataclasses.replace(plan, options=options)


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_the_long_plans_meet_the_issue(name):
    plan = _plan(name)
    d_model, _, n_heads = plan.sizes[lm_long.SIZE]
    assert d_model // n_heads >= 32 and plan.seq_len >= 512  # heads at least 32 wide, context at least 512
    tokens = plan.steps[0] * plan.tokens_per_step
    counts = {v: count_parameters(lm_long._config(plan, v), exclude_embeddings=True) for v in lm_long.LONG_VARIANTS}
    assert all(tokens >= 20 * n for n in counts.values()), counts  # every variant: 20 tokens per parameter or more
    assert abs(counts["diff_v2-matched"] - counts["standard"]) / counts["standard"] < 0.01
    assert counts["diff_v2"] > 1.05 * counts["standard"]  # the unmatched V2 keeps its excess
    assert plan.steps[1] == plan.steps[0] // 4 and len(plan.lrs) >= 4 and plan.tune_seeds >= 2
    assert plan.evals >= 20 and len(lm_long.long_runs(plan, dict.fromkeys(lm_long.LONG_VARIANTS, 1e-3), [0, 1, 2]))
    assert set(lm_long.TUNED) == set(lm_long.LONG_VARIANTS) - {"diff_v2"}
    assert 0.0 in plan.diagnose_at and 1.0 in plan.diagnose_at and len(plan.diagnose_at) >= 4


def test_the_cpu_plan_trains_on_one_pass_of_the_corpus():
    plan = lm_long.PLANS["cpu"]
    train_tokens = 5_695_066  # the committed study's training split (experiments/reports/lm/long_init.json)
    assert plan.steps[0] * plan.tokens_per_step / train_tokens < 1.02


def test_the_variants_differ_only_in_what_they_name(tmp_path):
    plan = _plan("cpu")
    configs = {v: lm.Run("X", 8, v, 1e-3, 0).train_config(plan, tmp_path, tmp_path / v) for v in lm_long.LONG_VARIANTS}
    base = configs["diff"].model_config(2048).to_dict()
    expected = {
        "standard": {"attention": "standard"},
        "diff": {},
        "diff-no-head-norm": {"head_norm": False},
        "diff_v2-matched": {"attention": "diff_v2", "ffn_dim": lm_long.matched_ffn_dim(plan)},
        "diff_v2": {"attention": "diff_v2"},
        "standard-head-norm": {"attention": "standard", "head_norm": True},
        "diff-norm-gain": {"head_norm_gain": 0.1},
    }
    for v, cfg in configs.items():
        model = cfg.model_config(2048).to_dict()
        assert {k: x for k, x in model.items() if base[k] != x} == expected[v], v
        changed = {k for k, x in cfg.to_dict().items() if configs["diff"].to_dict()[k] != x}
        assert changed <= {"attention", "model", "out"}


def test_a_long_plan_round_trips_through_its_record():
    plan = _plan("cpu")
    assert lm_long.LongScale.from_record(json.loads(json.dumps(dataclasses.asdict(plan)))) == plan
    assert lm.Scale.from_record(json.loads(json.dumps(dataclasses.asdict(lm.SCALES["cpu"])))) == lm.SCALES["cpu"]


def test_long_runs_validate_often_and_tuning_runs_once():
    plan = lm_long.PLANS["cpu"]
    long, tune = plan.schedule(plan.steps[0]), plan.schedule(plan.steps[1])
    assert plan.steps[0] // long["eval_interval"] >= 20 and tune["eval_interval"] == plan.steps[1]
    assert long["eval_tokens"] == tune["eval_tokens"] == plan.curve_tokens
    assert plan.diagnostic_steps()[0] == 0 and plan.diagnostic_steps()[-1] == plan.steps[0]


# the learning-rate grid --------------------------------------------------------------------------------------------


def _measured(plan, loss_of):
    """Measures of every tuning run a grid could hold, with the loss ``loss_of(variant, lr, seed)``."""
    rates = [plan.lrs[0] / 2**k for k in range(1, 6)] + list(plan.lrs) + [plan.lrs[-1] * 2**k for k in range(1, 6)]
    return {
        r.name: {"val": {"loss": loss_of(r.variant, r.lr, r.seed)}}
        for v in lm_long.TUNED
        for r in lm_long._tune_runs(plan, v, rates)
    }


def test_tuning_extends_a_grid_until_its_best_is_inside():
    plan = dataclasses.replace(lm_long.PLANS["cpu"], lrs=(1e-3, 2e-3, 4e-3, 8e-3))
    optimum = {"standard": 5e-4, "diff": 5e-3, "diff-no-head-norm": 3.2e-2}  # below, inside, above the first grid

    def loss(variant, lr, seed):
        return 4.0 + (math.log(lr) - math.log(optimum.get(variant, 2e-3))) ** 2 + 0.001 * seed

    state = lm_long.tuning(plan, _measured(plan, loss))
    assert state["standard"]["rates"] == [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3]
    assert state["standard"]["best"] == 5e-4 and not state["standard"]["at_edge"]
    assert state["diff"]["rates"] == [1e-3, 2e-3, 4e-3, 8e-3] and state["diff"]["best"] == 4e-3
    assert state["diff-no-head-norm"]["rates"] == [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2]
    assert state["diff-no-head-norm"]["best"] == 3.2e-2
    rates = lm_long.best_rates(state)
    assert rates["diff_v2"] == rates["diff_v2-matched"] == 2e-3  # the unmatched V2 at the matched one's rate


def test_tuning_waits_for_every_seed_and_stops_at_its_limit():
    plan = lm_long.PLANS["cpu"]
    falling = _measured(plan, lambda v, lr, s: 5.0 - lr)  # always best at the top: the grid grows to MAX_RATES
    state = lm_long.tuning(plan, falling)
    assert all(len(st["rates"]) == lm_long.MAX_RATES and st["at_edge"] for st in state.values())
    partial = dict(falling)
    del partial[lm.Run("X", plan.steps[1], "diff", plan.lrs[1], 1).name]
    state = lm_long.tuning(plan, partial)
    assert state["diff"]["best"] is None and state["diff"]["rates"] == list(plan.lrs)
    with pytest.raises(InputError, match="tuning of diff is not complete"):
        lm_long.best_rates(state)
    runs = lm_long.tune_runs(plan, state)
    assert len({r.name for r in runs}) == len(runs) and all(r.steps == plan.steps[1] for r in runs)


def test_a_diverged_rate_is_never_chosen():
    plan = lm_long.PLANS["cpu"]
    state = lm_long.tuning(plan, _measured(plan, lambda v, lr, s: math.inf if lr > 5e-3 else 5.0 - 10 * lr))
    assert state["diff"]["best"] == 3e-3 and not state["diff"]["at_edge"]


# token fractions from the curves ------------------------------------------------------------------------------------


def test_tokens_to_reach_interpolates_between_evaluations():
    curve = [[1, 100, 6.0], [2, 200, 5.0], [3, 300, 4.0]]
    assert lm_long_report.tokens_to_reach(curve, 4.5) == pytest.approx(250)
    assert lm_long_report.tokens_to_reach(curve, 6.5) == 100  # reached at the first evaluation
    assert lm_long_report.tokens_to_reach(curve, 3.9) is None  # never
    assert lm_long_report.tokens_to_reach([[1, 100, 6.0], [2, 200, 6.2], [3, 300, 5.0]], 5.6) == pytest.approx(250)


# block statistics -------------------------------------------------------------------------------------------------


def _rms(x):
    return x.double().pow(2).mean().sqrt().item()


def _model(**options):
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, max_seq_len=24, **options))


VARIANT_OPTIONS = [
    {},
    {"head_norm": False},
    {"attention": "standard"},
    {"head_norm_gain": 0.3},
    {"attention": "standard", "head_norm": True},
    {"attention": "diff_v2"},
]


@pytest.mark.parametrize("options", VARIANT_OPTIONS)
def test_block_stats_match_the_blocks_computed_by_hand(options):
    model = _model(**options)
    windows = torch.randint(0, 61, (3, 21), generator=torch.Generator().manual_seed(2))
    layers = lm_blocks.block_stats(model, windows)
    assert all(p.grad is None for p in model.parameters())  # measuring leaves no gradient behind
    x = model.embed(windows[:, :-1])
    for block, got in zip(model.layers, layers, strict=True):
        with torch.no_grad():
            attn = block.attn
            h = block.attn_norm(x)
            a = attn(h)
            if hasattr(attn, "lambda_init"):  # V1: the core is the differential attention of the projections
                q, k, v, _ = attn._project(h, None, None, None, None)
                core = differential_attention(q, k, v, attn.lambda_full(), scale=attn.scaling)[0]
                heads = (
                    attn.subln(core, scale=1 - attn.lambda_init)
                    if attn.subln is not None
                    else core * (1 - attn.lambda_init)
                )
                assert got["lambda"] == pytest.approx(attn.lambda_full().item())
            else:
                seen = []
                hook = attn.out_proj.register_forward_pre_hook(lambda m, args, seen=seen: seen.append(args[0]))
                attn(h)
                hook.remove()
                heads = seen[0]
                core = heads if getattr(attn, "subln", None) is None else None
                assert got["lambda"] is None
            if core is not None:
                assert got["core"] == pytest.approx(_rms(core), rel=1e-5)
            assert got["heads"] == pytest.approx(_rms(heads), rel=1e-5)
            assert got["attn"] == pytest.approx(_rms(a), rel=1e-5)
            assert got["stream"] == pytest.approx(_rms(x), rel=1e-5)
            x = x + a
            f = block.ffn(block.ffn_norm(x))
            assert got["ffn"] == pytest.approx(_rms(f), rel=1e-5)
            x = x + f
    # the gradient norms are those of the mean next-token loss on the windows
    loss = torch.nn.functional.cross_entropy(model(windows[:, :-1]).flatten(0, 1), windows[:, 1:].flatten())
    grads = torch.autograd.grad(loss, [model.layers[1].attn.q_proj.weight, *model.layers[1].ffn.parameters()])
    assert layers[1]["grad"]["q_proj"] == pytest.approx(grads[0].norm().item(), rel=1e-4)
    ffn_norm = torch.cat([g.flatten() for g in grads[1:]]).norm().item()
    assert layers[1]["grad"]["ffn"] == pytest.approx(ffn_norm, rel=1e-4)
    if options.get("attention", "diff") == "diff":
        assert "lambda" in layers[1]["grad"]
        assert ("subln" in layers[1]["grad"]) == (options.get("head_norm") is not False)


def test_measuring_blocks_between_steps_leaves_training_unchanged():
    from difftransformer.training.step import optimizer_step

    batches = [(torch.randint(0, 61, (2, 20)), torch.randint(0, 61, (2, 20))) for _ in range(3)]
    windows = torch.randint(0, 61, (2, 21))
    states = []
    for measure in (False, True):
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for batch in batches:
            if measure:
                lm_blocks.block_stats(model, windows)
            optimizer_step(model, optimizer, [batch], 1e-2, 1.0, torch.device("cpu"))
        states.append(model.state_dict())
    for name, value in states[0].items():
        assert torch.equal(value, states[1][name]), name


def test_the_matched_gain_gives_the_standard_models_initial_attention_rms(tmp_path):
    plan = dataclasses.replace(TOY, seq_len=64, curve_tokens=512, diagnose_windows=4)
    data = _toy_data(tmp_path)
    init = lm_long.initial_gain(plan, data, [0, 1])
    assert 0 < init["gain"] < 1 and init["train_tokens"] > 0
    assert len(init["attn_rms"]["diff"]) == 2 and len(init["attn_rms"]["diff"][0]) == TOY.sizes["X"][1]
    decided = dataclasses.replace(plan, options=lm_long.options_of(plan, init))
    from difftransformer.store.data import TokenData, eval_windows

    windows = eval_windows(TokenData(data, "val"), plan.seq_len, plan.curve_tokens)[:4]
    ratios = []
    for seed in (0, 1):
        rms = {}
        for v in ("standard", "diff-norm-gain", "diff"):
            torch.manual_seed(seed)
            model = TransformerLM(lm_long._config(decided, v))
            rms[v] = [layer["attn"] for layer in lm_blocks.block_stats(model, windows)]
        assert rms["diff"] == init["attn_rms"]["diff"][seed]  # the runs' own models, as the Trainer builds them
        ratios += [g / s for g, s in zip(rms["diff-norm-gain"], rms["standard"], strict=True)]
    assert math.exp(sum(map(math.log, ratios)) / len(ratios)) == pytest.approx(1.0, rel=0.05)  # 2 significant digits


# a whole toy long part ---------------------------------------------------------------------------------------------

TOY = lm_long.LongScale(
    name="toy-long",
    sizes={"X": (32, 2, 4)},
    reference="X",
    seq_len=32,
    batch_size=2,
    steps=(24, 6),
    lrs=(1e-3, 4e-3, 1.6e-2),
    vocab_size=257,
    eval_tokens=256,
    device="cpu",
    workers=1,
    threads=None,
    val_every=5,
    ckpt_every=4,
    evals=6,
    curve_tokens=128,
    diagnose_windows=2,
    rationale="a toy",
)


def _toy_data(root):
    docs = [f"{i} the differential transformer cancels attention noise " * (1 + i % 4) for i in range(40)]
    prepare(docs, ByteTokenizer(), root / "data", val_every=TOY.val_every, split="documents")
    return root / "data"


LONG_SCRIPT = """
import sys, time
sys.path.insert(0, {tests!r})
from pathlib import Path
from test_lm_long import TOY
from difftransformer.apps.repro import lm_long, lm_study
from difftransformer.training.loop import Trainer

step = Trainer.train_step

def slow_step(self):  # slow enough for the test to kill it in the middle of a long run
    time.sleep(0.03)
    return step(self)

Trainer.train_step = slow_step  # here, not under __main__: the spawned runs import this file again

if __name__ == "__main__":
    lm_long.PLANS["toy"] = TOY
    lm_study.run_long(Path(sys.argv[1]), "toy", seeds=[0, 1], workers=1)
"""


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    from pathlib import Path

    kids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:  # ended meanwhile
            continue
        if fields.get("PPid", "").strip() == str(pid):
            kids.append(int(status.parent.name))
    return kids


def _flat(layers: list[dict]) -> list[float]:
    """A run's block statistics (per layer, with nested gradient norms) as one list, in a fixed order."""

    def values(d: dict) -> list[float]:
        return [x for k in sorted(d) for x in (values(d[k]) if isinstance(d[k], dict) else [d[k]])]

    return [x for layer in layers for x in values(layer)]


@pytest.mark.slow
def test_a_toy_long_part_runs_is_killed_resumes_and_reports(tmp_path, monkeypatch):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    optional("matplotlib")
    monkeypatch.setitem(lm_long.PLANS, "toy", TOY)
    reference = tmp_path / "reference"
    lm_long.open_long(reference, TOY, [0, 1])
    _toy_data(reference)
    expected = lm_study.run_long(reference, "toy", seeds=[0, 1], workers=1)["long"]

    study = tmp_path / "study"
    lm_long.open_long(study, TOY, [0, 1])
    shutil.copytree(reference / "data", study / "data")
    script = tmp_path / "long.py"
    script.write_text(LONG_SCRIPT.format(tests=str(Path(__file__).parent)))
    proc = subprocess.Popen([sys.executable, str(script), str(study)], stderr=subprocess.PIPE, text=True)
    deadline, victim = time.time() + 240, None
    while victim is None and time.time() < deadline and proc.poll() is None:
        for ckpt in study.glob("runs/X-24-*/checkpoints/step_*"):
            if int(ckpt.name.removeprefix("step_")) >= 8:
                victim = ckpt.parent.parent
        time.sleep(0.02)
    assert victim is not None, "a long run should have passed step 8"
    # the power fails: the study and its runs (each in its own session) killed at once, no checkpoint, no cleanup
    proc.send_signal(signal.SIGSTOP)
    for pid in _children(proc.pid):
        os.kill(pid, signal.SIGKILL)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert not (study / "measures" / f"{victim.name}.json").is_file()

    again = lm_study.run_long(study, "toy", seeds=[0, 1], workers=1)["long"]
    assert again["incomplete"] == [] and expected["incomplete"] == []
    assert set(lm.read_measures(study)) == set(lm.read_measures(reference))
    for v, row in expected["variants"].items():
        assert again["variants"][v]["losses"] == row["losses"], v  # resumed runs train bit for bit as the reference
        assert again["variants"][v]["curves"] == row["curves"], v
    assert again["rates"] == expected["rates"] and again["init"]["gain"] == expected["init"]["gain"]
    killed = lm.read_measures(study)[victim.name]
    assert json.loads((victim / lm.RUN_SECONDS).read_text())["invocations"] == 1  # the killed one recorded nothing
    assert killed["train_seconds"] > 0 and killed["curve"] == lm.read_measures(reference)[victim.name]["curve"]
    done = {b["step"] for b in killed["blocks"]}
    assert done | set(killed["blocks_missing"]) == set(TOY.diagnostic_steps())
    ours = {b["step"]: b["layers"] for b in lm.read_measures(reference)[victim.name]["blocks"]}
    for b in killed["blocks"]:  # those measured after the resume are those of the uninterrupted run
        assert _flat(b["layers"]) == pytest.approx(_flat(ours[b["step"]])), b["step"]

    section = (study / "section.md").read_text()
    for text in ("Language modeling, long budget", "Why this size: a toy", "### Learning rates", "token fraction",
                 "Where gaps open", "Per-position loss", "Why the per-head norm matters", "**Reading.**",
                 "Seconds per step, each variant timed alone"):  # fmt: skip
        assert text in section, text
    if killed["blocks_missing"]:
        assert "Not measured" in section
    for figure in ("lm_long_curves.png", "lm_long_tuning.png", "lm_long_blocks.png"):
        assert (study / figure).stat().st_size > 1000
    timings = json.loads((study / lm.TIMINGS).read_text())
    assert {"long-tune", "long", "long-timing"} <= set(timings)
    timing = json.loads((study / lm_long.LONG_TIMING).read_text())
    for key in ("seconds_per_step", "trained_seconds_per_step", "flushed_seconds_per_step"):  # every run has weights
        assert set(timing[key]) == set(lm_long.LONG_VARIANTS) and all(s > 0 for s in timing[key].values()), key
    assert timing["trained_from"]["diff"] == lm.Run("X", 24, "diff", again["rates"]["diff"], 0).name

    committed = tmp_path / "committed"  # the report without models and data, and a long part continued from it
    exported = lm_report.export(study, committed)["long"]
    assert exported["variants"]["diff"]["losses"] == again["variants"]["diff"]["losses"]
    assert not (committed / "runs").exists() and (committed / lm_long.LONG_INIT).is_file()
    elsewhere = tmp_path / "elsewhere"
    for name in lm_long_report.PLAN_FILES:
        (elsewhere / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(committed / name, elsewhere / name)
    shutil.copytree(committed / "measures", elsewhere / "measures")
    shutil.copytree(study / "data", elsewhere / "data")
    continued = lm_study.run_long(elsewhere, "toy", seeds=[0, 1], workers=1)["long"]
    assert continued["variants"]["diff"]["losses"] == exported["variants"]["diff"]["losses"]
    assert not (elsewhere / "runs").exists()  # every run was measured already: nothing trained


def test_a_long_part_joins_a_study_of_the_short_parts_and_keeps_its_plan(tmp_path):
    out = tmp_path / "study"
    lm.open_study(out, lm.SCALES["cpu"], [0, 1, 2])
    (out / "measures").mkdir()
    assert lm_long.open_long(out, TOY, [0, 1])["seeds"] == [0, 1]  # beside the short parts' plan
    with pytest.raises(InputError, match="another plan"):
        lm_long.open_long(out, dataclasses.replace(TOY, steps=(48, 12)), [0, 1])
    with pytest.raises(InputError, match="another plan"):
        lm_long.open_long(out, TOY, [0, 1, 2])
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not empty and holds no long.json"):
        lm_long.open_long(other, TOY, [0])
    alone = tmp_path / "alone"  # and the short parts join a long part's directory
    lm_long.open_long(alone, TOY, [0])
    (alone / "measures").mkdir()
    assert lm.open_study(alone, lm.SCALES["cpu"], [0])["seeds"] == [0]


def test_data_of_another_vocabulary_is_refused(tmp_path):
    _toy_data(tmp_path)  # a byte tokenizer: 257 tokens
    with pytest.raises(InputError, match="257-token vocabulary"):
        lm.ensure_data(tmp_path, lm_long.PLANS["cpu"], [])


def test_repro_lm_runs_the_long_part_only_when_asked(tmp_path, monkeypatch):
    from difftransformer.apps.repro import suite

    calls = []

    def called(kind, out, what):
        calls.append((kind, what))
        out.mkdir(parents=True, exist_ok=True)
        (out / "section.md").write_text(kind)

    monkeypatch.setattr(lm_study, "run", lambda out, scale, parts, *a: called("short", out, parts))
    monkeypatch.setattr(lm_study, "run_long", lambda out, scale, seeds, *a: called("long", out, seeds))
    suite.run("lm", tmp_path / "a", seeds=2)
    suite.run("lm", tmp_path / "b", seeds=3, parts=("long",))
    suite.run("lm", tmp_path / "c", seeds=1, parts=("sweep", "long"))
    assert calls == [("short", lm.PARTS), ("long", [0, 1, 2]), ("short", ("sweep",)), ("long", [0])]


def test_the_demo_names_the_long_parts_best_variant_with_its_interval(tmp_path):
    from difftransformer.apps.demo import study_context

    def row(losses, mean=None):
        gap = None if mean is None else {"mean": mean, "low": mean - 0.05, "high": mean + 0.05}
        return {"losses": losses, "minus_standard": gap}

    variants = {"diff": row([3.0, float("nan")])}  # a diverged seed: no interval, never the best
    variants |= {v: row([4.1, 4.3], 0.1) for v in lm_long.LONG_VARIANTS if v not in ("diff", "standard")}
    variants |= {"standard": row([4.0, 4.2]), "diff-no-head-norm": row([3.7, 3.9], -0.3)}  # the lowest mean loss
    regime = {"tokens_per_parameter": {"standard": 21.6}, "parameters": {"standard": {"non_embedding": 266_944}}}
    path = tmp_path / "results.json"  # a study of the long part alone: no short-budget scale
    path.write_text(json.dumps({"long": {"seeds": [0, 1], "regime": regime, "variants": variants}}))
    lines = study_context(path, norm_path=None)
    text = "\n".join(lines)
    assert "267k non-embedding parameters, 21.6 tokens per parameter, 2 seeds" in text
    assert "lowest mean: DIFF V1 without the per-head norm: -0.3000 nats (95% interval -0.3500 to -0.2500)\n" in text
    assert "DIFF V1: not comparable (a run diverged)" in text
    assert "at the matched initial gain (this library's option): +0.1000 nats" in text
    assert "0.8B-13B parameters" in lines[-1]
    variants["diff-no-head-norm"]["minus_standard"] = {"mean": -0.03, "low": -0.08, "high": 0.02}
    path.write_text(json.dumps({"long": {"seeds": [0, 1], "regime": regime, "variants": variants}}))
    assert "(95% interval -0.0800 to +0.0200; within the seed noise)" in "\n".join(study_context(path, norm_path=None))

    path.write_text(json.dumps({"long": {"seeds": [0], "incomplete": ["long", "timing"]}}))
    assert "not complete yet (long, timing to run)" in "\n".join(study_context(path, norm_path=None))


def test_the_time_fraction_uses_the_trained_step_and_names_a_subnormal_slowdown():
    variants = list(lm_long.LONG_VARIANTS)
    init = dict.fromkeys(variants, 0.5)
    trained = dict.fromkeys(variants, 0.5) | {"diff": 1.0}  # DIFF V1's trained step: twice its fresh one
    flushed = dict.fromkeys(variants, 0.5)
    rounds = {"init": {v: [0.5] for v in variants}, "trained": {v: [trained[v]] for v in variants},
              "flushed": {v: [0.5] for v in variants}}  # fmt: skip
    machine = {"processor": "cpu", "cores": 2, "threads": 1, "device": "cpu", "torch": "2.x",
               "load_average_before": [0.1], "load_average_after": [0.2]}  # fmt: skip
    timing = {"seconds_per_step": init, "trained_seconds_per_step": trained, "flushed_seconds_per_step": flushed,
              "rounds": rounds, "machine": machine, "steps": 12, "warmup": 3, "repeats": 1}  # fmt: skip
    assert lm_long_report.step_seconds(timing, "diff") == 1.0
    assert lm_long_report.step_seconds({"seconds_per_step": init}, "diff") == 0.5  # a timing of fresh models only
    rows = {v: {"time_ratio": trained[v] / 0.5, "study_seconds_per_step": [0.6, 0.7]} for v in variants}
    result = {"variants": rows, "seeds": [0, 1, 2], "plan": {"batch_size": 8, "seq_len": 512}}
    text = "\n".join(lm_long_report._timing_markdown(result, timing))
    assert "| DIFF V1 | 0.500 (0.500) | 1.000 (1.000) | 0.500 (0.500) | 2.00x |" in text
    assert "DIFF V1's trained step takes 2.00 times as long as with them flushed" in text
    assert text.count("times as long") == 1  # the others are not slowed
