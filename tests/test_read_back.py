"""Every file the project reads back, damaged as a hand edit or another version would damage it: a field of the
wrong type, a missing field, an unknown field. The command that reads it exits 2 with one line naming the file (never
a traceback), and never trains on from what it misread: the run is left as it was. Which values are wrong is decided
here from the file as the project wrote it (a value of another JSON type than the one written), not by the schemas
under test."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from conftest import prepare_corpus, small_config, snapshot, write_corpus
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from difftransformer.apps.cli import main

pytestmark = pytest.mark.slow

# values of each JSON type but null (null is a valid value of several fields: it is not a wrong type)
OTHER_TYPES = {"bool": True, "str": "text", "number": 7, "list": [1], "object": {"a": 1}}


def _json_type(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "str", list: "list", dict: "object", type(None): "null"}[type(value)]


def _fields(value, path=()):
    """Every (path, value) inside a JSON object or list, objects' keys and lists' first items, depth first."""
    items = value.items() if isinstance(value, dict) else list(enumerate(value))[:1] if isinstance(value, list) else []
    for key, item in items:
        yield (*path, key), item
        yield from _fields(item, (*path, key))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A trained run (4 steps), its quantized copy, its data, and a complete bench context store."""
    from difftransformer.apps.bench import machine
    from difftransformer.inference.quantize import quantize_run
    from difftransformer.store.data import verify_data
    from difftransformer.training.loop import train

    root = tmp_path_factory.mktemp("read-back")
    corpus = write_corpus(root / "corpus")
    prepare_corpus(corpus, root / "data")
    verify_data(root / "data")
    train(small_config(root / "data", root / "run", max_steps=4, ckpt_interval=4, eval_interval=2), quiet=True)
    quantize_run(root / "run", "w8a16", root / "quant")
    rows = [
        {"kind": "prefill", "model": m, "seq": 64, "fits": True, "seconds": [0.01, 0.02], "repeats": 2,
         "peak_rss": 1 << 28, "rss_before": 1 << 27}
        for m in ("diff", "standard", "hf-diffllama")
    ]  # fmt: skip
    store = {
        "benchmark": "context", "machine": machine(), "device": "cpu", "dtype": "float32",
        "shapes": {"preset": "tiny", "batch": 1}, "repeats": 2, "rows": rows, "budget_bytes": 1 << 33,
    }  # fmt: skip
    (root / "bench").mkdir()
    (root / "bench" / "ctx.json").write_text(json.dumps(store, indent=1))
    return root


STATE = "run/checkpoints/step_00000004/state.json"
RESUME = "train --resume {w}/run --max-steps 5 --quiet"
GENERATE = "generate --run {w}/run --prompt x --max-new-tokens 1"
# file under the world: (the command that reads it back, the objects in it that take keys they do not know)
FILES = {
    # state.json: its top level (a caller's meta: save_run records what it is given), its param groups (a newer
    # PyTorch's settings) and the optimizer's scalars (an optimizer's own)
    STATE: (RESUME, {(), ("optimizer", "param_groups", 0), ("optimizer", "scalars")}),
    "run/metrics.jsonl": (RESUME, set()),
    "run/train_config.json": (RESUME, set()),
    "run/model_config.json": (GENERATE, set()),
    "run/tokenizer_spec.json": (GENERATE, set()),
    "data/manifest.json": ("data verify {w}/data", set()),
    "quant/quantization.json": (GENERATE.replace("/run", "/quant"), set()),
    "bench/ctx.json": ("bench context --json {w}/bench/ctx.json --seq 64 --kinds prefill --preset tiny", set()),
}


def _read(path: Path, name: str):
    if name.endswith(".jsonl"):
        return json.loads(path.read_text().splitlines()[1])  # a row (the second)
    return json.loads(path.read_text())


def _write(path: Path, name: str, data) -> None:
    if name.endswith(".jsonl"):
        lines = path.read_text().splitlines()
        lines[1] = json.dumps(data)
        path.write_text("\n".join(lines) + "\n")
        return
    if name == STATE:  # the digest recomputed as the trainer computes it, so that only the schema can refuse it
        data.pop("sha256", None)
        data["sha256"] = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
    path.write_text(json.dumps(data, indent=1))


def _set(data, path, value) -> None:
    for key in path[:-1]:
        data = data[key]
    if value is _DELETE:
        del data[path[-1]]
    else:
        data[path[-1]] = value


_DELETE = object()


@st.composite
def damage(draw, world):
    name = draw(st.sampled_from(sorted(FILES)))
    original = _read(world / name, name)
    # state.json's sha256 is recomputed after the damage; its train_config is a record compared with the run's
    # train_config.json but for what a resume may change (never read) and for the fields of other versions
    fields = [(p, v) for p, v in _fields(original) if not (name == STATE and p[0] in ("sha256", "train_config"))]
    how = draw(st.sampled_from(["wrong type", "unknown field", "missing field"]))
    if how == "unknown field":
        objects = [()] + [p for p, v in fields if isinstance(v, dict) and v]
        return name, how, (*draw(st.sampled_from(objects)), "added_by_hand"), 1
    if how == "wrong type":  # a field written as null may hold another type: its wrong ones are not known here
        fields = [(p, v) for p, v in fields if v is not None]
    path, value = draw(st.sampled_from(fields))
    if how == "missing field":
        return name, how, path, _DELETE if isinstance(path[-1], str) else []
    others = [v for t, v in OTHER_TYPES.items() if t != _json_type(value)]
    return name, how, path, draw(st.sampled_from(others))


def _run(world: Path, tmp_path: Path, name: str, path, value, capsys) -> tuple[int, str, bool]:
    """Damage a copy of the world's file, run its command; (exit code, stderr, whether the copy stayed unchanged)."""
    copy = tmp_path / "w"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(world, copy, symlinks=True)
    train_config = copy / "run" / "train_config.json"  # the copy's data is its own
    train_config.write_text(train_config.read_text().replace(str(world / "data"), str(copy / "data")))
    data = _read(copy / name, name)
    _set(data, path, value)
    _write(copy / name, name, data)
    before = snapshot(copy)
    capsys.readouterr()
    code = main(FILES[name][0].format(w=copy).split())
    noise = ("bench/ctx.png", "run/.lock", "data/.verified.json")  # a figure drawn again, a lock, a checksum cache
    after, before = ({k: v for k, v in s.items() if k not in noise} for s in (snapshot(copy), before))
    return code, capsys.readouterr().err.strip(), after == before


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_file_read_back_is_one_line_and_exit_2_never_a_traceback(world, tmp_path, capsys, data):
    name, how, path, value = data.draw(damage(world))
    code, err, unchanged = _run(world, tmp_path, name, path, value, capsys)
    where = (name, how, path, value, err)
    if how == "unknown field" and path[:-1] in FILES[name][1]:
        assert code == 0, where  # an open object: what it does not know is not read
        return
    if how == "missing field":  # a field that may be left out changes nothing; any other is refused
        assert code in (0, 2), where
    else:
        assert code == 2, where
    if code == 2:
        assert len(err.splitlines()) == 1 and err.startswith("difftx"), where
        assert Path(name).name in err, where
        assert unchanged, where  # nothing trained on, nothing written


@pytest.mark.parametrize("field", ["step", "optimizer", "rng_torch"])
def test_a_state_without_what_a_resume_needs_is_refused(world, tmp_path, capsys, field):
    code, err, unchanged = _run(world, tmp_path, STATE, (field,), _DELETE, capsys)
    assert code == 2 and "state.json" in err and unchanged, err


@pytest.mark.parametrize("file, dtype", [("model", "float16"), ("model", "int64"), ("optimizer", "bool")])
def test_a_checkpoint_tensor_stored_in_another_dtype_is_refused(world, tmp_path, capsys, file, dtype):
    """Only names and shapes were checked: a weight stored as int64 or float16 was cast (int64 truncated) without a
    word. The file's own digest and state.json's record of it are made to match, as a tool that rewrote it would."""
    import torch
    from safetensors.torch import load, save_file

    from difftransformer.store.checkpoint import tensors_digest

    def recast(path: Path) -> None:
        tensors = load(path.read_bytes())
        first = sorted(t for t in tensors if t.endswith("weight") or t.endswith("exp_avg"))[0]
        tensors[first] = tensors[first].to(getattr(torch, dtype))
        digest = tensors_digest(tensors)
        save_file(tensors, path, {"format": "pt", "sha256": digest})
        state = json.loads((path.parent / "state.json").read_text())
        state["files"][path.name] = digest
        _write(path.parent / "state.json", STATE, state)

    copy = tmp_path / "w"
    shutil.copytree(world, copy, symlinks=True)
    recast(copy / Path(STATE).parent / f"{file}.safetensors")
    before = snapshot(copy)
    command = RESUME if file == "optimizer" else GENERATE
    assert main(command.format(w=copy).split()) == 2
    err = capsys.readouterr().err.strip()
    said = f"is torch.{dtype} of shape" if file == "optimizer" else f"is stored as torch.{dtype}, the model holds"
    assert len(err.splitlines()) == 1 and said in err, err
    lock = "run/.lock"  # the run's lock file, whose holder's pid a resume writes
    assert {k: v for k, v in snapshot(copy).items() if k != lock} == {k: v for k, v in before.items() if k != lock}
