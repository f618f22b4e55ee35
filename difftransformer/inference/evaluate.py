"""Evaluation with the tools people use: EleutherAI's lm-eval (its HFLM wrapper) on a local JSONL task, offline,
checked against our own bits per byte on the same texts (``difftransformer.training.evaluate``).

Perplexity is lm-eval's ``loglikelihood_rolling``: each text is scored token by token after the end-of-text
token, and lm-eval reports word perplexity, byte perplexity and bits per byte.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

TASK = "difftx_local_perplexity"
# what lm-eval and the libraries under it print on every run of a local task, none of it actionable: the git hash
# lookup outside a repository, progress bars, and warnings about a local task's defaults and a passed-in model
NOISE = re.compile(
    r"fatal: not a git repository|it/s\]|examples/s\]|Generating test split|is defined, but (aggregation|"
    r"higher_is_better) is not|`pretrained` model kwarg is not of type|Passed an already-initialized model"
)


@contextlib.contextmanager
def quiet_third_party(noise: re.Pattern = NOISE) -> Iterator[None]:
    """Run the block with the process's stderr (file descriptor 2, so subprocesses and C code too) captured, then
    print what it wrote except the lines ``noise`` matches: real warnings and errors still show."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode("utf-8", "replace")
            for line in re.split(r"[\r\n]+", text):
                if line.strip() and not noise.search(line):
                    print(line, file=sys.stderr)
            sys.stderr.flush()


def read_texts(jsonl: str | Path, text_field: str = "text") -> list[str]:
    """The non-blank texts of a JSONL file; a file without one is refused (there is nothing to score)."""
    from difftransformer.errors import InputError
    from difftransformer.store.corpus import iter_documents

    if not Path(jsonl).is_file():
        raise FileNotFoundError(f"{jsonl} does not exist or is not a file")
    texts = list(iter_documents([Path(jsonl)], text_field))
    if not texts:
        raise InputError(f"{jsonl} holds no text to evaluate: no record has a non-blank `text_field` {text_field!r}")
    return texts


def lm_eval_perplexity(
    hf_model: PreTrainedModel,
    hf_tokenizer: PreTrainedTokenizerBase,
    jsonl: str | Path,
    text_field: str = "text",
    max_length: int = 256,
) -> dict[str, float]:
    """lm-eval's perplexity metrics of a transformers model on the texts of a local JSONL file (no hub access): what
    ``difftx eval`` reports beside this library's own bits per byte.

    Args:
        hf_model: a transformers causal language model (``to_hf`` makes one of a TransformerLM).
        hf_tokenizer: its tokenizer.
        jsonl: a JSONL file of texts.
        text_field: the field of the records that holds the text.
        max_length: the longest window lm-eval scores at once.

    Returns:
        {"word_perplexity": ..., "byte_perplexity": ..., "bits_per_byte": ...}.

    Examples:
        >>> import json
        >>> from transformers import AutoModelForCausalLM, AutoTokenizer
        >>> from difftransformer.interop.convert import run_to_hf
        >>> from difftransformer.store.examples import example_run
        >>> run = example_run()  # an untrained tiny DIFF model's run, in a new temporary directory
        >>> hf = run_to_hf(run, f"{run}-hf")
        >>> texts = f"{run}-texts.jsonl"
        >>> _ = Path(texts).write_text(json.dumps({"text": "To be, or not to be."}))
        >>> model, tokenizer = AutoModelForCausalLM.from_pretrained(hf), AutoTokenizer.from_pretrained(hf)
        >>> metrics = lm_eval_perplexity(model, tokenizer, texts)
        >>> sorted(metrics)
        ['bits_per_byte', 'byte_perplexity', 'word_perplexity']
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.jsonl"
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in read_texts(jsonl, text_field)))
        task = {
            "task": TASK,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")],
        }
        (Path(tmp) / f"{TASK}.yaml").write_text(json.dumps(task))  # JSON is YAML
        logger = logging.getLogger("lm_eval")
        level = logger.level
        try:
            with quiet_third_party():
                logger.setLevel(logging.ERROR)
                lm = HFLM(pretrained=hf_model, tokenizer=hf_tokenizer, batch_size=1, max_length=max_length)
                task_manager = TaskManager(include_path=tmp)
                out = lm_eval.simple_evaluate(model=lm, tasks=[TASK], task_manager=task_manager, verbosity="ERROR")
        finally:
            logger.setLevel(level)  # the caller's logging as it was
    result = out["results"][TASK]
    return {m: result[f"{m},none"] for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")}
