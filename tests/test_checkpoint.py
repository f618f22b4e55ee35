"""Checkpoints on their own: round trip, pruning, digests, and the tidying of killed writes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from difftransformer.errors import InputError
from difftransformer.store.checkpoint import (
    clean_stale,
    is_calm,
    list_checkpoints,
    load_checkpoint,
    newest_calm,
    save_checkpoint,
)


def _states():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    names = [name for name, _ in model.named_parameters()]  # the name-keyed format the training loop saves
    state = optimizer.state_dict()
    return model.state_dict(), {
        "state": {names[i]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def test_a_checkpoint_round_trips_bit_exactly(tmp_path):
    model_state, optim_state = _states()
    path = save_checkpoint(tmp_path, 7, model_state, optim_state, {"note": "x"})
    assert path.name == "step_00000007"
    model, optim, meta = load_checkpoint(path)
    assert model.keys() == model_state.keys() and all(torch.equal(model[k], model_state[k]) for k in model)
    assert meta["step"] == 7 and meta["note"] == "x"
    for key, value in optim_state["state"]["weight"].items():
        assert torch.equal(optim["state"]["weight"][key], value)
    assert optim["param_groups"] == json.loads(json.dumps(optim_state["param_groups"]))  # JSON: tuples as lists


def test_only_the_newest_keep_last_checkpoints_remain(tmp_path):
    model_state, optim_state = _states()
    for step in (2, 4, 6, 8):
        save_checkpoint(tmp_path, step, model_state, optim_state, {}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000006", "step_00000008"]
    save_checkpoint(tmp_path, 8, model_state, optim_state, {}, keep_last=0)  # the same step again: swapped in place
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000006", "step_00000008"]


@pytest.mark.parametrize("damaged", ["model.safetensors", "optimizer.safetensors", "state.json"])
def test_a_changed_byte_is_refused_with_the_way_out(tmp_path, damaged):
    model_state, optim_state = _states()
    path = save_checkpoint(tmp_path, 1, model_state, optim_state, {"note": "abc"})
    data = bytearray((path / damaged).read_bytes())
    index = data.rfind(b"abc") if damaged == "state.json" else len(data) - 1  # a value, not the syntax
    data[index] ^= 0x01
    (path / damaged).write_bytes(bytes(data))
    with pytest.raises(InputError, match=rf"{damaged} does not match its checksum.*mv .*step_00000001 .*damaged-"):
        load_checkpoint(path)


def test_a_damaged_checksum_field_name_is_refused_not_read_as_an_old_checkpoint(tmp_path):
    """One flipped bit turns "sha256" into "sh`256": the state then looks like one written before checksums, and
    was loaded unchecked (found by the property test). A state with a files entry always had its digest."""
    model_state, optim_state = _states()
    path = save_checkpoint(tmp_path, 1, model_state, optim_state, {"note": "abc"})
    state = path / "state.json"
    state.write_bytes(state.read_bytes().replace(b'"sha256"', b'"sh`256"'))
    with pytest.raises(InputError, match=r"state.json has lost its checksum field: the file is damaged.*mv "):
        load_checkpoint(path)


def test_a_missing_file_is_named(tmp_path):
    model_state, optim_state = _states()
    path = save_checkpoint(tmp_path, 1, model_state, optim_state, {})
    (path / "optimizer.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="is incomplete: optimizer.safetensors is missing"):
        load_checkpoint(path)


def test_killed_writes_are_removed_and_an_interrupted_swap_restored(tmp_path):
    model_state, optim_state = _states()
    path = save_checkpoint(tmp_path, 3, model_state, optim_state, {})
    root = path.parent
    (root / f".tmp-step_00000004-{os.getpid()}").mkdir()  # a write killed before its rename
    path.rename(root / f".old-step_00000003-{os.getpid()}")  # a swap killed between its two renames
    done = clean_stale(tmp_path)
    assert len(done) == 2 and any("restored" in line for line in done)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003"]
    assert load_checkpoint(root / "step_00000003")[2]["step"] == 3


def test_keep_last_keeps_the_newest_calm_checkpoint_while_every_newer_one_is_spiked(tmp_path):
    """A run whose loss spiked: keep-last 2 would keep only checkpoints written during the spike; the newest one from
    before it stays too (one more on disk), and goes once a calm checkpoint is kept again."""
    model_state, optim_state = _states()

    def save(step, calm):
        save_checkpoint(tmp_path, step, model_state, optim_state, {"health": {"calm": calm}}, keep_last=2)
        return [p.name[-2:] for p in list_checkpoints(tmp_path)]

    assert save(2, True) == ["02"]
    assert save(4, True) == ["02", "04"]
    assert save(6, False) == ["04", "06"]
    assert save(8, False) == ["04", "06", "08"]  # plain keep-last would delete 04, the last calm one
    assert save(10, False) == ["04", "08", "10"]
    assert save(12, True) == ["10", "12"]
    assert newest_calm(tmp_path).name == "step_00000012"


def test_a_checkpoint_without_a_health_record_counts_as_calm(tmp_path):
    """Checkpoints written before the record existed are pruned as they always were."""
    model_state, optim_state = _states()
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, model_state, optim_state, {}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000006"]
    assert is_calm(list_checkpoints(tmp_path)[-1])


def test_a_swapped_optimizer_file_is_said_once(tmp_path):
    """Another checkpoint's optimizer.safetensors under this one's state.json: one message with one piece of advice
    (it once nested the InputError's repr in another message and repeated the advice)."""
    import shutil

    model = {"w": torch.ones(2, 2)}
    for step, value in ((2, 1.0), (4, 2.0)):
        optim = {
            "state": {"w": {"exp_avg": torch.full((2, 2), value), "step": step}},
            "param_groups": [{"lr": 0.1, "params": ["w"]}],
        }
        save_checkpoint(tmp_path, step, model, optim, {}, keep_last=0)
    first, second = list_checkpoints(tmp_path)
    shutil.copy(first / "optimizer.safetensors", second / "optimizer.safetensors")
    with pytest.raises(InputError) as caught:
        load_checkpoint(second)
    message = str(caught.value)
    assert "optimizer.safetensors is not the file" in message and "InputError(" not in message
    assert message.count("move the checkpoint away") == 1


def test_loaded_tensors_do_not_keep_their_file_mapped(tmp_path):
    """After a resume the optimizer held tensors that mapped optimizer.safetensors: once keep-last deleted the
    checkpoint its disk space stayed in use until the process ended."""
    optim = {
        "state": {"w": {"exp_avg": torch.randn(256, 256), "step": 1}},
        "param_groups": [{"lr": 0.1, "params": ["w"]}],
    }
    path = save_checkpoint(tmp_path, 1, {"w": torch.randn(256, 256)}, optim, {}, keep_last=0)
    model, optim_sd, _ = load_checkpoint(path)
    maps = open(f"/proc/{os.getpid()}/maps").read()
    assert str(path) not in maps, "a checkpoint file is still mapped"
    assert model["w"].shape == (256, 256) and optim_sd["state"]["w"]["exp_avg"].shape == (256, 256)


def test_a_file_where_a_checkpoint_goes_is_left_as_it_is_and_the_write_refused(tmp_path):
    """A regular file at RUN/checkpoints/step_N: the save once renamed it to a hidden .old- file and failed with
    ENOTDIR, and the next resume said it removed that file, which stayed. Now the file is kept, nothing of the write
    is left, and a resume names it before it trains (refuse_foreign_checkpoints)."""
    from difftransformer.store.checkpoint import refuse_foreign_checkpoints

    model_state, optim_state = _states()
    save_checkpoint(tmp_path, 3, model_state, optim_state, {})
    root = tmp_path / "checkpoints"
    (root / "step_00000004").write_text("a user's notes")
    with pytest.raises(InputError, match=r"step_00000004 is not a checkpoint directory \(a file or a link"):
        save_checkpoint(tmp_path, 4, model_state, optim_state, {})
    assert sorted(p.name for p in root.iterdir()) == ["step_00000003", "step_00000004"]
    assert (root / "step_00000004").read_text() == "a user's notes"
    with pytest.raises(InputError, match=r"step_00000004 is not a checkpoint \(a file or a link, where training"):
        refuse_foreign_checkpoints(tmp_path)
    (root / f".old-step_00000003-{os.getpid()}").write_text("not a folder")
    assert clean_stale(tmp_path) == []  # the trainer writes folders only: a file is never said to be removed
    assert (root / f".old-step_00000003-{os.getpid()}").read_text() == "not a folder"
