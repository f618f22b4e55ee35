"""`difftx analyze outliers`: the paper's Table 5 for trained runs, beside the paper's numbers.

Each run is measured on evenly spaced windows of its own validation split (the data directory it was trained on,
or ``data``), ``seq_len`` tokens each (the run's training window), about ``tokens`` tokens in all; see
``difftransformer.apps.outliers`` for what is collected. Writes ``results.json``, ``outliers.md`` and ``outliers.png``
(histograms of the pooled absolute values) into a new directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from difftransformer.apps.outliers import measure
from difftransformer.errors import InputError
from difftransformer.fsutil import check_new_dir, write_new_dir, write_text_atomic
from difftransformer.inference.magnitudes import EDGES, TOPS
from difftransformer.progress import Progress
from difftransformer.store.runs import load_run, run_windows

PAPER_TOKENS = 400_000
# Table 5 of the paper (3B models, 0.4M tokens): top-1, top-2, top-3, top-10, top-100, median
PAPER = {
    "attention_logits": {
        "standard": [318.0, 308.2, 304.9, 284.7, 251.5, 5.4],
        "diff": [38.8, 38.8, 37.3, 32.0, 27.4, 3.3],
    },
    "hidden_states": {
        "standard": [3608.6, 3607.4, 3603.6, 3552.1, 2448.2, 0.6],
        "diff": [1688.2, 1672.5, 1672.1, 1624.3, 740.9, 1.2],
    },
}  # fmt: skip
KINDS = {"attention_logits": "attention logits", "hidden_states": "hidden states"}
COLUMNS = [f"top{k}" for k in TOPS] + ["median"]


def analyze_outliers(
    runs: list[str | Path], out: str | Path, tokens: int = PAPER_TOKENS, data: str | Path | None = None, batch: int = 4
) -> Path:
    """Measure each run and write the report directory ``out`` (which must not exist or be empty)."""
    if not runs:
        raise InputError("name at least one run directory to measure")
    if tokens < 1:
        raise InputError(f"tokens must be at least 1, got {tokens}")
    out = Path(out)
    check_new_dir(out, "output directory")  # before the measuring, not only when writing
    results = []
    for run in runs:
        model, tokenizer = load_run(run)
        windows, _ = run_windows(run, tokenizer, "val", tokens=tokens, data=data)
        live = Progress(len(windows), f"outliers of {Path(run).name}", unit="windows")
        recorder = measure(model.float(), windows[:, :-1], batch, progress=live)
        results.append(
            {
                "run": str(run),
                "attention": model.config.attention,
                "non_embedding_parameters": model.num_parameters(exclude_embeddings=True),
                **recorder.summary(),
                "histograms": {k: v.tolist() for k, v in recorder.histograms().items()},
            }
        )
    summary = {"tokens_asked": tokens, "paper": PAPER, "paper_tokens": PAPER_TOKENS, "runs": results}

    def write(tmp: Path) -> None:
        write_text_atomic(tmp / "results.json", json.dumps(summary, indent=1) + "\n")
        write_text_atomic(tmp / "outliers.md", markdown(summary))
        figure(results, tmp / "outliers.png")

    write_new_dir(out, "output directory", write)
    return out


def markdown(summary: dict) -> str:
    lines = [
        "# Activation outliers (the paper's Table 5)",
        "",
        "Largest absolute values (the k-th largest, exact) and the median absolute value (histogram, within 1.2%), "
        "pooled over layers. Attention logits: the pre-softmax scores of every head (both maps of each DIFF head) "
        "where a query may attend; hidden states: the residual stream after every block.",
        "",
    ]
    for kind, title in KINDS.items():
        header = "| model | tokens | " + " | ".join(COLUMNS) + " |"
        lines += [f"## {title}", "", header, "|---" * (len(COLUMNS) + 2) + "|"]
        for arch, values in PAPER[kind].items():
            cells = " | ".join(f"{v:g}" for v in values)
            lines.append(f"| paper 3B {arch} | {summary['paper_tokens']:,} | {cells} |")
        for r in summary["runs"]:
            pooled = r[kind]["pooled"]
            cells = " | ".join(f"{pooled[c]:.3g}" for c in COLUMNS)
            lines.append(f"| {r['run']} ({r['attention']}) | {r['tokens']:,} | {cells} |")
        lines.append("")
    return "\n".join(lines)


def figure(results: list[dict], path: Path) -> None:
    from difftransformer.apps.figures import COLORS, HEADS, finish, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    centres = torch.sqrt(EDGES[1:] * EDGES[:-1]).numpy()
    seen: dict[str, int] = {}  # runs of one attention kind share its colour, each with a line style of its own
    styles = []
    for r in results:
        n = seen[r["attention"]] = seen.get(r["attention"], -1) + 1
        styles.append((COLORS.get(r["attention"], HEADS[len(styles) % len(HEADS)]), ("-", "--", ":", "-.")[n % 4]))
    for ax, (kind, title) in zip(axes, KINDS.items(), strict=True):
        for r, (colour, style) in zip(results, styles, strict=True):
            counts = torch.tensor(r["histograms"][kind][1:-1], dtype=torch.float64)
            share = (counts / max(1, int(counts.sum()))).numpy()
            label = f"{Path(r['run']).name} ({r['attention']})"
            ax.plot(centres, share, style, color=colour, label=label, linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("absolute value")
        ax.set_ylabel("share of values per bin (1% of a decade)")
        ax.set_title(f"{title}: distribution of |x|", fontsize=10)
    finish(fig, path, "activation magnitudes, pooled over layers (the tail holds the outliers)")
