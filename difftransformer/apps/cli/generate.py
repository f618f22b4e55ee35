"""`difftx generate`."""

from __future__ import annotations

import argparse

from difftransformer.apps.cli.parsing import INPUT, check_utf8, command, threads_flag


def generate_command(sub) -> None:
    gen = command(
        sub,
        "generate",
        _generate,
        "sample from a trained run, streaming the text",
        "difftx generate --run runs/diff-tiny --prompt 'The module ' --max-new-tokens 60 --seed 0",
    )
    gen.add_argument("--run", type=INPUT, required=True, help="a run directory (trained, converted or quantized)")
    prompt = gen.add_argument("--prompt", required=True, help="the text to continue (it may begin with '-')")
    prompt.free_text = True  # Parser: `--prompt "-5 degrees"` is a prompt, not a flag
    gen.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    gen.add_argument("--top-k", type=int, help="sample among the k most likely tokens only")
    gen.add_argument(
        "--top-p", type=float, default=0.95, help="sample among the most likely tokens whose probability reaches p"
    )
    gen.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    gen.add_argument("--stop", nargs="+", help="stop strings")
    gen.add_argument("--truncate", action="store_true", help="keep the end of a prompt longer than the context")
    gen.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu, cuda or cuda:N")
    threads_flag(gen)


def _generate(args: argparse.Namespace) -> int:
    import torch

    from difftransformer.devices import resolve_device
    from difftransformer.inference.generate import SamplingConfig, generate
    from difftransformer.store.runs import load_run

    SamplingConfig(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)  # before the model loads
    check_utf8(args.prompt, "--prompt")
    for stop in args.stop or ():
        check_utf8(stop, "--stop")
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model, tokenizer = load_run(args.run, device=device)
    prompt = tokenizer.encode_prompt(args.prompt)
    shown = ""
    ids: list[int] = []
    echoed = False

    def echo_prompt() -> None:  # once the prompt has passed generate's checks (an error is never preceded by it)
        nonlocal echoed
        if not echoed:
            print(args.prompt, end="", flush=True)
            echoed = True

    def stream(_row: int, token: int) -> None:  # print the text as it grows (a token may end mid-character)
        nonlocal shown
        echo_prompt()
        ids.append(token)
        text = tokenizer.decode(ids)
        if not text.endswith("\ufffd"):
            print(text[len(shown) :], end="", flush=True)
            shown = text

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
    echo_prompt()
    print(tokenizer.decode(ids)[len(shown) :])
    return 0
