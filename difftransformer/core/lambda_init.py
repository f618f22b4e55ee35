"""The paper's lambda_init schedule: a leaf that the attention and the per-head norm's gain rule both read."""

from __future__ import annotations

import math


def lambda_init_fn(layer_idx: int) -> float:
    """The paper's lambda_init schedule, ``0.8 - 0.6 exp(-0.3 layer_idx)``, with layer_idx counted from 0.

    Args:
        layer_idx: the layer's index, from 0.

    Returns:
        The layer's lambda_init.

    Examples:
        >>> [round(lambda_init_fn(layer), 4) for layer in range(4)]
        [0.2, 0.3555, 0.4707, 0.5561]
    """
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)
