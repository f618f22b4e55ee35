"""The fused CPU kernel of the block method: exact against the float64 materialised method and against the PyTorch
block method (forward and every gradient, masks, GQA, caches), chosen where it applies, and a clean fallback."""

from __future__ import annotations

import math
import os

import pytest
import torch

from difftransformer import ModelConfig, TransformerLM
from difftransformer.core.attention import cpu_kernel, kernels
from difftransformer.core.attention.diff import differential_attention
from difftransformer.inference.cache import KVCache


def inputs(b, h, hkv, tq, tk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()

    lam = torch.tensor(0.65, dtype=dtype, requires_grad=True)
    return rand(b, h, 2, tq, d), rand(b, hkv, 2, tk, d), rand(b, hkv, tk, 2 * d), lam


def fused(q, k, v, lam, causal, mask, block=16):
    return cpu_kernel.fused_block(q, k, v, lam, q.shape[-1] ** -0.5, causal, mask, block)


def outputs_and_grads(fn, args, grad):
    out = fn(*args)
    return out, torch.autograd.grad(out, args, grad)


def padding_and_random_mask(b, tq, tk):
    """Row 0 of sequence 0 left-padded by 5 keys (its first rows attend nothing under causality), plus holes."""
    mask = torch.rand(b, 1, tq, tk, generator=torch.Generator().manual_seed(1)) > 0.2
    mask[0, :, :, :5] = False
    return mask


CASES = {  # b, h, hkv, tq, tk, d, causal, masked
    "mha causal, 5 blocks": (2, 4, 4, 70, 70, 8, True, False),
    "gqa 2 heads per group": (2, 4, 2, 50, 50, 8, True, False),
    "not causal, tq < tk": (1, 2, 1, 33, 70, 16, False, False),
    "cache rows (tq < tk)": (2, 2, 2, 20, 45, 8, True, False),
    "tq > tk: rows that see nothing": (1, 2, 1, 40, 25, 8, True, False),
    "padding and holes": (2, 4, 2, 40, 40, 8, True, True),
    "mask without causality": (2, 2, 1, 30, 30, 8, False, True),
    "one group of 4 heads (split over blocks)": (1, 4, 1, 70, 70, 8, True, False),
    "three groups, masked (split in two)": (3, 2, 1, 50, 50, 8, True, True),
}


@pytest.mark.parametrize("case", CASES)
def test_equals_the_float64_materialised_method(kernel, threads, case):
    b, h, hkv, tq, tk, d, causal, masked = CASES[case]
    args = inputs(b, h, hkv, tq, tk, d, torch.float64)
    mask = padding_and_random_mask(b, tq, tk) if masked else None
    grad = torch.randn(b, h, tq, 2 * d, dtype=torch.float64)

    def plain(q, k, v, lam):
        return differential_attention(q, k, v, lam, scale=d**-0.5, causal=causal, mask=mask)[0]

    ref, ref_grads = outputs_and_grads(plain, args, grad)
    out, grads = outputs_and_grads(lambda *a: fused(*a, causal, mask), args, grad)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for name, g, g_ref in zip("q k v lambda".split(), grads, ref_grads, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"d{n}: {m}")
    if masked or tq > tk:  # a row that may attend nothing is zero, never NaN
        assert torch.isfinite(out).all() and (out == ref).logical_or(ref.abs() > 0).all()


@pytest.mark.parametrize("case", ["gqa 2 heads per group", "padding and holes", "cache rows (tq < tk)"])
def test_float32_equals_the_pytorch_block_method_and_the_float64_result(kernel, case):
    b, h, hkv, tq, tk, d, causal, masked = CASES[case]
    args = inputs(b, h, hkv, tq, tk, d, torch.float32, seed=2)
    mask = padding_and_random_mask(b, tq, tk) if masked else None
    grad = torch.randn(b, h, tq, 2 * d)
    out, grads = outputs_and_grads(lambda *a: fused(*a, causal, mask), args, grad)
    torch_block = lambda q, k, v, lam: kernels._BlockDiffAttention.apply(q, k, v, lam, d**-0.5, causal, mask, 16)  # noqa: E731
    ref, ref_grads = outputs_and_grads(torch_block, args, grad)
    exact_args = [a.detach().double().requires_grad_() for a in args]
    exact, exact_grads = outputs_and_grads(lambda *a: fused(*a, causal, mask), exact_args, grad.double())
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)
    assert (out.double() - exact).abs().max() < 2e-6
    for g, g_ref, g_exact in zip(grads, ref_grads, exact_grads, strict=True):  # float32 rounding at the grad's scale
        scale = g_exact.abs().max().item()
        assert (g - g_ref).abs().max() <= 1e-5 * scale
        assert (g.double() - g_exact).abs().max() <= 1e-5 * scale


def test_the_kernel_runs_its_tasks_on_every_thread(kernel):
    """Compiled without OpenMP, at::parallel_for runs every task on one thread, silently: the build must use them."""
    before = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert cpu_kernel.parallel_threads() == n
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("case", ["one group of 4 heads (split over blocks)", "three groups, masked (split in two)"])
def test_split_tasks_give_the_same_bits_every_run_and_match_one_thread(kernel, case):
    """With more threads than groups the backward sums partial dK, dV and lambda gradients: in a fixed order, so two
    runs give identical bits, and within float32 rounding of the one-thread result."""
    b, h, hkv, tq, tk, d, causal, masked = CASES[case]
    args = inputs(b, h, hkv, tq, tk, d, torch.float32, seed=3)
    mask = padding_and_random_mask(b, tq, tk) if masked else None
    grad = torch.randn(b, h, tq, 2 * d)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        runs = [outputs_and_grads(lambda *a: fused(*a, causal, mask), args, grad) for _ in range(3)]
        torch.set_num_threads(1)
        one_out, one_grads = outputs_and_grads(lambda *a: fused(*a, causal, mask), args, grad)
    finally:
        torch.set_num_threads(before)
    for out, grads in runs[1:]:
        assert torch.equal(out, runs[0][0]) and all(map(torch.equal, grads, runs[0][1]))
    torch.testing.assert_close(runs[0][0], one_out, rtol=0, atol=0)  # each row is computed by one task either way
    for g, g_one in zip(runs[0][1], one_grads, strict=True):
        assert (g - g_one).abs().max() <= 1e-5 * g_one.abs().max()


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_broadcast_key_padding_mask_equals_the_expanded_one(kernel, monkeypatch, switch):
    """kernels.diff_attention takes a mask broadcastable to (B, 1, Tq, Tk): a (B, 1, 1, Tk) padding mask works, in the
    kernel and in the PyTorch block method (which read it by query rows; both once failed on it)."""
    monkeypatch.setenv("DIFFTX_CPU_KERNEL", switch)
    q, k, v, lam = inputs(2, 2, 1, 100, 100, 8, torch.float64)
    padding = torch.ones(2, 1, 1, 100, dtype=torch.bool)
    padding[1, ..., :7] = False
    out = kernels.diff_attention(q, k, v, lam, scale=8**-0.5, mask=padding, impl="block")
    fused = type(out.grad_fn).__name__ == "TransposeBackward0"
    assert fused == (switch == "1")
    expected = differential_attention(q, k, v, lam, scale=8**-0.5, mask=padding.expand(2, 1, 100, 100))[0]
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_output_is_token_major_and_the_module_chooses_the_kernel(kernel):
    q, k, v, lam = inputs(1, 2, 2, 64, 64, 8, torch.float32)
    out = kernels.diff_method("block")(q, k, v, lam, scale=8**-0.5)
    assert out.shape == (1, 2, 64, 16) and out.transpose(1, 2).is_contiguous()  # what out_proj reads, no copy
    assert type(out.grad_fn).__name__ == "TransposeBackward0"
    assert type(out.grad_fn.next_functions[0][0]).__name__ == "_FusedBlockDiffAttentionBackward"
    # auto takes the block method from 64 rows with the kernel, sdpa below
    assert kernels.diff_method("auto")(q, k, v, lam, scale=8**-0.5).transpose(1, 2).is_contiguous()
    short = (q[..., :32, :], k[..., :32, :], v[:, :, :32], lam)
    assert not kernels.diff_method("auto")(*short, scale=8**-0.5).transpose(1, 2).is_contiguous()


def test_other_dtypes_and_switched_off_kernel_take_the_pytorch_block_method(kernel, monkeypatch):
    q, k, v, lam = inputs(1, 2, 2, 64, 64, 8, torch.bfloat16)
    out = kernels.diff_method("block")(q, k, v, lam, scale=8**-0.5)
    assert type(out.grad_fn).__name__ == "_BlockDiffAttentionBackward"
    monkeypatch.setenv("DIFFTX_CPU_KERNEL", "0")
    q, k, v, lam = inputs(1, 2, 2, 64, 64, 8, torch.float32)
    assert type(kernels.diff_method("block")(q, k, v, lam, scale=8**-0.5).grad_fn).__name__ == (
        "_BlockDiffAttentionBackward"
    )


def test_a_failed_build_warns_once_and_the_block_method_still_runs(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("Error building extension: g++: command not found")

    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setenv("DIFFTX_CACHE", str(tmp_path))
    q, k, v, lam = inputs(2, 2, 1, 70, 70, 8, torch.float64)
    with pytest.warns(RuntimeWarning, match=r"could not be built \(Error building extension: g\+\+: command not fo"):
        out = kernels.diff_method("block")(q, k, v, lam, scale=8**-0.5)
    assert type(out.grad_fn).__name__ == "_BlockDiffAttentionBackward"
    torch.testing.assert_close(out, differential_attention(q, k, v, lam, scale=8**-0.5)[0], rtol=1e-10, atol=1e-12)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process, not per call
        kernels.diff_method("block")(q, k, v, lam, scale=8**-0.5)


def test_the_build_directory_changes_with_the_cpu_and_the_cache_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFTX_CACHE", str(tmp_path))
    here = cpu_kernel.build_directory()
    assert here.parent == tmp_path / "kernels" and torch.__version__ in here.name
    monkeypatch.setattr(cpu_kernel, "_cpu_flags", lambda: "flags : fpu sse2")  # a node without this CPU's extensions
    assert cpu_kernel.build_directory() != here


def test_builds_compile_a_copy_of_the_source_inside_the_keyed_directory(monkeypatch, tmp_path):
    """ninja records the source's path: compiling a copy kept in the content-keyed directory lets two checkouts (or a
    checkout and an installed wheel) of the same source share one build instead of rebuilding each other's."""

    from torch.utils import cpp_extension

    compiled = []
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: compiled.append(kwargs["sources"]))
    monkeypatch.setattr(cpu_kernel, "_register_fake", lambda: None)  # nothing was loaded to register, once per process
    monkeypatch.setenv("DIFFTX_CACHE", str(tmp_path))
    assert cpu_kernel._load()
    directory = cpu_kernel.build_directory()
    copy = directory / cpu_kernel.SOURCE.name
    assert compiled == [[str(copy)]] and copy.read_bytes() == cpu_kernel.SOURCE.read_bytes()
    os.utime(copy, (1, 1))
    other = tmp_path / "other-checkout" / cpu_kernel.SOURCE.name  # the same source elsewhere
    other.parent.mkdir()
    other.write_bytes(cpu_kernel.SOURCE.read_bytes())
    monkeypatch.setattr(cpu_kernel, "SOURCE", other)
    assert cpu_kernel._load() and cpu_kernel.build_directory() == directory
    assert compiled[-1] == [str(copy)] and copy.stat().st_mtime == 1  # same path, untouched: nothing to rebuild


def test_prefill_through_the_cache_equals_a_full_forward(kernel):
    """A 70-token prefill into a cache (the kernel with the cache's mask) and decode steps, against the plain path."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=80)
    fast = TransformerLM(ModelConfig(**cfg, attn_impl="block")).eval()
    plain = TransformerLM(ModelConfig(**cfg, attn_impl="plain")).eval()
    plain.load_state_dict(fast.state_dict())
    tokens = torch.randint(0, 64, (2, 73))
    cache = KVCache(fast, 2, 80)
    with torch.no_grad():
        steps = [fast(tokens[:, :70], cache=cache)[:, -1]]
        steps += [fast(tokens[:, i : i + 1], cache=cache)[:, -1] for i in range(70, 73)]
        full = plain(tokens)
    for i, logits in zip((69, 70, 71, 72), steps, strict=True):
        torch.testing.assert_close(logits, full[:, i], rtol=1e-4, atol=1e-4)


def test_the_kernel_refuses_a_mask_it_cannot_read_by_rows(kernel):
    q, k, v, lam = inputs(1, 2, 1, 20, 20, 8, torch.float64)
    with pytest.raises(RuntimeError, match=r"mask must be a contiguous boolean CPU tensor \(B\|1, Tq, Tk\)"):
        fused(q, k, v, lam, True, torch.ones(1, 1, 1, 20, dtype=torch.bool))  # query axis not expanded


def _good():
    """Valid arguments of the op itself: q (1, 2, 2, 6, 4), k (1, 1, 2, 6, 4), v (1, 1, 6, 8), a lambda tensor."""
    q, k, v, lam = (t.detach() for t in inputs(1, 2, 1, 6, 6, 4, torch.float32))
    return {"q": q, "k": k, "v": v, "lam": lam, "scale": 0.5, "causal": True, "mask": None, "block": 4}


BAD_INPUTS = {  # what is changed in the good arguments -> what the error must say
    "q on the meta device": ({"q": _good()["q"].to("meta")}, r"Meta|meta"),
    "k on the meta device": ({"k": _good()["k"].to("meta")}, r"Meta|meta"),
    "half-precision inputs": (
        {"q": _good()["q"].half(), "k": _good()["k"].half(), "v": _good()["v"].half()},
        "float32 or float64 inputs",
    ),
    "dtypes that differ": ({"v": _good()["v"].double()}, "must have one dtype"),
    "q not 5-D": ({"q": _good()["q"][:, :, 0]}, "must be 5-D"),
    "q without two halves": ({"q": _good()["q"][:, :, :1]}, "two halves"),
    "heads not a multiple of the groups": (
        {"q": torch.randn(1, 3, 2, 6, 4), "k": torch.randn(1, 2, 2, 6, 4), "v": torch.randn(1, 2, 6, 8)},
        "3 query heads must be a multiple of the 2 key/value heads",
    ),
    "v with extra rows": ({"v": torch.randn(1, 1, 9, 8)}, "k holds 6 positions and v 9"),
    "v with too few rows": ({"v": torch.randn(1, 1, 3, 8)}, "k holds 6 positions and v 3"),
    "batch sizes differ": ({"v": torch.randn(2, 1, 6, 8)}, "batch sizes differ"),
    "head widths differ": ({"k": torch.randn(1, 1, 2, 6, 5)}, "head widths differ"),
    "last dimension not dense": ({"q": torch.randn(1, 2, 2, 6, 8)[..., ::2]}, "must be dense"),
    "lambda with two values": ({"lam": torch.tensor([0.5, 0.5])}, "lambda must hold one value"),
    "a zero block": ({"block": 0}, "block must be positive, got 0"),
    "a negative block": ({"block": -3}, "block must be positive"),
    "a float mask": ({"mask": torch.ones(1, 6, 6)}, "mask must be a contiguous boolean CPU tensor"),
    "a mask of the wrong length": ({"mask": torch.ones(1, 6, 5, dtype=torch.bool)}, "mask must be"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
@pytest.mark.parametrize("op", ["forward", "backward"])
def test_the_op_refuses_each_bad_input_with_a_clear_error(kernel, case, op):
    """Called directly, each op checks every input before its loops run: a clear error, never a hang (a zero
    block looped forever), a crash or silently cut data (extra v rows were dropped)."""
    change, message = BAD_INPUTS[case]
    args = _good() | change
    if op == "forward":
        call = lambda: torch.ops.difftx.diff_block_forward(*args.values())  # noqa: E731
    else:
        grad = torch.randn(1, 6, 2, 8, dtype=torch.float32)
        call = lambda: torch.ops.difftx.diff_block_backward(grad, *args.values())  # noqa: E731
    with pytest.raises((RuntimeError, NotImplementedError), match=message):
        call()


def test_the_ops_pass_with_the_good_arguments(kernel):
    """The arguments the bad cases change are themselves accepted (so each refusal is for the change alone)."""
    args = _good()
    out = torch.ops.difftx.diff_block_forward(*args.values())
    assert out.shape == (1, 6, 2, 8)
    grads = torch.ops.difftx.diff_block_backward(torch.randn(1, 6, 2, 8), *args.values())
    assert [tuple(g.shape) for g in grads] == [(1, 2, 2, 6, 4), (1, 1, 2, 6, 4), (1, 1, 6, 8), ()]


@pytest.mark.parametrize("grad_shape", [(1, 6, 2, 7), (1, 5, 2, 8), (6, 2, 8)])
def test_the_backward_refuses_a_grad_out_of_another_shape(kernel, grad_shape):
    with pytest.raises(RuntimeError, match=r"grad_out must be \(B, Tq, H, dv\) = \(1, 6, 2, 8\)"):
        torch.ops.difftx.diff_block_backward(torch.randn(grad_shape), *_good().values())


def test_the_op_is_registered_for_the_cpu_key_only(kernel):
    """No catch-all kernel: the dispatcher refuses a CUDA or meta tensor before the raw loops could read it."""
    for name in ("diff_block_forward", "diff_block_backward"):
        op = getattr(torch.ops.difftx, name).default
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU")
        for key in ("CUDA", "Meta", "CompositeImplicitAutograd", "CompositeExplicitAutograd"):
            assert not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key), key


def test_a_term_64_below_its_row_s_largest_is_zero_not_subnormal(kernel):
    """float32: a score 64 or more below its row's largest adds exactly 0 (under 1.6e-28 of the row, which no float32
    sum resolves), so a sharp row makes no subnormal probabilities, nor gradients from them: x86 arithmetic on
    subnormals is many times slower (a trained DIFF V1 step took 1.24 times as long as with them flushed). Four keys
    share the row's largest score, so that e^-87 (where the exponential was clamped before) divided by the row's sum
    is subnormal; keys 4 and 5 sit 63 and 65 below it, with values large enough to show whether each was kept."""
    keys = torch.tensor([0.0, 0, 0, 0, -63, -65, -90, -90])
    q = torch.ones(1, 1, 2, 2, 1, requires_grad=True)  # d = 1, scale 1: the scores are the keys
    k = keys.view(1, 1, 1, 8, 1).expand(1, 1, 2, 8, 1).clone().requires_grad_()
    v = torch.tensor([0.0, 0, 0, 0, 1e20, 1e20, 1, 1]).view(1, 1, 8, 1).expand(1, 1, 8, 2).clone().requires_grad_()
    lam = torch.tensor(0.65, requires_grad=True)
    out = fused(q, k, v, lam, causal=False, mask=None)
    kept = 0.35 * math.exp(-63) / 4 * 1e20  # (1 - lambda) p_4 v_4, both maps alike; p_5 v_5 would add 13.5% more
    torch.testing.assert_close(out, torch.full_like(out, kept), rtol=1e-5, atol=0)
    grads = torch.autograd.grad(out, (q, k, v, lam), torch.full_like(out, 1e-3))
    tiny = torch.finfo(torch.float32).tiny
    for name, t in zip(("out", "dq", "dk", "dv", "dlambda"), (out, *grads), strict=True):
        assert not ((t != 0) & (t.abs() < tiny)).any(), f"{name} holds subnormal values"
    assert (grads[2][0, 0, 5:] == 0).all()  # the dropped keys get no value gradient at all


def test_the_build_directory_is_the_torch_installations_own(monkeypatch, tmp_path):
    """Two environments with the same torch version, each its own installation: two directories (one shared one was
    rebuilt by ninja at every switch, its build file recording the other's include and library paths)."""
    monkeypatch.setenv("DIFFTX_CACHE", str(tmp_path))
    here = cpu_kernel.build_directory()
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert cpu_kernel.build_directory() != here and cpu_kernel.build_directory().parent == here.parent


def test_a_rebuild_is_said_in_one_line(monkeypatch, tmp_path, capsys):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpu_kernel, "_register_fake", lambda: None)
    monkeypatch.setenv("DIFFTX_CACHE", str(tmp_path))
    library = cpu_kernel.build_directory() / "difftx_diff_block.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"built")
    os.utime(library, (1, 1))
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: None)  # ninja: up to date
    assert cpu_kernel._load() and capsys.readouterr().err == ""
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: library.write_bytes(b"again"))  # ninja rebuilt it
    assert cpu_kernel._load()
    assert capsys.readouterr().err == (
        f"difftransformer: rebuilt the fused CPU attention kernel in {library.parent} (ninja found its build changed)\n"
    )


@pytest.mark.slow
def test_switching_between_two_torch_installations_builds_each_once(tmp_path):
    """The same torch seen from a second folder (a link to it: another environment's copy, to ninja) and the first
    one in turn: each builds once, then neither builds again."""
    import subprocess
    import sys

    other = tmp_path / "site"
    other.mkdir()
    (other / "torch").symlink_to(os.path.dirname(torch.__file__))
    load = "from difftransformer.core.attention import cpu_kernel; assert cpu_kernel.available()"
    env = {**os.environ, "DIFFTX_CACHE": str(tmp_path / "cache")}
    said = []
    for site in (None, other, None, other):
        run_env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(site or ""), env.get("PYTHONPATH")]))}
        proc = subprocess.run([sys.executable, "-c", load], env=run_env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        said.append("building" in proc.stderr or "rebuilt" in proc.stderr)
    assert said == [True, True, False, False]
    assert len(list((tmp_path / "cache" / "kernels").iterdir())) == 2
