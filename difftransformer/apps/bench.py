"""Benchmarks that print ratios measured side by side in one run (medians over interleaved repeats after warm-up)."""

from __future__ import annotations

import importlib.util
import platform
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from difftransformer.apps.bench_machine import matmul_rate, matmul_size, step_flops
from difftransformer.apps.tables import table
from difftransformer.core.attention import MultiheadAttention, MultiheadDiffAttn
from difftransformer.core.attention.diff import fixed_lambdas, method_of
from difftransformer.core.attention.kernels import standard_attention
from difftransformer.core.config import ModelConfig
from difftransformer.core.model import TransformerLM
from difftransformer.devices import choices, host_batch
from difftransformer.inference.cache import KVCache
from difftransformer.progress import Progress


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


ATTENTION_METHODS = {
    "sdpa": "padded SDPA",
    "triton": "the Triton kernels (padded SDPA where they do not apply)",
    "by-size": "the fused block kernel (SDPA for small heads and short rows)",
}
DECODE_METHODS = {"torch": "the PyTorch decode path", "kernel": "the fused CPU decode kernel"}


def auto_methods(device: str | torch.device) -> dict[str, str]:
    """What ``impl="auto"`` runs on ``device`` (``devices.choices``), in words: for training and prefill, and for
    decoding from a cache."""
    c = choices(torch.device(device))
    return {"branch": c.branch, "attention": ATTENTION_METHODS[c.attention], "decode": DECODE_METHODS[c.decode]}


def _result(benchmark: str, shapes: dict, repeats: int, rows: list[dict], device="cpu", dtype=torch.float32) -> dict:
    """The record every benchmark returns (and --json writes): what ran, where, on which shapes, by which methods."""
    return {
        "benchmark": benchmark,
        "machine": machine(),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "methods": auto_methods(device),
        "shapes": shapes,
        "repeats": repeats,
        "rows": rows,
    }


def _title(result: dict) -> str:
    m = result["machine"]
    where = f"{m['cuda']} (host {m['cpu']})" if result.get("device", "cpu").startswith("cuda") else m["cpu"]
    branch = result.get("methods", {}).get("branch", "cpu")
    rehearsed = ", the CUDA branch's methods rehearsed on the CPU" if branch == "cuda" and "cuda" not in where else ""
    return (
        f"{result['benchmark']} benchmark: {where}, torch {m['torch']}, {m['threads']} thread(s), {result['dtype']}"
        f"{rehearsed}"
    )


def _methods_line(result: dict, *columns: str) -> str:
    """Which method each column ran: our DIFF's ``auto`` by the device's choices (a result written before the
    record existed says nothing)."""
    methods = result.get("methods")
    if methods is None:
        return ""
    words = {
        "diff": f"DIFF = our DIFF, attention auto: {methods['attention']}",
        "decode": f"DIFF decodes through {methods['decode']}",
        "standard": "standard = our standard model, PyTorch's SDPA",
        "hf": "HF = transformers' DiffLlama with its SDPA attention",
        "triton": "DIFF-triton = our DIFF with the Triton kernels",
    }
    return "Methods: " + "; ".join(words[c] for c in columns)


def triton_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the optional Triton kernels can run here in ``dtype``: the triton package, and a CUDA GPU or Triton's
    interpreter (TRITON_INTERPRET=1, as the GPU rehearsal sets it) in float32 (the interpreter multiplies bfloat16
    operands of tl.dot as their raw 16-bit integers: devices.GPU_ONLY)."""
    try:
        from difftransformer.core.attention import triton_diff
    except ImportError:
        return False
    return torch.cuda.is_available() or (triton_diff.interpreting() and dtype == torch.float32)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Calls:
    """The live progress line of a benchmark, counted in timed calls (``total`` planned by the benchmark)."""

    progress: Progress | None = None
    done = 0

    @classmethod
    @contextmanager
    def tracking(cls, what: str, total: int):
        cls.progress, cls.done = Progress(total, f"bench {what}", unit="timed calls"), 0
        try:
            yield
        finally:
            cls.progress.close()
            cls.progress = None

    @classmethod
    def tick(cls, note: str = "") -> None:
        if cls.progress is not None:
            cls.done += 1
            cls.progress.update(cls.done, note=note)


def median_times(fns: dict[str, Callable[[], None]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each function; repeats are interleaved so drifting machine load hits all alike."""
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
            _Calls.tick(f"warm-up of {name}")
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync()
            start = time.perf_counter()
            fn()
            _sync()  # GPU work is asynchronous: time until it has finished
            times[name].append(time.perf_counter() - start)
            _Calls.tick(f"{name}, repeat {len(times[name])} of {repeats}")
    return {name: statistics.median(ts) for name, ts in times.items()}


class _HFDiffLlamaAttention(torch.nn.Module):
    """Hugging Face DiffLlama's attention layer with its rotary embedding, called like ours: causal. SDPA attention
    makes itself causal when given no mask (as DiffLlamaModel calls it); eager attention needs the additive causal
    mask its model would build."""

    def __init__(self, dim: int, heads: int, impl: str) -> None:
        super().__init__()
        from transformers import DiffLlamaConfig
        from transformers.models.diffllama import modeling_diffllama as hf

        cfg = DiffLlamaConfig(
            hidden_size=dim,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            intermediate_size=4 * dim,
            num_hidden_layers=1,
        )
        cfg._attn_implementation = impl
        self.impl = impl
        # transformers before 5 has a class per implementation (4.48: DiffLlamaSdpaAttention), later one class
        attention = getattr(hf, "DIFFLLAMA_ATTENTION_CLASSES", {}).get(impl, hf.DiffLlamaAttention)
        self.attn, self.rotary = attention(cfg, layer_idx=0), hf.DiffLlamaRotaryEmbedding(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        positions = torch.arange(t, device=x.device)[None]
        mask = None
        if self.impl == "eager":
            future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            mask = torch.zeros(1, 1, t, t, dtype=x.dtype, device=x.device).masked_fill(future, torch.finfo(x.dtype).min)
        return self.attn(x, position_embeddings=self.rotary(x, positions), attention_mask=mask)[0]


def diff_impls(device: str, dtype: torch.dtype = torch.float32) -> tuple[str, ...]:
    """Our DIFF methods worth timing on a device in ``dtype`` (``devices.choices``): the CUDA branch's are sdpa and
    Triton, the CPU's sdpa and the block method."""
    if choices(torch.device(device)).branch == "cuda":
        return ("sdpa", "plain", "triton") if triton_available(dtype) else ("sdpa", "plain")
    return ("sdpa", "block", "plain")


def bench_attention(
    seqs: list[int],
    dim: int = 512,
    heads: int = 8,
    batch: int = 1,
    repeats: int = 5,
    plain_max_seq: int = 4096,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict:
    """One attention layer of width ``dim``: DIFF (heads/2 differential heads) by impl vs standard (heads heads)."""
    torch.manual_seed(0)
    layers = {impl: MultiheadDiffAttn(dim, heads // 2, 0, impl=impl) for impl in diff_impls(device, dtype)}
    layers["standard"] = MultiheadAttention(dim, heads, 0)
    try:
        for impl in ("sdpa", "eager"):
            layers[f"hf-{impl}"] = _HFDiffLlamaAttention(dim, heads, impl)
    except ImportError:  # transformers is optional: the comparison is skipped and the table says so
        pass
    for layer in layers.values():
        layer.to(device, dtype)
    calls = sum((2 * len(_timed_layers(layers, t, plain_max_seq)) + 1
                 + len(_timed_cores(device, t, plain_max_seq, dtype))) * (1 + repeats) for t in seqs)  # fmt: skip
    with _Calls.tracking("attention", calls):
        rows = [_attention_rows(layers, t, dim, heads, batch, repeats, plain_max_seq, device, dtype) for t in seqs]
    rows = [row for three in rows for row in three]
    return _result(
        "attention",
        {
            "batch": batch,
            "dim": dim,
            "standard_heads": heads,
            "diff_heads": heads // 2,
            "head_dim": dim // heads,
        },
        repeats,
        rows,
        device,
        dtype,
    )


def _attention_rows(layers, t, dim, heads, batch, repeats, plain_max_seq, device, dtype) -> list[dict]:
    """The three rows of one sequence length: the layers forward, forward + backward, and the cores."""
    x = torch.randn(batch, t, dim, device=device, dtype=dtype)
    xg = x.clone().requires_grad_()
    names = _timed_layers(layers, t, plain_max_seq)
    with torch.no_grad():
        fwd = median_times({n: partial(layers[n], x) for n in names}, repeats)
    fb = median_times({n: partial(_forward_backward, layers[n], xg) for n in names}, repeats)
    rows = [{"seq": t, "direction": d, "seconds": res} for d, res in (("forward", fwd), ("forward+backward", fb))]
    core = _core_inputs(batch, heads, dim // heads, t, device, dtype)
    fns = {"standard": partial(_core_standard, *core["standard"])}
    fns |= {impl: partial(_core_diff, impl, *core["diff"]) for impl in _timed_cores(device, t, plain_max_seq, dtype)}
    rows.append({"seq": t, "direction": "core forward+backward", "seconds": median_times(fns, repeats)})
    return rows


def _timed_layers(layers: dict, t: int, plain_max_seq: int) -> list[str]:
    """The layers timed at length t: the materialising ones (plain, HF eager) only up to plain_max_seq."""
    return [n for n in layers if n not in ("plain", "hf-eager") or t <= plain_max_seq]


def _timed_cores(device: str, t: int, plain_max_seq: int, dtype: torch.dtype) -> list[str]:
    """Our DIFF methods whose attention core is timed at length t (besides the standard core)."""
    return [i for i in diff_impls(device, dtype) if i != "plain" or t <= plain_max_seq]


def _forward_backward(module: torch.nn.Module, x: torch.Tensor) -> None:
    module(x).sum().backward()


def _core_inputs(batch, heads, head_dim, t, device, dtype) -> dict:
    """Inputs of the attention core alone (no projections, rotary or norm): the standard model's ``heads`` heads of
    ``head_dim`` vs DIFF's heads/2 heads whose query/key halves are head_dim wide and values 2 head_dim (the matched
    layout of docs/paper.md section 1: the same projection widths)."""
    d = head_dim

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    return {
        "standard": (rand(batch, heads, t, head_dim), rand(batch, heads, t, head_dim), rand(batch, heads, t, head_dim)),
        "diff": (
            rand(batch, heads // 2, 2, t, d),
            rand(batch, heads // 2, 2, t, d),
            rand(batch, heads // 2, t, 2 * d),
            torch.tensor(0.5, device=device, requires_grad=True),
        ),
    }


def _core_standard(q, k, v) -> None:
    standard_attention(q, k, v, scale=q.shape[-1] ** -0.5)[0].sum().backward()


def _core_diff(impl, q, k, v, lam) -> None:
    method_of(impl)(q, k, v, lam, scale=q.shape[-1] ** -0.5).sum().backward()


def format_attention(result: dict) -> str:
    s = result["shapes"]
    names = list(dict.fromkeys(n for row in result["rows"] for n in row["seconds"]))
    others = [n for n in names if n != "standard"]
    lines = [
        _title(result),
        f"batch {s['batch']}, width {s['dim']}: DIFF {s['diff_heads']} heads vs standard {s['standard_heads']} heads "
        f"of size {s['head_dim']}; medians of {result['repeats']} interleaved repeats after warm-up. Columns: "
        "standard = our baseline; sdpa, block, plain, triton = our DIFF methods; hf-* = transformers DiffLlama. "
        "core = the attention core alone (no projections, rotary or norm)"
        + (f"; auto on this device runs {result['methods']['attention']}" if "methods" in result else ""),
        "",
        "| T | direction | "
        + " | ".join(f"{n} ms" for n in names)
        + " | "
        + " | ".join(f"{n}/std" for n in others)
        + " |",
        "|---|---|" + "---|" * (len(names) + len(others)),
    ]
    for row in result["rows"]:
        sec = row["seconds"]
        ms = [f"{sec[n] * 1e3:.1f}" if n in sec else "-" for n in names]
        ratios = [f"{sec[n] / sec['standard']:.2f}" if n in sec else "-" for n in others]
        lines.append(f"| {row['seq']} | {row['direction']} | " + " | ".join(ms + ratios) + " |")
    return "\n".join(lines)


def saved_activation_bytes(step: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages that autograd saves for backward while ``step()`` runs the forward pass:
    the activation memory of training (parameters and views of them, such as the ``weight.t()`` a linear layer
    saves, excluded: they are saved by reference, not copied)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return sum(storages.values())


def _lm_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x[:, :-1])
    logits = out.logits if hasattr(out, "logits") else out  # a transformers model returns an output object
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


class _Logits(torch.nn.Module):
    """A transformers causal LM called as ours: tokens in, logits out."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf(tokens).logits


def trainer_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The trainer's AdamW for ``model`` (training/step.make_optimizer with TrainConfig's defaults: fused where
    PyTorch has it, weight decay on matrices only)."""
    from difftransformer.training.config import TrainConfig
    from difftransformer.training.step import make_optimizer

    return make_optimizer(model, TrainConfig(data="-", out="-"))


def trainer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, amp: torch.dtype | None = None
) -> None:
    """One training step as ``difftx train`` takes it (training/step.optimizer_step: autocast to ``amp`` over float32
    weights, gradient clipping, the non-finite guard, the optimizer) on the tokens ``x`` (B, T + 1)."""
    from difftransformer.training.step import optimizer_step

    device = next(model.parameters()).device
    optimizer_step(model, optimizer, [(x[:, :-1], x[:, 1:])], 1e-4, 1.0, device, amp)


def _autocast_loss(model: torch.nn.Module, x: torch.Tensor, amp: torch.dtype | None) -> torch.Tensor:
    """The loss of ``x`` under the step's autocast (what the step's backward keeps activations for)."""
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
        return _lm_loss(model, x)


def bench_train(
    preset: str = "small",
    seqs: list[int] | None = None,
    batch: int = 4,
    repeats: int = 3,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    matmul: int | None = None,
) -> dict:
    """A training step as the trainer takes it (float32 weights, autocast to ``dtype`` when it is not float32, the
    trainer's fused AdamW, clipping) and its activation memory: our DIFF, our standard, and Hugging Face DiffLlama
    (its SDPA attention) built from our DIFF model's config and weights. With a GPU and Triton, also our DIFF with
    the Triton kernel (``diff-triton``). Utilisation is measured against a matrix product in the same dtype and TF32
    setting: a product of ``matmul`` x ``matmul`` (``bench_machine.matmul_size`` by default)."""
    from difftransformer.training.step import use_tf32

    seqs = seqs or [256, 1024, 2048]
    amp = None if dtype == torch.float32 else dtype
    tf32 = use_tf32(torch.device(device), amp)  # as the trainer sets it
    n_models = 2 + ("triton" in diff_impls(device, dtype)) + (importlib.util.find_spec("transformers") is not None)
    matmul = matmul or matmul_size(device)
    rates = [matmul_rate(matmul, device=device, dtype=dtype)]  # the machine's limit, before and after (the larger)
    with _Calls.tracking("train", len(seqs) * n_models * (1 + repeats)):
        rows = [_train_row(preset, t, batch, repeats, device, amp) for t in seqs]
    rates.append(matmul_rate(matmul, device=device, dtype=dtype))
    cfg = ModelConfig.preset(preset)
    result = _result(
        "train",
        _shapes(preset, batch, cfg),
        repeats,
        rows,
        device,
        dtype,
    )
    result["step"] = "trainer: float32 weights" + (f", {str(dtype)[6:]} autocast" if amp else "") + ", fused AdamW"
    result["matmul"] = {"size": matmul, "dtype": str(dtype)[6:], "tf32": tf32, "flops_per_s": rates}
    return result


def _train_row(preset: str, t: int, batch: int, repeats: int, device: str, amp: torch.dtype | None) -> dict:
    """bench_train's row of one sequence length: step seconds and saved activation bytes of each model, each step on
    t tokens per row."""
    models: dict[str, torch.nn.Module] = {}
    for attention in ("diff", "standard"):
        torch.manual_seed(0)
        models[attention] = TransformerLM(ModelConfig.preset(preset, attention=attention, max_seq_len=t))
    if "triton" in diff_impls(device, amp or torch.float32):
        models["diff-triton"] = TransformerLM(ModelConfig.preset(preset, max_seq_len=t, attn_impl="triton"))
        models["diff-triton"].load_state_dict(models["diff"].state_dict())
    try:
        from difftransformer.interop.hf import to_hf

        hf = to_hf(models["diff"]).train()
        hf.config._attn_implementation = "sdpa"
        models["hf-diffllama"] = _Logits(hf)  # its own causal mask: SDPA's is_causal
    except ImportError:
        pass
    for m in models.values():
        m.to(device)  # float32 weights, as the trainer keeps them
    vocab = models["diff"].config.vocab_size
    # t tokens in, t targets: a host batch, as the trainer's loader makes it (each step copies it to the device, from
    # pinned memory on a GPU)
    x = host_batch(torch.randint(0, vocab, (batch, t + 1)))
    optimizers = {n: trainer_optimizer(m) for n, m in models.items()}
    seconds = median_times({n: partial(trainer_step, m, optimizers[n], x, amp) for n, m in models.items()}, repeats)
    on_device = x.to(device)
    memory = {n: saved_activation_bytes(partial(_autocast_loss, m, on_device, amp)) for n, m in models.items()}
    for m in models.values():
        m.zero_grad(set_to_none=True)
    # HF DiffLlama and diff-triton do DIFF's count
    flops = {n: step_flops(models["standard" if n == "standard" else "diff"].config, batch, t) for n in models}
    return {"seq": t, "seconds": seconds, "activation_bytes": memory, "step_flops": flops}


def _opening(result: dict, how: str, *methods: str) -> list[str]:
    """A result's first lines: its title, its shapes and ``how`` it was measured, its ``methods``' line, a blank."""
    return [_title(result), f"{_model_words(result['shapes'])}; {how}", _methods_line(result, *methods), ""]


def _model_words(s: dict) -> str:
    """A result's shapes in words: 'preset small (d_model 512, 6 layers, DIFF 4 heads vs standard 8 of size 64),
    batch 4' (a result written before the shapes had DIFF's heads: 'head size 64')."""
    heads = "head size"
    if "diff_heads" in s:
        heads = f"DIFF {s['diff_heads']} heads vs standard {s['standard_heads']} of size"
    sizes = f"d_model {s['d_model']}, {s['n_layers']} layers, {heads} {s['head_dim']}"
    return f"preset {s['preset']} ({sizes}), batch {s['batch']}"


def format_train(result: dict) -> str:
    triton = ["triton"][: any("diff-triton" in r["seconds"] for r in result["rows"])]
    how = (
        f"step = forward + backward + AdamW ({result.get('step', 'plain AdamW, weights in the dtype')}), median of "
        f"{result['repeats']} interleaved repeats; activations = bytes autograd saves for backward"
    )
    lines = _opening(result, how, "diff", "standard", "hf", *triton) + [
        "| T | standard ms | DIFF ms | HF DiffLlama ms | DIFF/standard | DIFF/HF | activations std MiB | DIFF MiB | "
        "HF MiB | DIFF/HF memory | DIFF/std memory |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        sec, mem = row["seconds"], row["activation_bytes"]
        hf_ms = f"{sec['hf-diffllama'] * 1e3:.0f}" if "hf-diffllama" in sec else "-"
        hf_ratio = f"{sec['diff'] / sec['hf-diffllama']:.2f}" if "hf-diffllama" in sec else "-"
        hf_mib = f"{mem['hf-diffllama'] / 2**20:.1f}" if "hf-diffllama" in mem else "-"
        hf_mem = f"{mem['diff'] / mem['hf-diffllama']:.2f}" if "hf-diffllama" in mem else "-"
        lines.append(
            f"| {row['seq']} | {sec['standard'] * 1e3:.0f} | {sec['diff'] * 1e3:.0f} | {hf_ms} | "
            f"{sec['diff'] / sec['standard']:.2f} | {hf_ratio} | {mem['standard'] / 2**20:.1f} | "
            f"{mem['diff'] / 2**20:.1f} | {hf_mib} | {hf_mem} | {mem['diff'] / mem['standard']:.2f} |"
        )
    lines += _utilisation_lines(result)
    triton_rows = [row for row in result["rows"] if "diff-triton" in row["seconds"]]
    if triton_rows:
        lines += [
            "",
            "Our DIFF with the Triton kernel (attn_impl triton), same weights:",
            "",
            "| T | DIFF-triton ms | triton/standard | triton/DIFF auto | activations MiB | triton/std memory |",
            "|---|---|---|---|---|---|",
        ]
        for row in triton_rows:
            sec, mem = row["seconds"], row["activation_bytes"]
            lines.append(
                f"| {row['seq']} | {sec['diff-triton'] * 1e3:.0f} | {sec['diff-triton'] / sec['standard']:.2f} | "
                f"{sec['diff-triton'] / sec['diff']:.2f} | {mem['diff-triton'] / 2**20:.1f} | "
                f"{mem['diff-triton'] / mem['standard']:.2f} |"
            )
    return "\n".join(lines)


def _utilisation_lines(result: dict) -> list[str]:
    """bench train's table of achieved FLOP/s against the machine's matrix-product rate (bench_machine.py)."""
    if "matmul" not in result or not all("step_flops" in row for row in result["rows"]):
        return []  # a result written before the count existed
    mm = result["matmul"]
    rate = max(mm["flops_per_s"])
    mm_dtype = mm.get("dtype", "float32") + (" (TF32)" if mm.get("tf32") else "")
    names = [n for n in ("standard", "diff", "hf-diffllama") if n in result["rows"][0]["seconds"]]
    lines = [
        "",
        f"Achieved FLOP/s of a step against this machine's {mm_dtype} matrix-product rate: torch.mm of {mm['size']} x "
        f"{mm['size']} at the same threads, {', '.join(f'{r / 1e9:.1f}' for r in mm['flops_per_s'])} GFLOP/s "
        f"before and after the steps (the larger used). FLOPs counted as bench_machine.step_flops: 6 x "
        "(non-embedding parameters + output projection) x tokens + the causal attention products x 3.",
        "",
        "| T | GFLOP per step | " + " | ".join(f"{n} GFLOP/s | {n} / matmul" for n in names) + " |",
        "|---|---|" + "---|---|" * len(names),
    ]
    for row in result["rows"]:
        cells = []
        for n in names:
            achieved = row["step_flops"][n] / row["seconds"][n]
            cells.append(f"{achieved / 1e9:.1f} | {achieved / rate:.2f}")
        lines.append(f"| {row['seq']} | {row['step_flops']['diff'] / 1e9:.1f} | " + " | ".join(cells) + " |")
    return lines


def _decode_seconds(model, context: int, tokens: int, batch: int = 1) -> list[float]:
    """Seconds per one-token decode step after a prefill of ``context`` random tokens (``batch`` rows), on the model's
    device. ``model`` may be ``torch.compile(TransformerLM)``: every step has the same shapes (the cache's fixed
    slots), so it compiles once per context, in the warm-up step. The steps run back to back as a generation loop
    does, each fed the previous step's most likely token, from slots and tokens that stay on the device: nothing is
    read on the host between steps, and the time is taken once, after the last (on a GPU a per-step time would make
    the host wait for every step), lambda fixed for the loop as ``generate`` fixes it. One number: the mean step of
    this run."""
    lm = getattr(model, "_orig_mod", model)
    device = lm.embed.weight.device
    cache = KVCache(lm, batch, context + tokens + 1)
    vocab = lm.config.vocab_size
    slots = torch.arange(context, context + tokens + 1, device=device)
    with torch.no_grad(), fixed_lambdas(lm):
        lm(torch.randint(0, vocab, (batch, context), device=device), cache=cache)  # eager prefill: 0..context-1
        token = torch.randint(0, vocab, (batch, 1), device=device)
        model(token, cache=cache, slots=slots[:1])  # warm-up step
        _sync()
        start = time.perf_counter()
        for i in range(1, tokens + 1):
            token = model(token, cache=cache, slots=slots[i : i + 1])[:, -1:].argmax(-1)
        _sync()
    return [(time.perf_counter() - start) / tokens]


class _HFGenerate:
    """A transformers model timed through its own ``generate()`` (greedy, its default dynamic cache)."""

    def __init__(self, hf_model) -> None:
        self.model = hf_model.eval()

    def seconds(self, context: int, tokens: int) -> list[float]:
        """Seconds per decode step: (generate of 1 + tokens new tokens - generate of 1) / tokens, batch 1."""
        ids = torch.randint(0, self.model.config.vocab_size, (1, context), device=self.model.device)
        timed = {}
        with torch.no_grad():
            self._generate(ids, 2)  # warm-up
            for new in (1, tokens + 1):
                _sync()
                start = time.perf_counter()
                self._generate(ids, new)
                _sync()
                timed[new] = time.perf_counter() - start
        return [(timed[tokens + 1] - timed[1]) / tokens]

    def _generate(self, ids: torch.Tensor, new: int) -> None:
        self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip


def _decode_rows(
    models: dict[str, TransformerLM], contexts: list[int], tokens: int, repeats: int, batch: int = 1
) -> list[dict]:
    """Median decode tokens/s of each model at each context, the models interleaved so that load hits them alike."""
    rows = []
    for context in contexts:
        samples: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(repeats):
            for name, model in models.items():
                if isinstance(model, _HFGenerate):
                    samples[name] += model.seconds(context, tokens)
                else:
                    samples[name] += _decode_seconds(model, context, tokens, batch)
                _Calls.tick(f"{name} at context {context}")
        ops = {n: ops_per_step(m, context, batch) for n, m in models.items() if isinstance(m, TransformerLM)}
        rows.append(
            {
                "context": context,
                "tokens_per_s": {n: batch / statistics.median(t) for n, t in samples.items()},
                "ops_per_step": ops,
            }
        )
    return rows


def ops_per_step(model: TransformerLM, context: int, batch: int = 1) -> int:
    """How many operations one decode step after a prefill of ``context`` tokens dispatches (PyTorch's and our
    kernels', counted below autograd and autocast): on a GPU each launches one kernel or more."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    device = model.embed.weight.device
    cache = KVCache(model, batch, context + 1)
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (batch, context), device=device), cache=cache)
        token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        with fixed_lambdas(model), Count():
            model(token, cache=cache)
    return Count.calls


def bench_decode(
    contexts: list[int],
    preset: str = "small",
    tokens: int = 32,
    repeats: int = 3,
    compile: bool = False,
    hf: bool = False,
    batch: int = 1,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Decode tokens/s with a KV cache, DIFF vs standard built from the same preset, on ``device`` with weights and
    cache in ``dtype`` (``batch`` rows a step; tokens/s counts every row's token; ``hf`` times batch 1 only); with
    ``compile`` also each model's decode step under torch.compile (fullgraph); with ``hf`` also the same weights
    exported to transformers (DiffLlama, Llama) and timed through ``generate()``."""
    if hf and batch != 1:
        from difftransformer.errors import InputError

        raise InputError("bench decode --hf times transformers generate() at batch 1 only; drop --hf or --batch")
    models = {}
    for attention in ("diff", "standard"):
        torch.manual_seed(0)
        cfg = ModelConfig.preset(preset, attention=attention, max_seq_len=max(contexts) + tokens + 1)
        models[attention] = TransformerLM(cfg).eval()
    if hf:  # exported from the float32 weights, then moved as ours are
        from difftransformer.interop.hf import to_hf

        for attention in ("diff", "standard"):
            models[f"hf-{attention}"] = _HFGenerate(to_hf(models[attention]).to(device, dtype))
    for attention in ("diff", "standard"):
        models[attention].to(device, dtype)
        if compile:
            models[f"{attention}-compiled"] = torch.compile(models[attention], fullgraph=True, dynamic=False)
    with _Calls.tracking("decode", len(contexts) * repeats * len(models)):
        rows = _decode_rows(models, contexts, tokens, repeats, batch)
    cfg = models["diff"].config
    return _result(
        "decode",
        {**_shapes(preset, batch, cfg), "new_tokens": tokens},
        repeats,
        rows,
        device,
        dtype,
    )


def _shapes(preset: str, batch: int, cfg: ModelConfig) -> dict:
    """A result's shapes: the preset, the batch and the model's sizes (DIFF's heads beside the standard model's)."""
    return dict(
        preset=preset,
        batch=batch,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        standard_heads=cfg.n_heads,
        diff_heads=cfg.attention_heads,
        head_dim=cfg.head_dim,
    )


def format_decode(result: dict) -> str:
    how = (
        f"per repeat the mean of {result['shapes']['new_tokens']} one-token steps run back to back after a prefill "
        f"(no host read between them), median over {result['repeats']} repeats; ops = the operations one decode step "
        "dispatches (on a GPU each launches a kernel or more: at batch 1 a small model's step is bound by launches)"
    )
    lines = _opening(result, how, "decode", "standard")
    rows = result["rows"]
    speeds = [row["tokens_per_s"] for row in rows]
    lines += table(
        ["context", "standard tokens/s", "DIFF tokens/s", "DIFF / standard", "standard ops", "DIFF ops"],
        [
            [row["context"], f"{t['standard']:.1f}", f"{t['diff']:.1f}", f"{t['diff'] / t['standard']:.2f}",
             row.get("ops_per_step", {}).get("standard", "-"), row.get("ops_per_step", {}).get("diff", "-")]
            for row, t in zip(rows, speeds, strict=True)
        ],
    )  # fmt: skip
    if "diff-compiled" in speeds[0]:
        lines += ["", "torch.compile (fullgraph) of each model's decode step, same weights and cache:", ""]
        lines += table(
            ["context", "standard tokens/s", "DIFF tokens/s", "DIFF / standard", "standard vs eager", "DIFF vs eager"],
            [
                [row["context"], f"{sc:.1f}", f"{dc:.1f}", f"{dc / sc:.2f}", f"{sc / t['standard']:.2f}",
                 f"{dc / t['diff']:.2f}"]
                for row, t in zip(rows, speeds, strict=True)
                for sc, dc in [(t["standard-compiled"], t["diff-compiled"])]
            ],
        )  # fmt: skip
    if "hf-diff" in speeds[0]:
        lines += [
            "",
            "transformers generate() on the same weights (DiffLlama, Llama; greedy, dynamic cache; per-token time from",
            "generate of 1 + N tokens minus generate of 1):",
            "",
        ]
        lines += table(
            ["context", "HF Llama tokens/s", "HF DiffLlama tokens/s", "DIFF / HF DiffLlama", "standard / HF Llama"],
            [
                [row["context"], f"{t['hf-standard']:.1f}", f"{t['hf-diff']:.1f}", f"{t['diff'] / t['hf-diff']:.2f}",
                 f"{t['standard'] / t['hf-standard']:.2f}"]
                for row, t in zip(rows, speeds, strict=True)
            ],
        )  # fmt: skip
    return "\n".join(lines)


def bench_quantized(run: str | Path, contexts: list[int], tokens: int = 32, repeats: int = 3) -> dict:
    """Size on disk and decode tokens/s of a quantized run against its float source run (batch 1, CPU)."""
    from difftransformer.errors import InputError
    from difftransformer.store.checkpoint import list_checkpoints
    from difftransformer.store.runs import load_run, read_quantization

    run = Path(run)
    spec = read_quantization(run) if run.is_dir() else None
    if spec is None:
        raise InputError(f"{run} is not a quantized run (no quantization.json): make one with difftx quantize")
    source = Path(spec["source"])
    if not source.is_dir():
        raise FileNotFoundError(f"the float source {source} of {run} does not exist (moved or removed)")
    paths = {"float": source, spec["scheme"]: run}
    models = {name: load_run(path)[0] for name, path in paths.items()}
    longest, window = max(contexts) + tokens + 1, models["float"].config.max_seq_len  # + 1: the warm-up step
    if longest > window:
        fits = window - tokens - 1
        fix = f"use --context {fits} or less" if fits >= 1 else f"use --tokens {window - 2} or fewer"
        raise InputError(
            f"a context of {max(contexts)} plus {tokens} new tokens and a warm-up step needs {longest} positions, "
            f"more than the model's context of {window}: {fix}"
        )
    sizes = {name: (list_checkpoints(path)[-1] / "model.safetensors").stat().st_size for name, path in paths.items()}
    with _Calls.tracking("decode", len(contexts) * repeats * len(models)):
        rows = _decode_rows(models, contexts, tokens, repeats)
    cfg = models["float"].config
    # the runs by name: a result names no path of the machine it ran on
    shapes = dict(run=run.resolve().name, source=source.name, scheme=spec["scheme"], attention=cfg.attention, batch=1,
                  d_model=cfg.d_model, n_layers=cfg.n_layers, new_tokens=tokens, bytes=sizes)  # fmt: skip
    return _result("quantized", shapes, repeats, rows)


def format_quantized(result: dict) -> str:
    s = result["shapes"]
    scheme = s["scheme"]
    lines = [
        _title(result),
        f"{s['run']} ({scheme}, {s['attention']}, d_model {s['d_model']}, {s['n_layers']} layers) against its float "
        f"source, batch 1, median over {result['repeats']} x {s['new_tokens']} one-token steps after a prefill; "
        "the quantized weights are dequantized at load (CPU), so speed is not expected to gain",
        "",
        f"model.safetensors: float {s['bytes']['float'] / 1e6:.2f} MB, {scheme} {s['bytes'][scheme] / 1e6:.2f} MB "
        f"({s['bytes'][scheme] / s['bytes']['float']:.2f}x)",
        "",
        f"| context | float tokens/s | {scheme} tokens/s | {scheme} / float |",
        "|---|---|---|---|",
    ]
    for row in result["rows"]:
        t = row["tokens_per_s"]
        lines.append(f"| {row['context']} | {t['float']:.1f} | {t[scheme]:.1f} | {t[scheme] / t['float']:.2f} |")
    return "\n".join(lines)
