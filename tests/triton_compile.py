"""Compile the Triton differential-attention kernels for GPU targets on a machine without a GPU, at the tiles the
launcher uses (triton_diff.TILES), and print what ptxas reports: one JSON line per (kernel, half-head size, dtype,
target) with registers, spilled bytes and shared memory. tests/test_triton_compile.py runs it in a subprocess:
Triton's interpreter, which the test suite turns on before anything imports Triton, would give interpreted
functions, not compilable ones.

    python tests/triton_compile.py [--targets 90 80] [--dims 16 32 64 128] [--dtypes bfloat16 float32]
        [--kernels forward ...] [--tiles BLOCK_M BLOCK_N WARPS STAGES] [--markdown]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

os.environ.pop("TRITON_INTERPRET", None)  # before Triton is imported: compiled kernels, not interpreted ones
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # Triton prints ptxas -v's report of every kernel it assembles
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, stated (3.9 warns when unset)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="difftx-triton-")  # a cached kernel reports nothing

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from difftransformer.core.attention import triton_diff  # noqa: E402

# the arguments that are sizes (i32 scalars), not pointers or strides
SIZES = {"H", "HKV", "REP", "TQ", "TK"}
FLOAT32_POINTERS = {"LAM", "LSE", "DELTA"}  # float32 whatever the inputs' dtype (triton_diff.TritonDiffAttention)
POINTER_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def signature(kernel, dtype: torch.dtype, constexprs: dict) -> tuple[dict, dict]:
    """The signature and the divisibility attributes of a launch: pointers of the inputs' dtype (16-byte aligned, as
    torch allocates them), the float32 statistics, strides that are multiples of the head size (every stride the
    launcher passes; the last one, 1, is not passed), and sizes with no assumption."""
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name == "qk_scale":
            sig[name] = "fp32"
        elif name in SIZES:
            sig[name] = "i32"
        elif name.startswith("s_"):
            sig[name], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
        else:
            sig[name] = "*fp32" if name in FLOAT32_POINTERS else "*" + POINTER_TYPES[dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def report(name: str, d: int, dtype: torch.dtype, capability: int, tiles: triton_diff.Tiles | None = None) -> dict:
    """Compile one kernel for ``sm_<capability>`` (sm_90a for 90) at its launch tiles (or ``tiles``); what ptxas
    reported."""
    kernel, tiles = triton_diff.KERNELS[name], tiles or triton_diff.tiles(name, d, dtype)
    constexprs = dict(CAUSAL=True, D=d, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                      PREC="ieee" if dtype == torch.float32 else "tf32")  # fmt: skip
    sig, attrs = signature(kernel, dtype, constexprs)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", capability, 32),
            options=dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        )
    text = log.getvalue()
    registers = re.search(r"Used (\d+) registers", text)
    if registers is None:
        raise RuntimeError(f"no ptxas report for {name} d {d} {dtype} sm_{capability}:\n{text[-2000:]}")
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
    return {
        "kernel": name, "d": d, "dtype": str(dtype).removeprefix("torch."), "target": capability,
        "tiles": [tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages],
        "registers": int(registers.group(1)), "spill_bytes": max(spills, default=0),
        "shared_bytes": compiled.metadata.shared, "ptxas": " ".join(text.split())[-400:],
    }  # fmt: skip


def _report(job: tuple) -> dict:
    return report(*job)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", type=int, nargs="+", default=[90, 80])
    parser.add_argument("--dims", type=int, nargs="+", default=list(triton_diff.HEAD_DIMS))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--kernels", nargs="+", default=list(triton_diff.KERNELS))
    parser.add_argument("--tiles", type=int, nargs=4, help="these tiles instead of the launcher's")
    parser.add_argument("--markdown", action="store_true", help="a table instead of JSON lines")
    args = parser.parse_args()
    tiles = triton_diff.Tiles(*args.tiles) if args.tiles else None
    if args.markdown:
        print(f"Triton {triton.__version__}, torch {torch.__version__}: ptxas -v of each kernel at its launch tiles")
        print("(block_m, block_n, warps, stages); shared memory as Triton allocates it\n")
        print("| target | dtype | d | kernel | tiles | registers | spill bytes | shared KiB |")
        print("|---|---|---|---|---|---|---|---|")
    jobs = [(name, d, getattr(torch, dtype), capability, tiles) for capability in args.targets
            for dtype in args.dtypes for d in args.dims for name in args.kernels]  # fmt: skip
    with ProcessPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:  # ptxas runs on one core
        for row in pool.map(_report, jobs):
            if args.markdown:
                print(f"| sm_{row['target']}{'a' if row['target'] == 90 else ''} | {row['dtype']} | {row['d']} | "
                      f"{row['kernel']} | {tuple(row['tiles'])} | {row['registers']} | {row['spill_bytes']} | "
                      f"{row['shared_bytes'] / 1024:.0f} |", flush=True)  # fmt: skip
            else:
                print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
