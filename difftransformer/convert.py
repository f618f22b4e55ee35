"""`difftx convert`: a run directory to a Hugging Face `save_pretrained` directory, and back.

The Hugging Face directory holds safetensors weights, the config of `DiffLlamaForCausalLM` (DIFF) or
`LlamaForCausalLM` (standard), and the tokenizer as a `PreTrainedTokenizerFast` (the byte tokenizer is exported
as an equivalent byte-level BPE without merges), so plain `transformers` loads it with no custom code. Both
directions write into a temporary directory that is renamed when complete; an existing output is never touched.
"""

from __future__ import annotations

from pathlib import Path

from difftransformer.checkpoint import save_checkpoint
from difftransformer.fsutil import write_new_dir
from difftransformer.hf import calibrate_subln, diff_from_standard, from_hf, to_hf
from difftransformer.runs import MODEL_CONFIG, load_run
from difftransformer.tokenizer import EOT, HF_FILE, HFTokenizer

ARCHITECTURES = ("DiffLlamaForCausalLM", "LlamaForCausalLM")


def run_to_hf(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the run's newest weights and its tokenizer as a Hugging Face directory."""
    from transformers import PreTrainedTokenizerFast

    model, tokenizer = load_run(run_dir)
    hf_model = to_hf(model)
    hf_model.config.eos_token_id = tokenizer.eot_id
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer.to_hf(), eos_token=EOT)

    def write(tmp: Path) -> None:
        hf_model.save_pretrained(tmp, safe_serialization=True)
        hf_tok.save_pretrained(tmp)

    return write_new_dir(out_dir, "output directory", write)


def _calibration_tokens(tokenizer, max_len: int, rows: int = 4, length: int = 256):
    """A few windows of the built-in corpus in the model's tokenizer, to calibrate a converted model."""
    import torch

    from difftransformer.corpus import pydocs_documents

    length = min(length, max_len)
    ids: list[int] = []
    for doc in pydocs_documents():
        ids += tokenizer.encode(doc)
        if len(ids) >= rows * length:
            break
    return torch.tensor(ids[: rows * length]).view(rows, length)


def hf_to_run(hf_dir: str | Path, out_dir: str | Path, attention: str | None = None) -> Path:
    """A run directory (config, a step-0 checkpoint, tokenizer) from a DiffLlama or Llama directory.

    ``attention="diff"`` with a Llama builds a DIFF model from it (``diff_from_standard``), its per-head norms
    calibrated on the built-in corpus; ``difftx train --init-from`` then trains it.
    """
    import json

    from transformers import AutoModelForCausalLM

    hf_dir = Path(hf_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{hf_dir} is not a Hugging Face model directory: config.json is missing")
    architectures = json.loads(config_path.read_text()).get("architectures") or []
    if not set(architectures) & set(ARCHITECTURES):
        raise ValueError(f"{hf_dir} holds {architectures or 'an unknown architecture'}; convert takes {ARCHITECTURES}")
    if not (hf_dir / HF_FILE).is_file():
        raise FileNotFoundError(f"{hf_dir} has no {HF_FILE}; the run needs the model's tokenizer")
    tokenizer = HFTokenizer.from_file(hf_dir / HF_FILE)
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"transformers could not load {hf_dir}: {err}") from None
    model = from_hf(hf_model)
    if attention == "diff" and model.config.attention != "diff":
        reference = model
        model = diff_from_standard(reference)
        calibrate_subln(model, reference, _calibration_tokens(tokenizer, model.config.max_seq_len))

    def write(tmp: Path) -> None:
        model.config.to_json(tmp / MODEL_CONFIG)
        tokenizer.save(tmp)
        meta = {"source": str(hf_dir), "model_config": model.config.to_dict()}
        save_checkpoint(tmp, 0, model.state_dict(), {"state": {}, "param_groups": []}, meta, keep_last=1)

    return write_new_dir(out_dir, "output directory", write)
