"""`difftx convert`: a run directory to a Hugging Face `save_pretrained` directory, and back.

The Hugging Face directory holds safetensors weights, the config of `DiffLlamaForCausalLM` (DIFF) or
`LlamaForCausalLM` (standard), and the tokenizer as a `PreTrainedTokenizerFast` (the byte tokenizer is exported
as an equivalent byte-level BPE without merges), so plain `transformers` loads it with no custom code. Both
directions write into a temporary directory that is renamed when complete; an existing output is never touched.

An export loads the same in every supported transformers (4.48, the first with DiffLlama, to 5.x), whichever of
them wrote it: config.json carries the rotary settings in both spellings (``rope_theta``/``rope_scaling`` and
``rope_parameters``), the tokenizer is saved under a class name every version knows, and the end, begin and
padding tokens agree in the model config, the generation config and the tokenizer, so ``generate()`` stops where
``difftx generate`` stops. An import keeps the model's own special tokens (a Llama's ``</s>`` or
``<|end_of_text|>``, its begin-of-text token) and its rotary scaling (linear, llama3).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from difftransformer.errors import InputError
from difftransformer.fsutil import read_json_object, write_new_dir, write_text_atomic
from difftransformer.interop.hf import calibrate_subln, diff_from_standard, from_hf, rope_entries, to_hf
from difftransformer.interop.model_card import CARD, model_card, training_record
from difftransformer.store.checkpoint import PREFIX, list_checkpoints
from difftransformer.store.runs import load_run, run_and_checkpoint, save_run
from difftransformer.store.tokenizer import EOT, HF_FILE, ByteTokenizer, HFTokenizer, read_tokenizer_file
from difftransformer.store.weights_file import check_header

ARCHITECTURES = ("DiffLlamaForCausalLM", "LlamaForCausalLM")


def run_to_hf(
    run_dir: str | Path, out_dir: str | Path, license: str | None = None, datasets: list[str] | None = None
) -> Path:
    """Write a run's weights and tokenizer as a Hugging Face directory that plain ``transformers`` loads, with a
    model card (README.md) stating the run's numbers: ``difftx convert --to hf``.

    Args:
        run_dir: a run directory (its newest checkpoint) or one checkpoint of a run.
        out_dir: the new directory.
        license: the license for the model card's front matter (a Hub id, e.g. ``mit``).
        datasets: Hub dataset ids the model was trained on, for the front matter.

    Returns:
        ``out_dir``.

    Examples:
        >>> from difftransformer.store.examples import example_run
        >>> run = example_run()  # an untrained tiny DIFF model's run, in a new temporary directory
        >>> hf = run_to_hf(run, f"{run}-hf", license="mit")
        >>> sorted(p.name for p in hf.iterdir())[:3]
        ['README.md', 'config.json', 'generation_config.json']
    """
    from transformers import PreTrainedTokenizerFast

    model, tokenizer = load_run(run_dir)
    run, checkpoint = run_and_checkpoint(run_dir)
    step = int((checkpoint or list_checkpoints(run)[-1]).name.removeprefix(PREFIX))
    stops = tokenizer.stop_ids
    hf_model = to_hf(
        model,
        eos_token_id=stops[0] if len(stops) == 1 else list(stops),
        bos_token_id=tokenizer.bos_id,
        pad_token_id=tokenizer.eot_id,
    )
    eot = getattr(tokenizer, "eot", EOT)
    special = {"eos_token": eot, "pad_token": eot}
    if tokenizer.bos_id is not None:
        special["bos_token"] = tokenizer.bos
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer.to_hf(), **special)

    architecture = type(hf_model).__name__
    params = hf_model.num_parameters()
    embeddings = {id(m.weight): m.weight.numel() for m in (hf_model.get_input_embeddings(), hf_model.lm_head)}
    record = training_record(run, step)
    card = model_card(model, architecture, (params, params - sum(embeddings.values())), record, Path(out_dir).name,
                      license, datasets)  # fmt: skip

    def write(tmp: Path) -> None:
        hf_model.save_pretrained(tmp, safe_serialization=True)
        hf_tok.save_pretrained(tmp)
        _portable(tmp, model.config)
        (tmp / CARD).write_text(card)

    write_new_dir(out_dir, "output directory", write)
    return Path(out_dir)


def _portable(hf_dir: Path, config) -> None:
    """Make what save_pretrained wrote readable by every supported transformers version."""
    model_config = read_json_object(hf_dir / "config.json")
    model_config.update(rope_entries(config.rope_theta, config.rope_scaling))
    write_text_atomic(hf_dir / "config.json", json.dumps(model_config, indent=2) + "\n")
    tok_config = read_json_object(hf_dir / "tokenizer_config.json")
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # 5.x writes TokenizersBackend, unknown to 4.x
    tok_config["model_input_names"] = ["input_ids", "attention_mask"]  # 4.x adds token_type_ids, which generate refuses
    write_text_atomic(hf_dir / "tokenizer_config.json", json.dumps(tok_config, indent=2) + "\n")


def _calibration_tokens(tokenizer, max_len: int, rows: int = 4, length: int = 256):
    """A few windows of the built-in corpus in the model's tokenizer, to calibrate a converted model."""
    import torch

    from difftransformer.store.corpus import pydocs_documents

    length = min(length, max_len)
    ids: list[int] = []
    for doc in pydocs_documents():
        ids += tokenizer.encode(doc)
        if len(ids) >= rows * length:
            break
    return torch.tensor(ids[: rows * length]).view(rows, length)


def hf_to_run(hf_dir: str | Path, out_dir: str | Path, attention: str | None = None) -> Path:
    """A run directory (config, a step-0 checkpoint, tokenizer) from a DiffLlama or Llama directory:
    ``difftx convert --from-hf``.

    ``attention="diff"`` with a Llama builds a DIFF model from it (``diff_from_standard``), its per-head norms
    calibrated on the built-in corpus; ``difftx train --init-from`` then trains it.

    Args:
        hf_dir: a ``save_pretrained`` directory of a DiffLlama or Llama model with its tokenizer.
        out_dir: the new run directory.
        attention: ``diff`` to turn a Llama into a DIFF model; None keeps the architecture.

    Returns:
        ``out_dir``.

    Examples:
        >>> from difftransformer.store.examples import example_run
        >>> run = example_run()  # an untrained tiny DIFF model's run, in a new temporary directory
        >>> back = hf_to_run(run_to_hf(run, f"{run}-hf"), f"{run}-back")
        >>> (back / "model_config.json").is_file()
        True
    """
    from transformers import AutoModelForCausalLM

    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{hf_dir} is not a Hugging Face model directory: config.json is missing")
    hf_config = read_json_object(config_path)
    architectures = hf_config.get("architectures") or []
    if not isinstance(architectures, list) or not set(architectures) & set(ARCHITECTURES):
        raise InputError(f"{hf_dir} holds {architectures or 'an unknown architecture'}; convert takes {ARCHITECTURES}")
    if not (hf_dir / HF_FILE).is_file():
        raise FileNotFoundError(f"{hf_dir} has no {HF_FILE}; the run needs the model's tokenizer")
    tokenizer = _imported_tokenizer(hf_dir, hf_config)
    if not any(hf_dir.glob("*.safetensors")):
        pickled = sorted(p.name for p in hf_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"))
        raise InputError(
            f"{hf_dir} has no .safetensors weights"
            + (f" ({pickled[0]} is a pickle, which is never loaded: unpickling can run code)" if pickled else "")
            + "; save the model with save_pretrained(..., safe_serialization=True), where you trust it, and convert "
            "that directory"
        )
    stored: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):  # checked before transformers reads them
        stored.update(check_header(file, "save the model again (save_pretrained) or copy the directory again"))
    _check_config_against_weights(hf_config, stored, hf_dir)
    try:  # never the directory's own code (an auto_map in its config): only the architectures above
        hf_model = AutoModelForCausalLM.from_pretrained(
            hf_dir, local_files_only=True, use_safetensors=True, trust_remote_code=False
        )
    except Exception as err:  # transformers reads files from elsewhere: a failure is the directory's
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise InputError(f"transformers could not load {hf_dir}: {type(err).__name__}: {first}") from None
    _check_loaded(hf_model, stored, hf_dir)
    model = from_hf(hf_model)
    if attention == "diff" and model.config.attention != "diff":
        reference = model
        model = diff_from_standard(reference)
        calibrate_subln(model, reference, _calibration_tokens(tokenizer, model.config.max_seq_len))
    return save_run(model, tokenizer, out_dir, {"source": str(hf_dir.resolve())})


def _check_config_against_weights(hf_config: dict, stored: dict, hf_dir: Path) -> None:
    """config.json's sizes (layers, width, vocabulary, MLP width) against the weights' headers, before transformers
    builds the model that config.json describes: a config saying 60000 layers over the weights of 6 had it build for
    minutes before anything was compared."""
    fix = "config.json is not the one these weights were saved with: put the right one back"
    sizes = {}
    for key in ("num_hidden_layers", "hidden_size", "vocab_size", "intermediate_size"):
        value = hf_config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"{hf_dir / 'config.json'}: {key} must be a positive integer, got {value!r}")
        sizes[key] = value
    parts = [name.split(".") for name in stored if name.startswith("model.layers.")]
    layers = {int(p[2]) for p in parts if p[2].isdigit()}
    if layers != set(range(sizes["num_hidden_layers"])):
        held = f"layers 0 to {max(layers)}" if layers and layers == set(range(len(layers))) else f"{len(layers)} layers"
        said = sizes["num_hidden_layers"]
        raise InputError(f"{hf_dir}: config.json says {said} layers, the weights hold {held}; {fix}")
    expected = {
        "model.embed_tokens.weight": (sizes["vocab_size"], sizes["hidden_size"]),
        "model.layers.0.mlp.gate_proj.weight": (sizes["intermediate_size"], sizes["hidden_size"]),
    }
    for name, shape in expected.items():
        if name in stored and stored[name][1] != shape:
            raise InputError(f"{hf_dir}: {name} has shape {stored[name][1]}, config.json implies {shape}; {fix}")


def _check_loaded(hf_model, stored: dict, hf_dir: Path) -> None:
    """Every weight transformers built came from the files, with the file's shape, and is finite: transformers starts
    a weight its files lack at random with only a warning, and a model that diverged would import without a word."""
    tied = bool(getattr(hf_model.config, "tie_word_embeddings", False))
    for name, tensor in hf_model.state_dict().items():
        if name not in stored:
            if tied and name == "lm_head.weight":
                continue
            raise InputError(
                f"{hf_dir} has no weights for {name} (transformers would start it at random): the files are "
                "incomplete or of another model"
            )
        if tuple(tensor.shape) != stored[name][1]:
            raise InputError(f"{hf_dir}: {name} has shape {stored[name][1]}, its config needs {tuple(tensor.shape)}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise InputError(
                f"{hf_dir}: {name} holds values that are not finite (NaN or infinity): the model had diverged when it "
                "was saved; convert an earlier checkpoint of it"
            )


def _imported_tokenizer(hf_dir: Path, hf_config: dict) -> HFTokenizer | ByteTokenizer:
    """The directory's tokenizer.json with the model's special tokens.

    The end-of-text token is the model config's (first) ``eos_token_id``, else the generation config's; the
    generation config's other end ids stop generation too when they are special tokens (Llama 3's ``<|eot_id|>``),
    and so does the begin-of-text id (``bos_token_id``): ids of ordinary tokens there are left out, as exports of
    earlier versions of this library wrote Llama's default ids 1 and 2 into them. Without end ids,
    ``<|endoftext|>``."""
    generation_path = hf_dir / "generation_config.json"
    generation = read_json_object(generation_path) if generation_path.is_file() else {}
    tok = read_tokenizer_file(hf_dir / HF_FILE)
    special_ids = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}

    def ids(value) -> list[int]:
        values = value if isinstance(value, list) else [] if value is None else [value]
        for i in values:
            if not isinstance(i, int) or isinstance(i, bool) or tok.id_to_token(i) is None:
                raise InputError(f"{hf_dir}: the special token id {i!r} is not in {HF_FILE}")
        return values

    own, listed = ids(hf_config.get("eos_token_id")), ids(generation.get("eos_token_id"))
    ends = own[:1] or listed[:1]
    for i in own[1:] + listed:  # each once, in order
        if i not in ends and i in special_ids:
            ends.append(i)
    bos = [i for i in ids(hf_config.get("bos_token_id", generation.get("bos_token_id"))) if i in special_ids]
    special = {
        "eot": tok.id_to_token(ends[0]) if ends else EOT,
        "stop": [tok.id_to_token(i) for i in ends[1:]],
        "bos": tok.id_to_token(bos[0]) if bos else None,
    }
    if special == {"eot": EOT, "stop": [], "bos": None} and _is_exported_byte_tokenizer(tok):
        return ByteTokenizer()  # our own byte tokenizer, back from an export: same ids, same fingerprint
    return HFTokenizer(tok, str(hf_dir / HF_FILE), **special)


def _is_exported_byte_tokenizer(tok) -> bool:
    """Whether ``tok`` is ByteTokenizer.to_hf() as save_pretrained wrote it (same model, vocabulary and tokens)."""
    ours = ByteTokenizer().to_hf()
    theirs, mine = json.loads(tok.to_str()), json.loads(ours.to_str())
    return theirs["model"] == mine["model"] and tok.get_vocab(True) == ours.get_vocab(True)
