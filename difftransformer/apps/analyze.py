"""`difftx analyze attention`: a trained model's attention maps on a prompt, per head of one layer.

For a DIFF layer each head gets three panels: softmax map 1, softmax map 2, and the differential map
``map1 - lambda map2`` that mixes the values (signed, on a diverging scale); a standard layer shows each head's softmax
map. The input is a run directory: of ``difftx train`` (the prompt is UTF-8 text for its tokenizer) or one of the
models ``difftx repro`` saves under ``models/`` (the prompt is whitespace-separated token ids).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from difftransformer.apps.analysis import attention_maps
from difftransformer.errors import InputError
from difftransformer.fsutil import write_atomic
from difftransformer.paths import TEXT_LIMIT, read_bytes

MAX_LABELLED = 48  # positions up to which the axes are labelled with the tokens


def read_prompt(path: str | Path) -> str:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    try:
        text = read_bytes(path, TEXT_LIMIT, "prompt file").decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"prompt file {path} is not valid UTF-8 (byte {err.start}): save it as UTF-8") from None
    if not text.strip():
        raise InputError(f"prompt file {path} is empty")
    return text


def load_prompt(run: str | Path, prompt_file: str | Path) -> tuple[torch.nn.Module, torch.Tensor, list[str]]:
    """(model, tokens (1, T), token labels) for a run directory (an experiment's model reads token ids)."""
    from difftransformer.store.runs import load_run

    model, tokenizer = load_run(run)
    ids = tokenizer.encode(read_prompt(prompt_file))
    labels = [tokenizer.decode([i]) for i in ids]
    if len(ids) > model.config.max_seq_len:
        raise InputError(
            f"the prompt is {len(ids)} tokens, longer than the model's context of {model.config.max_seq_len}: "
            "shorten it"
        )
    return model, torch.tensor([ids]), labels


def analyze_attention(run: str | Path, prompt_file: str | Path, out: str | Path, layer: int = -1) -> Path:
    out = Path(out)
    if os.path.lexists(out):
        raise FileExistsError(f"{out} already exists; choose another `out` or remove it")
    if out.suffix.lower() != ".png":
        raise InputError(f"`out` must name a .png file, got {out}")
    model, tokens, labels = load_prompt(run, prompt_file)
    n_layers = len(model.layers)
    if not -n_layers <= layer < n_layers:
        raise InputError(f"`layer` {layer} is out of range: the model has {n_layers} layers")
    maps = attention_maps(model, tokens, both=True)[layer]
    figure = _figure(maps, labels, layer % n_layers, model.config.attention)
    out.parent.mkdir(parents=True, exist_ok=True)  # once the inputs are known good: a failed call creates nothing
    write_atomic(out, lambda tmp: figure.savefig(tmp, dpi=110))
    return out


def _figure(maps, labels: list[str], layer: int, attention: str):
    from difftransformer.apps.figures import pyplot

    plt = pyplot()
    heads = maps.mixed.shape[1]
    panels = [("map 1", 0), ("map 2", 1), (f"map 1 - {maps.lam:.2f} map 2", None)] if maps.softmax is not None else []
    cols = len(panels) or 1
    labelled = len(labels) <= MAX_LABELLED
    side = max(3.0, 0.17 * len(labels)) if labelled else 3.0  # about 12 points per token label
    fig, axes = plt.subplots(
        heads, cols, figsize=(side * cols + 1.2 * cols, side * heads + 0.8), squeeze=False, layout="constrained"
    )
    for h in range(heads):
        for c in range(cols):
            ax = axes[h][c]
            if panels and panels[c][1] is not None:
                image = maps.softmax[0, h, panels[c][1]].numpy()
                shown = ax.imshow(image, cmap="viridis", vmin=0, vmax=float(image.max()))
            else:
                image = maps.mixed[0, h].numpy()
                limit = float(abs(image).max())
                low = -limit if panels else 0
                shown = ax.imshow(image, cmap="RdBu_r" if panels else "viridis", vmin=low, vmax=limit)
            fig.colorbar(shown, ax=ax, shrink=0.8, label="attention weight")
            title = panels[c][0] if panels else "softmax map"
            ax.set_title(f"head {h}: {title}", fontsize=10)
            if labelled:
                names = [repr(t)[1:-1] for t in labels]
                ax.set_xticks(range(len(labels)), names, rotation=90, fontsize=8)
                ax.set_yticks(range(len(labels)), names, fontsize=8)
            ax.set_xlabel("key", fontsize=9)
            ax.set_ylabel("query", fontsize=9)
    what = "the two softmax maps and their difference (red above 0, blue below)" if panels else "the softmax maps"
    fig.suptitle(f"{attention} attention, layer {layer}: {what}", fontsize=12)
    return fig
