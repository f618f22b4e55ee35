"""Markdown tables, as the reports and the benchmarks print them."""

from __future__ import annotations

from collections.abc import Iterable


def table(header: Iterable[str], rows: Iterable[Iterable[object]]) -> list[str]:
    """The lines of a Markdown table: ``header``, its rule, and one line per row (each cell as ``str`` writes it).

    Examples:
        >>> print("\\n".join(table(["N", "accuracy"], [[1, "0.98"], [4, "0.71"]])))
        | N | accuracy |
        |---|---|
        | 1 | 0.98 |
        | 4 | 0.71 |
    """
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
