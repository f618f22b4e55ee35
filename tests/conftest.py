import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


def randomize_diff_params(attn, scale: float = 0.5) -> None:
    """Move lambda vectors far from zero and make subln.weight non-trivial, so tests can see them."""
    with torch.no_grad():
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            getattr(attn, name).normal_(0.0, scale)
        attn.subln.weight.uniform_(0.5, 1.5)
