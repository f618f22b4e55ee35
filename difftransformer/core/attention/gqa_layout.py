"""Which grouped-query head pairing a set of DIFF weights was trained with (docs/paper.md section 1).

This library pairs query head h with key/value group h // rep for both maps, as the authors' FlashAttention modules
do. Their naive module pairs grouped weights differently (query half-head i reads key half-head i // rep), and the
weights themselves do not say which module trained them: loading grouped-query weights that do not come from this
library warns (``GQALayoutWarning``). Weights from the naive module have no exact equivalent in this layout.
"""

from __future__ import annotations

import contextvars
import warnings
from collections.abc import Iterator
from contextlib import contextmanager


class GQALayoutWarning(UserWarning):
    """Grouped-query weights of unknown origin were loaded: their head pairing cannot be checked.

    Weights this library wrote carry their layout's version and load silently; others (a state dict from
    elsewhere) warn once, because the reference code's naive module pairs query and key/value heads differently.

    Examples:
        >>> import warnings
        >>> issubclass(GQALayoutWarning, UserWarning)
        True
        >>> warnings.simplefilter("error", GQALayoutWarning)  # make unknown pairings an error instead
        >>> warnings.resetwarnings()
    """


_OWN_LAYOUT = contextvars.ContextVar("difftransformer_own_layout", default=False)


@contextmanager
def own_layout() -> Iterator[None]:
    """Weights loaded inside come from this library (its checkpoints and converters), whose head pairing is known:
    no GQALayoutWarning for them.

    Examples:
        >>> from difftransformer import MultiheadDiffAttn
        >>> source, target = (MultiheadDiffAttn(256, 4, 0, num_kv_heads=2) for _ in range(2))
        >>> weights = {name: value for name, value in source.state_dict().items()}  # a plain dict: no version
        >>> with own_layout():
        ...     target.load_state_dict(weights)
        <All keys matched successfully>
    """
    token = _OWN_LAYOUT.set(True)
    try:
        yield
    finally:
        _OWN_LAYOUT.reset(token)


def warn_unknown_pairing(prefix: str, num_heads: int, num_kv_heads: int, version: int) -> None:
    """Warn when grouped-query weights (fewer groups than heads) of a state dict older than this library's layout
    version 2, outside ``own_layout()``, are loaded."""
    if num_kv_heads < num_heads and version < 2 and not _OWN_LAYOUT.get():
        warnings.warn(
            f"{prefix or 'MultiheadDiffAttn '}: grouped-query weights ({num_heads} heads, {num_kv_heads} key/value "
            "groups) of unknown origin: this module pairs head h with group h // rep for both maps, as the "
            "reference's FlashAttention modules do; its naive module pairs them differently (half-head i reads key "
            "half-head i // rep), so its weights load here but compute another function. Load only weights trained "
            "with the FlashAttention pairing; inside `with difftransformer.core.attention.own_layout():` this "
            "warning is off",
            GQALayoutWarning,
            stacklevel=5,
        )
