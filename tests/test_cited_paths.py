"""What the committed reports say of themselves (#48): every path a report, result or log cites exists (reports once
cited `reports/icl5` and `reports/needle5`, the scratch folders their models were made in, which no checkout has),
and each report says what it can answer, a failed one first.

A citation is a path in backticks or a Markdown link. Within the committed results (experiments/, benchmarks/results/)
and the README, one that starts with a folder of the repository, or is relative to its own file, must exist; one with
``*`` must match a file; ``file.py::test_name`` must name a test of that file. A command in backticks (it has
spaces) is not a citation: its ``--out`` is where it writes.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CITING = ("experiments/", "benchmarks/results/", "README.md")
TICKED = re.compile(r"`([^`\s]+)`")
LINKED = re.compile(r"\]\(([^)\s#]+)")


def _committed() -> list[str]:
    try:
        done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (an unpacked sdist): the committed files are unknown")
    return [n for n in done.stdout.split("\0") if n]


def _committed_markdown() -> list[str]:
    return [n for n in _committed() if n.endswith(".md") and n.startswith(CITING)]


def _tops() -> tuple[str, ...]:
    """The repository's committed folders, 'docs/' and the like (not what a run made in this checkout)."""
    return tuple(sorted({n.split("/")[0] + "/" for n in _committed() if "/" in n}))


def missing_citations(name: str, text: str, tops: tuple[str, ...]) -> list[str]:
    """The cited paths of ``text`` (the file ``name``) that do not exist."""
    here = (ROOT / name).parent
    cited = [m.group(1).rstrip(".,;:") for m in TICKED.finditer(text)]
    cited = [c for c in cited if "/" in c and "://" not in c and (c.startswith(tops) or (here / c).exists())]
    cited += [m.group(1) for m in LINKED.finditer(text) if "://" not in m.group(1)]
    found = []
    for path in cited:
        file, _, test = path.partition("::")
        bases = [ROOT, here]
        if "*" in file:
            ok = any(next(base.glob(file), None) for base in bases)
        else:
            target = next((base / file for base in bases if (base / file).exists()), None)
            ok = target is not None and (not test or f"def {test}(" in target.read_text())
        if not ok:
            found.append(f"{name}: {path}")
    return found


def test_the_check_finds_a_missing_citation_and_passes_real_ones():
    tops = _tops()
    assert missing_citations("experiments/x.md", "see `reports/needle5` and `benchmarks/results/none.md`",
                             tops + ("reports/",)) == ["experiments/x.md: reports/needle5",
                                                       "experiments/x.md: benchmarks/results/none.md"]  # fmt: skip
    assert missing_citations("experiments/x.md", "[r](reports/none.md), `tests/test_threads.py::nope`", tops) == [
        "experiments/x.md: tests/test_threads.py::nope", "experiments/x.md: reports/none.md"]  # fmt: skip
    fine = ("`experiments/LOG.md`, `experiments/calibration/results/round*_grid.json`, "
            "`tests/test_cited_paths.py::test_no_committed_report_cites_a_missing_path`, "
            "`difftx repro icl --out reports/icl5`, [the log](LOG.md)")  # fmt: skip
    assert missing_citations("experiments/x.md", fine, tops) == []


def test_no_committed_report_cites_a_missing_path():
    """The default output folders of difftx (reports/, runs/: never committed) are citations in a report; the
    README names them as what its commands write."""
    found = []
    for name in _committed_markdown():
        tops = _tops() + (() if name == "README.md" else ("reports/", "runs/"))
        found += missing_citations(name, (ROOT / name).read_text(encoding="utf-8"), tops)
    assert not found, "cited paths that do not exist:\n" + "\n".join(found)


REPORTS = ROOT / "experiments" / "reports"
NEVER_LEARNED = "**The models never learned the task"


def _at_chance(result: dict) -> bool:
    """Whether every accuracy of an ICL report, both models, every class count and shot count, lies within 4
    standard errors of chance (1/C): models that never learned."""
    size = result["spec"]["task"]["eval_size"]
    for e in result["evals"]:
        for c, accuracies in e["shots"].items():
            p = 1 / int(c)
            if any(abs(a - p) > 4 * (p * (1 - p) / size) ** 0.5 for a in accuracies):
                return False
    return True


@pytest.mark.parametrize("report", sorted(p.parent.name for p in REPORTS.glob("*/section.md")))
def test_each_report_says_what_it_can_answer_and_a_failed_one_says_so_first(report):
    """#48: two ICL reports whose models were both at chance appeared on the Results page unlabelled. Each report
    has a README.md (the Results page shows it first); an ICL report at chance opens it, and its section, with
    NEVER_LEARNED, and one that learned does not."""
    import json

    label = (REPORTS / report / "README.md").read_text(encoding="utf-8")
    assert len(label.split()) >= 20, f"{report}/README.md says too little about what the report can answer"
    result = json.loads((REPORTS / report / "results.json").read_text())
    if result.get("experiment") == "icl":
        failed = _at_chance(result)
        assert label.startswith(NEVER_LEARNED) == failed, report
        assert (NEVER_LEARNED in (REPORTS / report / "section.md").read_text()) == failed, report


def test_the_layout_guide_names_every_module():
    """docs/guide/layout.md places every module of the package (a module added or renamed without it fails here)."""
    guide = (ROOT / "docs" / "guide" / "layout.md").read_text()
    package = ROOT / "difftransformer"
    modules = [p for p in sorted(package.rglob("*")) if p.suffix in (".py", ".cpp") and p.name != "__init__.py"]
    missing = [str(p.relative_to(package)) for p in modules if p.name not in guide]
    assert len(modules) > 80 and not missing, missing
