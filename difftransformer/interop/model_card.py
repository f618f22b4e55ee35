"""The model card (README.md) of a Hugging Face export: YAML front matter in the Hub's format, then what the model is
(architecture, DIFF heads, lambda per layer, parameters), what it was trained on and how far (from the run's
train_config.json, its checkpoint and metrics.jsonl), how to load it, and the paper to cite.

What the run does not record is said to be unknown, never guessed: a run imported from Hugging Face or saved by an
experiment has no training record. No machine path is written: the data is named by its directory's name and its
sources by their file names.
"""

from __future__ import annotations

from pathlib import Path

import torch

from difftransformer.core.model import TransformerLM
from difftransformer.fsutil import read_json_object, shell
from difftransformer.schema import ANY, NUMBER, check
from difftransformer.store.data import read_manifest
from difftransformer.store.runs import TRAIN_CONFIG, read_metrics

CARD = "README.md"
# what the card reads of train_config.json (schema.py's notation; TrainConfig checks the whole file where a run
# resumes, and the export does not import the training code)
RECIPE = {
    "data": str,
    "batch_size": int,
    "seq_len": (int, None),
    "lr": NUMBER,
    "betas": [NUMBER],
    "weight_decay": NUMBER,
    "warmup_steps": (int, None),
    "seed": int,
    "*": ANY,
}
PAPER = "https://arxiv.org/abs/2410.05258"
CITATION = """@inproceedings{ye2025differential,
  title     = {Differential Transformer},
  author    = {Ye, Tianzhu and Dong, Li and Xia, Yuqing and Sun, Yutao and Zhu, Yi and Huang, Gao and Wei, Furu},
  booktitle = {The Thirteenth International Conference on Learning Representations (ICLR)},
  year      = {2025},
  url       = {https://arxiv.org/abs/2410.05258}
}"""


def training_record(run_dir: Path, step: int) -> dict:
    """What a run records of its training up to ``step`` (its checkpoint), for the model card.

    Args:
        run_dir: the run directory.
        step: the exported checkpoint's step.

    Returns:
        {} for a run without train_config.json; else the recipe, the step, the tokens trained and the last
        validation of metrics.jsonl at or before ``step`` (its step, loss and bits per byte).

    Examples:
        >>> from pathlib import Path
        >>> from difftransformer import TrainConfig, train
        >>> from difftransformer.store.examples import example_data
        >>> data = example_data()  # a short text, prepared in a new temporary directory
        >>> cfg = TrainConfig(data=str(data), out=f"{data}-run", max_steps=2, batch_size=2, seq_len=32, eval_tokens=64)
        >>> _ = train(cfg, quiet=True)
        >>> record = training_record(Path(cfg.out), 2)
        >>> record["step"], record["tokens"], record["validation"]["step"]
        (2, 128, 2)
    """
    if not (run_dir / TRAIN_CONFIG).is_file():
        return {}
    path = run_dir / TRAIN_CONFIG
    recipe = check(read_json_object(path), RECIPE, str(path), "copy the run's train_config.json back")
    record = {"recipe": recipe, "step": step}
    if isinstance(recipe.get("seq_len"), int):
        record["tokens"] = step * recipe["batch_size"] * recipe["seq_len"]
    for row in read_metrics(run_dir)[0]:  # every row checked; a line cut short by a kill is not a row
        if "val_loss" in row and "val_bpb" in row and row["step"] <= step:
            record["validation"] = {"step": row["step"], "loss": row["val_loss"], "bpb": row["val_bpb"]}
    data = Path(str(recipe.get("data") or ""))
    record["data"] = {"name": data.name or "unknown"}
    if (data / "manifest.json").is_file():
        found = read_manifest(data)
        sources = [Path(s).name if "/" in s else s for s in found.get("sources") or []]
        record["data"].update(sources=sources, tokens=found.get("tokens"))
    return record


def model_card(
    model: TransformerLM,
    architecture: str,
    parameters: tuple[int, int],
    record: dict,
    name: str,
    license: str | None = None,
    datasets: list[str] | None = None,
) -> str:
    """The Hub model card (README.md) of an export: front matter, the architecture with its DIFF heads and lambda per
    layer, the parameters, the training data and tokens, the last validation, how to load it and the citation.

    Args:
        model: the exported model.
        architecture: the transformers class it is exported as.
        parameters: (all parameters, without the embeddings).
        record: what the run records of its training (``training_record``; {} when nothing is known).
        name: the export's directory name, used in the loading example.
        license: the license for the front matter.
        datasets: Hub dataset ids for the front matter.

    Returns:
        The card's Markdown text.

    Examples:
        >>> from difftransformer import ModelConfig, TransformerLM
        >>> model = TransformerLM(ModelConfig.preset("tiny"))
        >>> card = model_card(model, "DiffLlamaForCausalLM", (1345728, 1280000), {}, "diff-tiny", license="mit")
        >>> card.startswith("---") and "license: mit" in card
        True
    """
    cfg, (params, body_params) = model.config, parameters
    diff = cfg.attention == "diff"
    front = ["---", "library_name: transformers", "pipeline_tag: text-generation"]
    if license:
        front.append(f"license: {license}")
    tags = ["difftransformer", "differential-transformer" if diff else "standard-transformer-baseline"]
    tags.append("diff_llama" if diff else "llama")
    front += ["tags:", *(f"- {tag}" for tag in tags)]
    if datasets:
        front += ["datasets:", *(f"- {d}" for d in datasets)]
    front.append("---")
    kind = "A Differential Transformer (DIFF Transformer)" if diff else "A standard Transformer (the DIFF baseline)"
    out = [
        "\n".join(front),
        "",
        f"# {name}",
        "",
        f"{kind} language model trained with `difftransformer` and exported as `{architecture}`, which plain "
        "`transformers` loads without custom code.",
        "",
        "## Architecture",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {params:,} ({body_params:,} without the embeddings) |",
        f"| layers, width | {cfg.n_layers}, d_model {cfg.d_model} |",
    ]
    if diff:
        out.append(
            f"| heads | {cfg.attention_heads} differential heads (half of a matched standard model's {cfg.n_heads}), "
            f"each two query/key halves of {cfg.attention_head_dim} and a value of {2 * cfg.attention_head_dim} |"
        )
    else:
        out.append(f"| heads | {cfg.attention_heads} of size {cfg.head_dim} |")
    out += [
        f"| key/value heads | {cfg.attention_kv_heads} |",
        f"| vocabulary, context | {cfg.vocab_size} tokens, {cfg.max_seq_len} positions |",
        "",
    ]
    if diff:
        with torch.no_grad():
            lambdas = [float(block.attn.lambda_full()) for block in model.layers]
        inits = [float(block.attn.lambda_init) for block in model.layers]
        out += [
            "Each differential head outputs (softmax(Q1 K1^T / sqrt(d)) - lambda softmax(Q2 K2^T / sqrt(d))) V, "
            "RMS-normalised and scaled by 1 - lambda_init. lambda is learned (lambda = exp(lq1 . lk1) - "
            "exp(lq2 . lk2) + lambda_init) and starts at lambda_init = 0.8 - 0.6 exp(-0.3 l) for layer l "
            "(from 0):",
            "",
            "| layer | lambda_init | lambda (trained) |",
            "|---|---|---|",
            *(f"| {i} | {init:.4f} | {lam:.4f} |" for i, (init, lam) in enumerate(zip(inits, lambdas, strict=True))),
            "",
        ]
    out += ["## Training", "", *_training_lines(record), ""]
    out += [
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{name}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
        'inputs = tokenizer("The", return_tensors="pt")',
        "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=40)[0]))",
        "```",
        "",
        f"`difftx convert --from-hf {shell(name)} --out RUN` brings it back as a difftransformer run.",
        "",
        "## Citation",
        "",
        f"The architecture is the paper's ([arXiv 2410.05258]({PAPER})):",
        "",
        "```bibtex",
        CITATION,
        "```",
        "",
    ]
    return "\n".join(out)


def _training_lines(record: dict) -> list[str]:
    if not record:
        return ["Not recorded: this run has no train_config.json (it was imported or saved by an experiment)."]
    recipe, data = record["recipe"], record["data"]
    sources = data.get("sources")
    source_text = f" from {_listed(sources)}" if sources else ""
    data_tokens = f", {data['tokens']:,} tokens in all" if isinstance(data.get("tokens"), int) else ""
    lines = [
        f"- data: `{data['name']}`{source_text}{data_tokens}",
        f"- steps: {record['step']:,}"
        + (f", {record['tokens']:,} training tokens" if "tokens" in record else "")
        + f" (batch {recipe.get('batch_size')} x {recipe.get('seq_len')} tokens)",
        f"- optimiser: AdamW, peak learning rate {recipe.get('lr')}, betas {tuple(recipe.get('betas') or ())}, weight "
        f"decay {recipe.get('weight_decay')}, warmup {recipe.get('warmup_steps')} steps, seed {recipe.get('seed')}",
    ]
    validation = record.get("validation")
    if validation:
        lines.append(
            f"- final validation (step {validation['step']:,}): loss {validation['loss']:.4f} nats per token, "
            f"{validation['bpb']:.4f} bits per byte"
        )
    else:
        lines.append("- validation: none recorded up to this checkpoint")
    return lines


def _listed(items: list[str], most: int = 5) -> str:
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")
