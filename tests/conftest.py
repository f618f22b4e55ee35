import importlib
import json
import os

import pytest

# before torch, as a user's program would: importing difftransformer first makes OpenMP's idle threads wait passively
import difftransformer  # noqa: F401

# isort: split
import torch

# The Triton kernels run in Triton's interpreter where there is no GPU (tests/test_triton.py). Triton before 3.4
# decides at decoration time, so this is set before any test module can import them.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from difftransformer.core.attention import cpu_kernel  # noqa: E402
from difftransformer.errors import OPTIONAL_EXTRA, install_hint  # noqa: E402

# the tests and benchmarks/gpu_check.py share the reader of a running run's last step
from difftransformer.store.runs import last_logged_step  # noqa: E402, F401

# lambda_init = 0.8 - 0.6 exp(-0.3 l) for layers l = 0..12, to 4 decimals (docs/paper.md section 1), written out so
# that no test re-types the formula it checks
LAMBDA_INIT = (0.2, 0.3555, 0.4707, 0.5561, 0.6193, 0.6661, 0.7008, 0.7265, 0.7456, 0.7597, 0.7701, 0.7779, 0.7836)


def optional(module: str):
    """Import an optional dependency a test needs. When it is missing the test is skipped with the reason and the
    install command, except with DIFFTX_REQUIRE_OPTIONAL=1 (make test sets it: the pinned environment has every
    extra, so nothing is skipped there unseen)."""
    if os.environ.get("DIFFTX_REQUIRE_OPTIONAL") == "1":
        return importlib.import_module(module)
    extra = OPTIONAL_EXTRA[module.split(".")[0]]
    return pytest.importorskip(module, reason=f"needs {module}: {install_hint(extra)}")


# Under pytest-xdist (make test runs one worker per core) each worker's own torch work runs on 1 thread, so that the
# workers do not oversubscribe the cores; tests that need 2 threads set them (the threads fixture), and the
# processes that tests start keep their own defaults.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}-thread")
def threads(request):
    """Run a test at 1 and at 2 torch threads (the fused kernel splits its tasks differently), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def randomize_diff_params(attn, scale: float = 0.5) -> None:
    """Move lambda vectors far from zero and make subln.weight non-trivial, so tests can see them."""
    with torch.no_grad():
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            getattr(attn, name).normal_(0.0, scale)
        attn.subln.weight.uniform_(0.5, 1.5)


WORDS = (
    "attention noise cancels when two softmax maps are subtracted and the remaining signal focuses on the answer "
    "while the transformer spreads its weights over irrelevant context tokens in long documents"
).split()


def write_corpus(root, n_docs: int = 30, words: int = 120, seed: int = 0):
    """A small corpus directory: .txt, .md and .jsonl files of pseudo-English text."""
    import json
    import random

    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    docs = [" ".join(rng.choice(WORDS) for _ in range(words)) + "." for _ in range(n_docs)]
    third = n_docs // 3
    (root / "a.txt").write_text("\n".join(docs[:third]))
    (root / "sub").mkdir(exist_ok=True)
    (root / "sub" / "b.md").write_text("# Title\n\n" + "\n\n".join(docs[third : 2 * third]))
    (root / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[2 * third :]))
    return root


@pytest.fixture
def corpus_dir(tmp_path):
    return write_corpus(tmp_path / "corpus")


def prepare_corpus(corpus, out):
    """A prepared byte-level data directory of ``corpus`` in ``out``."""
    from difftransformer.store.corpus import find_files, iter_documents
    from difftransformer.store.data import prepare
    from difftransformer.store.tokenizer import ByteTokenizer

    prepare(iter_documents(find_files([corpus])), ByteTokenizer(), out, val_every=10)
    return out


@pytest.fixture
def prepared(tmp_path, corpus_dir):
    """A prepared byte-level data directory of the small corpus."""
    return prepare_corpus(corpus_dir, tmp_path / "data")


@pytest.fixture(scope="module")
def module_data(tmp_path_factory):
    """The small corpus and its prepared data, built once per module: for runs that the module's tests only read
    (each test writes into its own tmp_path)."""
    root = tmp_path_factory.mktemp("module-data")
    corpus = write_corpus(root / "corpus")
    return corpus, prepare_corpus(corpus, root / "data")


@pytest.fixture(scope="module")
def run_and_hf(module_data, tmp_path_factory):
    """A tiny trained run (2 steps, one checkpoint) and its Hugging Face export, made once per module, for tests
    that only read them."""
    from difftransformer.apps.cli import main
    from difftransformer.training.loop import train

    root = tmp_path_factory.mktemp("run-and-hf")
    train(small_config(module_data[1], root / "run", max_steps=2, ckpt_interval=2, eval_interval=2), quiet=True)
    assert main(["convert", "--run", str(root / "run"), "--to", "hf", "--out", str(root / "hf")]) == 0
    return root / "run", root / "hf"


SMALL = {"d_model": 64, "n_layers": 2, "n_heads": 4}


def small_config(prepared, out, **overrides):
    """A TrainConfig for a 2-layer, 64-wide model on the prepared test corpus, one thread."""
    from difftransformer.training.loop import TrainConfig

    base = dict(
        data=str(prepared),
        out=str(out),
        model=dict(SMALL),
        seq_len=32,
        batch_size=4,
        max_steps=12,
        eval_interval=6,
        log_interval=1,
        ckpt_interval=4,
        eval_tokens=256,
        threads=1,
    )
    return TrainConfig(**{**base, **overrides})


def metric_rows(run_dir) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    from pathlib import Path

    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir) -> list[tuple[int, float]]:
    """(step, training loss) of every logged row of a run."""
    return [(r["step"], r["loss"]) for r in metric_rows(run_dir)]


def train_args(prepared, **flags) -> list[str]:
    """Command-line flags of `difftx train` for the small model, one thread, quiet."""
    base = dict(
        data=prepared, model=json.dumps(SMALL), seq_len=32, batch_size=4, log_interval=1, eval_tokens=256, threads=1
    )
    return [x for k, v in {**base, **flags}.items() for x in ("--" + k.replace("_", "-"), str(v))] + ["--quiet"]


def difftx(*args: str) -> list[str]:
    """The command line that runs `difftx` with this interpreter."""
    import sys

    return [sys.executable, "-m", "difftransformer", *args]


def snapshot(root) -> dict[str, str]:
    """Every file (by SHA-256) and directory under ``root``: equal snapshots mean nothing changed or appeared."""
    import hashlib
    from pathlib import Path

    root = Path(root)
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def kernel():
    """The fused CPU kernel, built (test_cpu_kernel.py, test_decode_kernel.py). In the pinned environment (make test)
    a missing build fails the test, never skips it."""
    if not cpu_kernel.available():
        if os.environ.get("DIFFTX_REQUIRE_OPTIONAL") == "1":
            pytest.fail("the fused CPU kernel did not build in the pinned environment (see the warning)")
        pytest.skip("the fused CPU kernel could not be built here (no C++ compiler or ninja)")


# The modules that take longest (seconds of summed test time in a fresh clone's make test, 2026-12-07), in that order:
# run first, so that with several workers (make test: pytest-xdist, whole modules to a worker) no long module starts
# last while the other worker idles (the Makefile passes --no-loadscope-reorder, so that xdist keeps this order).
# Only the order changes; a module missing here runs after them, in file order.
LONGEST_FIRST = [
    "test_head_norm_gain", "test_docs", "test_cli_examples", "test_distributed", "test_soak", "test_package",
    "test_kernel_lock", "test_threads", "test_demo_icl", "test_lm_long", "test_train_failures", "test_run_links",
    "test_triton_compile", "test_sharded", "test_cpu_kernel", "test_demo_env", "test_signals", "test_train",
]  # fmt: skip


def pytest_collection_modifyitems(config, items):
    from pathlib import Path

    stale = [name for name in LONGEST_FIRST if not (Path(__file__).parent / f"{name}.py").is_file()]
    assert not stale, f"tests/conftest.py LONGEST_FIRST names modules that are gone: {stale}"
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: file order within and after
