"""`difftx eval`."""

from __future__ import annotations

import argparse
import json
import sys

from difftransformer.apps.cli.parsing import INPUT, check_utf8, command, threads_flag


def eval_command(sub) -> None:
    ev = command(
        sub,
        "eval",
        _eval,
        "perplexity with lm-eval (HFLM) on a local JSONL file, and our own bits per byte",
        "difftx eval --run runs/diff-tiny --jsonl texts.jsonl --logit-bits 4",
    )
    ev.add_argument("--run", type=INPUT, required=True, help="the run to evaluate")
    ev.add_argument("--jsonl", type=INPUT, required=True, help="a JSONL file of texts")
    ev.add_argument("--text-field", default="text", help="the field of the records that holds the text")
    ev.add_argument(
        "--logit-bits",
        type=int,
        help="also measure our bits per byte with the attention logits quantized to this many bits (2-16; dynamic "
        "absmax, the paper's Figure 8); lm-eval is then skipped (the Hugging Face export has no such option)",
    )
    ev.add_argument(
        "--logit-granularity",
        default="row",
        choices=["row", "tensor"],
        help="--logit-bits scale: per head and query row (default) or one per sequence and layer",
    )
    threads_flag(ev)


def _eval(args: argparse.Namespace) -> int:
    from transformers import PreTrainedTokenizerFast

    from difftransformer.inference.evaluate import lm_eval_perplexity, read_texts
    from difftransformer.interop.hf import to_hf
    from difftransformer.store.runs import load_run
    from difftransformer.store.tokenizer import EOT
    from difftransformer.training.evaluate import text_bits_per_byte

    check_utf8(args.text_field, "--text-field")
    quantizer = None
    if args.logit_bits is not None:
        from difftransformer.core.attention.logits import LogitQuantizer, logit_probe

        quantizer = LogitQuantizer(args.logit_bits, args.logit_granularity)
    model, tokenizer = load_run(args.run)
    texts = read_texts(args.jsonl, args.text_field)
    result = {"ours": {"bits_per_byte": text_bits_per_byte(model, tokenizer, texts)}}
    from difftransformer.core.quantized import is_quantized

    if is_quantized(model):
        result["lm_eval"] = "skipped: a quantized run has no Hugging Face form; ours runs the quantized model"
    elif quantizer is None:
        # the run's own end-of-text token; special-token strings in the texts read as text, as ours reads them
        eot = getattr(tokenizer, "eot", EOT)
        hf_tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer.to_hf(), eos_token=eot, split_special_tokens=True)
        hf = to_hf(model)
        result["lm_eval"] = lm_eval_perplexity(hf, hf_tok, args.jsonl, args.text_field, model.config.max_seq_len)
    if quantizer is not None:
        with logit_probe(quantizer):
            quantized = text_bits_per_byte(model, tokenizer, texts)
        result["ours_quantized_logits"] = {
            "bits_per_byte": quantized,
            "logit_bits": quantizer.bits,
            "granularity": quantizer.granularity,
        }
        result.setdefault("lm_eval", "skipped: the Hugging Face export cannot quantize attention logits")
    print(json.dumps(result, indent=2))
    theirs = result["lm_eval"]["bits_per_byte"] if isinstance(result["lm_eval"], dict) else None
    print(
        f"difftx eval: {len(texts)} texts; bits per byte (lower is better): ours {result['ours']['bits_per_byte']:.4f}"
        + (f", lm-eval {theirs:.4f} (the same measure through transformers)" if theirs is not None else "")
        + (f", ours with {quantizer.bits}-bit attention logits {quantized:.4f}" if quantizer is not None else ""),
        file=sys.stderr,
    )
    return 0
