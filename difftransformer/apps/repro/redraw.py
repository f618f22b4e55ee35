"""Draw the figures of reports and benchmark results again from their saved results, in the current figure style
(apps/figures.py), with no training and no model: ``python -m difftransformer.apps.repro.redraw PATH ...``, each
PATH a report directory (its results.json) or a `difftx bench context` JSON store. Every committed figure is drawn
this way except a report's allocation_rows.png, which needs the trained models (`difftx repro allocation
--models`)."""

from __future__ import annotations

import sys
from pathlib import Path

from difftransformer.errors import InputError
from difftransformer.fsutil import read_json_object


def redraw(path: str | Path) -> list[Path]:
    """The figures of ``path`` drawn again; returns the files written."""
    path = Path(path)
    if path.suffix == ".json":  # a bench context store: its figure beside it
        from difftransformer.apps import bench_context

        figure = path.with_suffix(".png")
        bench_context.figure(read_json_object(path), figure)
        return [figure]
    result = read_json_object(path / "results.json")
    before = {p: p.stat().st_mtime_ns for p in path.glob("*.png")}
    _draw(result)(result, path)
    return sorted(p for p in path.glob("*.png") if before.get(p) != p.stat().st_mtime_ns)


def _draw(result: dict):
    """The draw function of the experiment a result comes from."""
    from difftransformer.apps.repro import allocation, icl, lm_report, needle, quant

    drawers = {"needle": needle.draw, "icl": icl.draw, "allocation": allocation.draw, "lm": lm_report.draw}
    if "experiment" in result:
        return drawers[result["experiment"]]
    if "pairs" in result and "bits" in result:  # `difftx repro quant`'s result
        return quant.draw
    raise InputError("not a result of difftx repro (needle, icl, allocation, lm or quant): give a report directory")


def main(paths: list[str]) -> int:
    for path in paths:
        for figure in redraw(path):
            print(figure)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
