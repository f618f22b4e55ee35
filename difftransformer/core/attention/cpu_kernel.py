"""The fused CPU kernel of the block method (``csrc/diff_block.cpp``): built from source at first use, with a fallback.

The block method (``kernels.py``) on CPU, float32 or float64, runs through this kernel when it can be built: per
block of query rows, C++ loops compute both softmaxes and ``P1 - lambda P2`` (and, in backward, both softmax
backwards, their row dots and the lambda gradient) on a buffer that stays in cache, around ATen's matrix products.

Installation: nothing to do. The source ships inside the package (wheel or sdist), and the first call compiles it
with PyTorch's ``torch.utils.cpp_extension`` (a C++ compiler and ``ninja`` are needed; ``make`` builds it once when
it creates the environment). The build lands in ``$DIFFTX_CACHE`` (default ``~/.cache/difftransformer``) under a
name that includes the torch version, a hash of the source, the CPU's instruction sets (it is compiled for this CPU)
and the torch installation's folder, so a changed source, torch or machine builds it anew, and each environment
keeps its own build (switching between them rebuilds nothing). When it cannot be built (no compiler, no ninja, an
unsupported platform) a warning names the reason once and the block method runs as PyTorch operations, exact
as well and slower. ``DIFFTX_CPU_KERNEL=0`` turns the kernel off.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "diff_block.cpp"
FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]
_state: dict[str, object] = {}


def enabled() -> bool:
    """Whether the kernel may be used: not switched off by DIFFTX_CPU_KERNEL=0."""
    return os.environ.get("DIFFTX_CPU_KERNEL", "1") != "0"


def available() -> bool:
    """Whether the kernel is built and loaded (building it on the first call); False, after one warning, when it
    cannot be built."""
    if not enabled():
        return False
    if "ok" not in _state:
        _state["ok"] = _load()
    return bool(_state["ok"])


def build_directory() -> Path:
    """Where this machine's build lives: keyed by the source, the flags, the CPU's instruction sets and the torch
    installation (its version, build and folder: ninja's build file records the folder's include and library paths,
    so two environments sharing one directory rebuilt it at every switch)."""
    root = Path(os.environ.get("DIFFTX_CACHE") or Path.home() / ".cache" / "difftransformer")
    installation = f"{os.path.dirname(os.path.abspath(torch.__file__))}|{torch.version.git_version}"
    parts = [SOURCE.read_bytes(), " ".join(_flags()).encode(), _cpu_flags().encode(), installation.encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return root / "kernels" / f"torch-{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-{key}"


def _flags() -> list[str]:
    # GCC vectorises with 256-bit registers even where the CPU has 512-bit ones; the kernel's exp and row loops
    # measured 35% faster with 512 on an AVX-512 Xeon (forward's own loops 75 -> 48 ms at T 4096). Without AVX-512
    # the preference has no effect.
    native = ["-march=native", "-mprefer-vector-width=512"] if platform.machine() in ("x86_64", "AMD64") else []
    # at::parallel_for is a header template: compiled without -fopenmp it runs every task on one thread. The OpenMP
    # runtime it then calls is the one torch has loaded (not linked again here).
    openmp = ["-fopenmp"] if torch._C.has_openmp and sys.platform.startswith("linux") else []
    return FLAGS + native + openmp


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> bool:
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    directory = build_directory()
    before = _built(directory)
    if before is None:
        print("difftransformer: building the fused CPU attention kernel (once per machine and torch installation, "
              f"under a minute) in {directory}", file=sys.stderr)  # fmt: skip
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with build_lock(directory):
            cpp_extension.load(
                name="difftx_diff_block",
                sources=[str(_source_copy(directory))],
                extra_cflags=_flags(),
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
    except Exception as err:  # no compiler, no ninja, a failed build: the PyTorch block method runs instead
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        warnings.warn(
            f"difftransformer: the fused CPU attention kernel could not be built ({reason}); the block method runs "
            "as PyTorch operations instead (exact, slower). Install a C++ compiler and ninja (pip install ninja) "
            "for the kernel, or set DIFFTX_CPU_KERNEL=0 to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    if before is not None and _built(directory) != before:
        print(f"difftransformer: rebuilt the fused CPU attention kernel in {directory} (ninja found its build changed)",
              file=sys.stderr)  # fmt: skip
    _register_fake()
    return True


BUILDER = "difftx-builder.lock"  # held (flock) by the process that builds; the system drops it when that one ends
WAIT_NOTE_S = 5.0  # a wait longer than this says what it waits for, and again every STILL_WAITING_S
STILL_WAITING_S = 60.0


@contextlib.contextmanager
def build_lock(directory: Path):
    """Hold the build directory for one builder at a time: an exclusive ``flock`` on ``difftx-builder.lock``, which
    the operating system releases when its holder ends however it ends (SIGKILL included), with the holder's pid
    written in it. PyTorch's own ``lock`` file (``FileBaton``) is left behind by a builder that was killed, and every
    later build waits on it forever; held here, no live builder can own such a file, so it is removed with a
    message. A wait for a live builder says, after a few seconds, which process it waits for."""
    path = directory / BUILDER
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        _take(fd, directory)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        baton = directory / "lock"
        if baton.exists():
            baton.unlink(missing_ok=True)
            print(f"difftransformer: removed {baton}, left by a kernel build that was stopped (no builder holds it "
                  "now); building again", file=sys.stderr)  # fmt: skip
        yield
    finally:
        os.close(fd)  # releases the flock


def _take(fd: int, directory: Path) -> None:
    """Wait for the builder's flock on ``fd``, saying which process holds it when the wait is long."""
    start = time.monotonic()
    said = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        waited = time.monotonic() - start
        if waited >= WAIT_NOTE_S and (said is None or waited - said >= STILL_WAITING_S):
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            holder = holder if holder.isdigit() else "unknown"
            print(f"difftransformer: waiting for process {holder}, which is building the fused CPU attention kernel "
                  f"in {directory} ({waited:.0f} s so far; a build takes under a minute)", file=sys.stderr)  # fmt: skip
            said = waited
        time.sleep(0.2)


def _built(directory: Path) -> float | None:
    """When the built library was written (None: not built yet)."""
    times = [p.stat().st_mtime for p in directory.glob("*.so")]
    return max(times) if times else None


def _source_copy(directory: Path) -> Path:
    """The kernel's source, copied into its build directory, which is keyed by the source's content: ninja records
    the source's path, so compiling the package's own file would rebuild whenever another checkout or installed copy
    of the same source used the directory last."""
    copy = directory / SOURCE.name
    text = SOURCE.read_bytes()
    if not copy.is_file() or copy.read_bytes() != text:
        tmp = directory / f".{SOURCE.name}.{os.getpid()}.tmp"
        tmp.write_bytes(text)
        os.replace(tmp, copy)  # concurrent first builds write the same bytes; each rename is whole
    return copy


def _put_ninja_on_path() -> None:
    """PyTorch runs the first ninja on PATH. The ninja installed with this Python (the virtual environment's, or the
    ``ninja`` package's) goes first, whatever the shell: with a system ninja of another version on PATH, whether the
    environment is activated would decide which ninja builds, and each switch would rebuild the kernel (ninja's
    records differ between versions)."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.append(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    ours = [d for d in dirs if os.access(os.path.join(d, "ninja"), os.X_OK)][:1]
    path = os.environ.get("PATH", "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join(ours + [d for d in path if d not in ours])


def parallel_threads() -> int:
    """How many threads the kernel's parallel loops run on now (torch.get_num_threads() when it was built with
    OpenMP, 1 when not); 0 when the kernel is not available."""
    return int(torch.ops.difftx.parallel_threads()) if available() else 0


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel handles these inputs: CPU, float32 or float64, unit stride in the last dimension, and not
    under torch.compile (which traces the PyTorch block method and fuses its passes itself)."""
    return (
        not torch.compiler.is_compiling()
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and q.dtype == k.dtype == v.dtype
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and available()
    )


def decode_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the decode kernel handles these inputs: as ``supported``, and under torch.compile too (the op has a
    fake implementation, so a compiled decode step calls it without a graph break)."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and q.dtype == k.dtype == v.dtype
        and k.stride(-1) == v.stride(-1) == 1
        and _available_constant()
    )


@torch.compiler.assume_constant_result
def _available_constant() -> bool:
    """``available()`` as a constant of a compiled graph (whether the kernel is built does not change in a process)."""
    return available()


def fused_decode(q, k, v, lambda_full, scale, causal, mask) -> torch.Tensor:
    """Few query rows against a cache, no gradient -> A (B, H, Tq, 2d), a transposed view of token-major storage:
    one pass over the cache per key/value group. mask: None or boolean (B|1, 1, Tq, Tk)."""
    mask = _decode_mask(mask, q, k)
    out = torch.ops.difftx.diff_decode(q.contiguous(), k, v, lambda_full.detach(), scale, causal, mask)
    return out.transpose(1, 2)


def fused_decode_heads(attn, q, k, v, causal, mask) -> torch.Tensor:
    """One decode step of differential attention module ``attn`` after its projections, in one kernel call: A (as
    ``fused_decode``, with the module's ``lambda_full()``) and its per-head norm times ``head_factor`` (or, without
    the norm, the factor alone) -> (B, Tq, H, 2d), token-major, the rows out_proj reads. ``causal``: as for
    ``fused_decode`` (False with a cache, whose mask says what each slot sees)."""
    mask = _decode_mask(mask, q, k)
    norm = attn.subln
    return torch.ops.difftx.diff_decode_heads(
        q.contiguous(), k, v, attn.lambda_full(), attn.scaling, causal, mask,
        None if norm is None else norm.weight, 0.0 if norm is None else norm.eps, attn.head_factor,
    )  # fmt: skip


def _decode_mask(mask, q, k):
    """A (B|1, 1, Tq|1, Tk) mask as the decode ops read it: (B|1, Tq, Tk), contiguous; None stays None."""
    return None if mask is None else mask.expand(mask.shape[0], 1, q.shape[3], k.shape[3])[:, 0].contiguous()


def _register_fake() -> None:
    """Shapes of the decode op for torch.compile's tracing (the op itself runs only on real CPU tensors)."""

    @torch.library.register_fake("difftx::diff_decode")
    def _(q, k, v, lam, scale, causal, mask):
        return q.new_empty((q.shape[0], q.shape[3], q.shape[1], v.shape[3]))

    @torch.library.register_fake("difftx::diff_decode_heads")
    def _(q, k, v, lam, scale, causal, mask, norm_weight, eps, factor):
        return q.new_empty((q.shape[0], q.shape[3], q.shape[1], v.shape[3]))


def fused_block(q, k, v, lambda_full, scale, causal, mask, block) -> torch.Tensor:
    """The block method through the kernel -> A (B, H, Tq, 2d), a transposed view of token-major storage. mask:
    None or boolean (B|1, 1, Tq, Tk) (``kernels._block`` expands a broadcast query axis; the kernel checks)."""
    return _FusedBlockDiffAttention.apply(q, k, v, lambda_full, scale, causal, mask, block).transpose(1, 2)


class _FusedBlockDiffAttention(torch.autograd.Function):
    """Same arguments as ``kernels._BlockDiffAttention``; returns A token-major (B, Tq, H, 2d). Saves q, k, v (the
    views it was given, no copies) and recomputes each block's softmax rows in backward."""

    @staticmethod
    def forward(ctx, q, k, v, lambda_full, scale, causal, mask, block):
        mask = None if mask is None else mask[:, 0].contiguous()  # (B|1, 1, Tq, Tk) -> the kernel's (B|1, Tq, Tk)
        lam = lambda_full.detach()  # passed as a tensor: the kernel reads it, the caller never syncs on it
        out = torch.ops.difftx.diff_block_forward(q, k, v, lam, scale, causal, mask, block)
        ctx.save_for_backward(q, k, v, mask, lam)
        ctx.scale, ctx.causal, ctx.block, ctx.lam_dtype = scale, causal, block, lambda_full.dtype
        return out  # (B, Tq, H, 2d)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, mask, lam = ctx.saved_tensors
        dq, dk, dv, dlam = torch.ops.difftx.diff_block_backward(
            grad_out, q, k, v, lam, ctx.scale, ctx.causal, mask, ctx.block
        )
        return dq, dk, dv, dlam.to(ctx.lam_dtype).reshape(lam.shape), None, None, None, None


def build() -> str:
    """Build (or find) the kernel now and say so: ``make`` calls it once, ahead of the first test or demo."""
    state = "ready" if available() else "not built (see the warning above); the PyTorch block method will run"
    return f"fused CPU attention kernel: {state} ({build_directory()})"
