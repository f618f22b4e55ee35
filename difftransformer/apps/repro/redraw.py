"""Write the reports and draw the figures of committed studies and benchmark results again from their saved
results, with this version's report code and figure style, no training and no model:
``python -m difftransformer.apps.repro.redraw PATH ...``, each PATH a report directory (its results.json; lm: its
measures too) or a `difftx bench context` JSON store. A report's section.md (and report.md, the suite's wrapper of it,
where there is one) is written again, unless its results come from an older version whose fields the text no longer
reads (then the text is kept and a line says so). Every committed figure is drawn this way except a report's
allocation_rows.png, which needs the trained models (`difftx repro allocation --models`)."""

from __future__ import annotations

import sys
from pathlib import Path

from difftransformer.errors import InputError
from difftransformer.fsutil import read_json_object


def redraw(path: str | Path) -> list[Path]:
    """The report and figures of ``path`` written again; returns the files that changed."""
    path = Path(path)
    if path.suffix == ".json":  # a bench context store: its figure beside it
        from difftransformer.apps import bench_context

        figure = path.with_suffix(".png")
        bench_context.figure(read_json_object(path), figure)
        return [figure]
    result = read_json_object(path / "results.json")
    files = [*path.glob("*.png"), path / "section.md", path / "report.md"]
    before = {p: p.read_bytes() for p in files if p.is_file()}
    experiment = _experiment(result)
    if experiment == "lm":  # its report reads the measures of every run, beside results.json
        from difftransformer.apps.repro import lm_report

        if (path / "measures").is_dir():
            lm_report.write_study(path)
        else:
            lm_report.draw(result, path)
            print(f"{path}: figures drawn; its text is kept as it is: it has no measures/ to read", file=sys.stderr)
    else:
        _write(experiment, result, path)
    now = [*path.glob("*.png"), path / "section.md", path / "report.md"]
    return sorted(p for p in now if p.is_file() and before.get(p) != p.read_bytes())


# Results an older version wrote, in fields the report's text no longer reads (their figures are still drawn):
# the ICL task's training shots were one number before they became a range
OLDER = {"icl": lambda result: not isinstance(result["spec"]["task"]["shots"], list)}


def _write(experiment: str, result: dict, path: Path) -> None:
    import importlib

    module = importlib.import_module(f"difftransformer.apps.repro.{experiment}")
    module.draw(result, path)
    if OLDER.get(experiment, lambda _: False)(result):
        print(f"{path}: figures drawn; its text is kept as it is: the results come from an older version, whose "
              "fields this report does not read", file=sys.stderr)  # fmt: skip
        return
    text = module.markdown(result)  # a failure here is a defect of the report's code, never hidden
    (path / "section.md").write_text(text)
    report = path / "report.md"  # the suite's wrapper: its title line, then the section
    if report.is_file():
        report.write_text(report.read_text().splitlines()[0] + "\n\n" + text)


def _experiment(result: dict) -> str:
    """The experiment a result comes from."""
    if result.get("experiment") in ("needle", "icl", "allocation", "lm"):
        return result["experiment"]
    if "pairs" in result and "bits" in result:  # `difftx repro quant`'s result
        return "quant"
    raise InputError("not a result of difftx repro (needle, icl, allocation, lm or quant): give a report directory")


def main(paths: list[str]) -> int:
    for path in paths:
        for changed in redraw(path):
            print(changed)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
