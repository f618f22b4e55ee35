"""Exports and imports across the supported transformers versions: 4.48 (the first with DiffLlama), 4.57 and the
pinned 5.x.

Every version that is installed takes part: this process's (the pinned one), and each interpreter that
DIFFTX_INTEROP_PYTHONS lists (comma-separated paths; `make test-interop` creates .venv-tf4.48 and .venv-tf4.57
and sets it, with DIFFTX_REQUIRE_INTEROP=1 so that a missing one fails instead of being left out). For every
pair (writer, reader) of versions: our runs exported by the writer load in the reader with plain transformers,
with the same prompt ids, logits within 1e-4, the same greedy tokens and the same stop (DIFF and standard models,
rope_theta 1e4 and 5e5, linear and llama3 rotary scaling). Llama-family checkpoints written by each version (their
own special tokens, two end tokens, scaled rotary embedding) import with `difftx convert --from-hf` and compute
what transformers computes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from conftest import optional

from difftransformer import ModelConfig, TransformerLM, generate, load_run
from difftransformer.apps.cli import main
from difftransformer.store.runs import save_run
from difftransformer.store.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "interop" / "check.py"
transformers = optional("transformers")  # before check.py, which imports it
sys.path.insert(0, str(CHECK.parent))
from check import PROMPT  # noqa: E402

TOL = 1e-4
NEW_TOKENS = 24
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {  # name: ModelConfig overrides of a 2-layer tiny model with 4 key/value heads (GQA)
    "diff-theta1e4": dict(attention="diff"),
    "diff-theta5e5": dict(attention="diff", rope_theta=5e5),
    "standard-theta1e4": dict(attention="standard"),
    "standard-theta5e5": dict(attention="standard", rope_theta=5e5),
    "diff-linear": dict(attention="diff", rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "standard-llama3": dict(attention="standard", rope_theta=5e5, rope_scaling=LLAMA3),
}
TOKENS = [(7 * i + 3) % 257 for i in range(100)]  # 100 positions: beyond the llama3 case's original 64


def other_pythons() -> list[str]:
    listed = os.environ.get("DIFFTX_INTEROP_PYTHONS", "")
    return [p for p in listed.split(",") if p]


@cache
def version_of(python: str) -> str:
    if python == sys.executable:
        return transformers.__version__
    proc = subprocess.run(
        [python, "-c", "import transformers; print(transformers.__version__)"], capture_output=True, text=True
    )
    assert proc.returncode == 0, f"{python} cannot import transformers: {proc.stderr[-2000:]}"
    return proc.stdout.strip()


def run_check(python: str, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([python, str(CHECK), *args], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"{python} {args[0]} failed:\n{proc.stderr[-4000:]}"


def test_requested_versions_are_there():
    if os.environ.get("DIFFTX_REQUIRE_INTEROP") == "1":
        assert other_pythons(), "DIFFTX_REQUIRE_INTEROP=1 but DIFFTX_INTEROP_PYTHONS lists no interpreter"
    versions = [version_of(p) for p in other_pythons()]
    assert len(set(versions + [transformers.__version__])) == len(versions) + 1, versions


def plant_stop(model: TransformerLM, prompt: list[int], eot: int) -> None:
    """Make greedy generation end on ``eot`` after a few tokens: its output row becomes 1.05 x the row of the token
    chosen at some step k (k from 4 up, the first that stops the generation between 3 and 12 tokens)."""
    free = generate(model, prompt, 16, temperature=0)
    original = model.lm_head.weight[eot].clone()
    for k in range(4, 16):
        with torch.no_grad():
            model.lm_head.weight[eot] = 1.05 * model.lm_head.weight[free[k]]
        if 3 <= len(generate(model, prompt, NEW_TOKENS, temperature=0, stop_tokens=[eot])) < 12:
            return
    with torch.no_grad():
        model.lm_head.weight[eot] = original
    raise AssertionError("no step k makes the greedy generation stop early")


def our_outputs(run: Path) -> dict:
    model, tok = load_run(run)
    prompt = tok.encode_prompt(PROMPT)
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS]))[0]
    return {
        "prompt_ids": prompt,
        "logits": logits,
        "generated": generate(model, prompt, NEW_TOKENS, temperature=0, stop_tokens=tok.stop_ids),
        "stops": tok.stop_ids,
    }


def compare(ours: dict, theirs: dict) -> dict:
    """The matrix row of one (case, writer, reader): logit error, greedy agreement, and where each stops."""
    hf = theirs["generated"]
    stopped = len(hf) < NEW_TOKENS or (hf and hf[-1] in ours["stops"])
    hf_kept = hf[:-1] if stopped and hf and hf[-1] in ours["stops"] else hf
    mine = ours["generated"]
    agree = sum(a == b for a, b in zip(mine, hf_kept, strict=False)) / max(len(mine), len(hf_kept), 1)
    return {
        "prompt_ids_equal": ours["prompt_ids"] == theirs["prompt_ids"],
        "logit_error": (ours["logits"] - torch.tensor(theirs["logits"])).abs().max().item(),
        "token_agreement": agree,
        "ours_stops_at": len(mine) if len(mine) < NEW_TOKENS else None,
        "hf_stops_at": len(hf_kept) if stopped else None,
    }


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict:
    """Our runs, exported by every version and read by every version: {(case, writer, reader): row}."""
    root = tmp_path_factory.mktemp("interop")
    pythons = [sys.executable, *other_pythons()]
    references = {}
    for name, overrides in CASES.items():
        torch.manual_seed(0)
        config = ModelConfig.preset("tiny", n_layers=2, n_kv_heads=4, vocab_size=257, **overrides)
        model = TransformerLM(config).eval()
        with torch.no_grad():
            for block in model.layers:
                if config.attention == "diff":
                    for p in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                        getattr(block.attn, p).normal_(0, 0.3)
                    block.attn.subln.weight.uniform_(0.5, 1.5)
        plant_stop(model, ByteTokenizer().encode(PROMPT), ByteTokenizer().eot_id)
        save_run(model, ByteTokenizer(), root / "runs" / name, {})
        references[name] = our_outputs(root / "runs" / name)
        assert references[name]["generated"] and len(references[name]["generated"]) < NEW_TOKENS, name
    dirs = {}
    for python in pythons:
        writer = version_of(python)
        jobs = [{"run": str(root / "runs" / c), "out": str(root / "hf" / writer / c)} for c in CASES]
        (root / f"export-{writer}.json").write_text(json.dumps(jobs))
        run_check(python, "export", str(root / f"export-{writer}.json"))
        dirs |= {f"{c}|{writer}": job["out"] for c, job in zip(CASES, jobs, strict=True)}
    rows = {}
    for python in pythons:
        reader = version_of(python)
        spec = root / f"read-{reader}.json"
        spec.write_text(json.dumps({"dirs": dirs, "tokens": TOKENS, "new_tokens": NEW_TOKENS}))
        run_check(python, "read", str(spec), str(root / f"out-{reader}.json"))
        for key, theirs in json.loads((root / f"out-{reader}.json").read_text()).items():
            case, writer = key.split("|")
            rows[case, writer, reader] = compare(references[case], theirs) | {"architecture": theirs["architecture"]}
    report = os.environ.get("DIFFTX_INTEROP_REPORT")
    if report:
        write_report(Path(report), rows)
    return rows


def write_report(path: Path, rows: dict) -> None:
    lines = [
        "| case | written by | read by | logit error | prompt ids | greedy agreement | ours stops at | HF stops at |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (case, writer, reader), r in sorted(rows.items()):
        lines.append(
            f"| {case} | {writer} | {reader} | {r['logit_error']:.1e} | {'same' if r['prompt_ids_equal'] else 'DIFFER'}"
            f" | {r['token_agreement']:.0%} | {r['ours_stops_at']} | {r['hf_stops_at']} |"
        )
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.slow
def test_every_export_loads_and_matches_in_every_version(matrix):
    assert len(matrix) == len(CASES) * (1 + len(other_pythons())) ** 2
    for (case, writer, reader), row in matrix.items():
        where = f"{case} written by {writer}, read by {reader}"
        assert row["architecture"] == ("DiffLlamaForCausalLM" if case.startswith("diff") else "LlamaForCausalLM")
        assert row["prompt_ids_equal"], where
        assert row["logit_error"] < TOL, (where, row)
        assert row["token_agreement"] == 1.0, (where, row)
        assert row["ours_stops_at"] is not None and row["hf_stops_at"] == row["ours_stops_at"], (where, row)


@pytest.fixture(scope="module")
def llamas(tmp_path_factory) -> dict:
    """Llama-family checkpoints written by every installed version, with transformers' own outputs on them."""
    root = tmp_path_factory.mktemp("llamas")
    found = {}
    for python in [sys.executable, *other_pythons()]:
        out = root / f"{version_of(python)}.json"
        run_check(python, "llama", str(root), str(out))
        found |= {f"{name}|{version_of(python)}": item for name, item in json.loads(out.read_text()).items()}
    return found


@pytest.mark.slow
def test_llama_family_checkpoints_import_with_their_tokens_and_scaling(llamas, tmp_path, capsys):
    assert len(llamas) == 2 * (1 + len(other_pythons()))
    reported = []
    for key, hf in sorted(llamas.items()):
        out = tmp_path / key.replace("|", "-")
        assert main(["convert", "--from-hf", hf["dir"], "--out", str(out)]) == 0, capsys.readouterr().err
        model, tok = load_run(out)
        assert model.config.rope_scaling is not None and model.config.rope_scaling["rope_type"] in key
        prompt = tok.encode_prompt(PROMPT)
        assert prompt == hf["prompt_ids"] and prompt[0] == tok.bos_id, key  # the begin-of-text token, as HF adds
        with torch.no_grad():
            error = (model(torch.tensor([hf["tokens"]]))[0] - torch.tensor(hf["logits"])).abs().max().item()
        assert error < TOL, (key, error)
        ours = generate(model, prompt, NEW_TOKENS, temperature=0, stop_tokens=tok.stop_ids)
        assert len(hf["generated"]) < NEW_TOKENS and hf["generated"][-1] in tok.stop_ids, key  # it did stop
        assert ours == hf["generated"][:-1], key
        reported.append(f"| {key.replace('|', ' | ')} | {error:.1e} | {len(ours)} | {len(hf['generated']) - 1} |")
    if os.environ.get("DIFFTX_INTEROP_REPORT"):
        with open(os.environ["DIFFTX_INTEROP_REPORT"], "a") as f:
            f.write("\n| Llama checkpoint | written by | logit error | ours stops at | HF stops at |\n")
            f.write("|---|---|---|---|---|\n" + "\n".join(reported) + "\n")
