"""Loading a trained model from a run directory (written by `difftx train`)."""

from __future__ import annotations

from pathlib import Path

import torch

from difftransformer.checkpoint import list_checkpoints, load_model_tensors
from difftransformer.config import ModelConfig
from difftransformer.model import TransformerLM
from difftransformer.tokenizer import Tokenizer, load_tokenizer

MODEL_CONFIG = "model_config.json"


def load_run(run_dir: str | Path, device: str | torch.device = "cpu") -> tuple[TransformerLM, Tokenizer]:
    """(model in eval mode with the newest checkpoint's weights, tokenizer) of a run directory."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"run directory {run} does not exist")
    if not (run / MODEL_CONFIG).is_file():
        raise FileNotFoundError(f"{run} is not a run directory: {MODEL_CONFIG} is missing")
    config = ModelConfig.from_json(run / MODEL_CONFIG)
    checkpoints = list_checkpoints(run)
    if not checkpoints:
        raise FileNotFoundError(f"{run} has no checkpoint (checkpoints/step_*/model.safetensors)")
    tensors = load_model_tensors(checkpoints[-1])
    with torch.device("meta"):
        model = TransformerLM(config)
    try:
        model.load_state_dict(tensors, strict=True, assign=True)
    except RuntimeError as err:
        raise ValueError(
            f"{checkpoints[-1] / 'model.safetensors'} does not match {run / MODEL_CONFIG}: {str(err).splitlines()[0]}"
            f" ... ({_first_mismatch(model, tensors)})"
        ) from None
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.to(device).eval(), load_tokenizer(run)


def _first_mismatch(model: TransformerLM, tensors: dict[str, torch.Tensor]) -> str:
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for name, shape in expected.items():
        if name not in tensors:
            return f"missing {name}"
        if tuple(tensors[name].shape) != shape:
            return f"{name} has shape {tuple(tensors[name].shape)}, the config needs {shape}"
    extra = sorted(set(tensors) - set(expected))
    return f"unexpected {extra[0]}" if extra else "dtype mismatch"
