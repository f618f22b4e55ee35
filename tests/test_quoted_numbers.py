"""#56 item 7: one set of numbers. Every measured number the README and the docs quote is read from a committed
report: a number in a paragraph, a list item or a table row must be, at the precision it is written, a number of the
committed reports, results or calibration files that the block or its section names. Numbers that are not
measurements (the paper's constants, versions, preset names) are listed below with why; so are the few that are
derived from a report or from the code rather than copied, each checked by a test of its own below."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

from difftransformer import ModelConfig
from difftransformer.core.head_norm_gain import matched_gains

ROOT = Path(__file__).resolve().parents[1]
# docs/paper.md is left out: its numbers are the paper's, not these studies'
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "paper.md")]

SOURCE = re.compile(r"((?:experiments/reports|experiments/calibration/results|benchmarks/results)/[\w.-]+)")
# a decimal number or a percentage (not 1.5e-3, 1.3M or 13.1b), with its sign (none in a margin, "+-0.04", or in a
# range, "1.00-1.06")
NUMBER = re.compile(r"(?:(?<![\w.%])(\+-|[+−-]))?(?<![\w.])(\d+\.\d+|\d+(?:\.\d+)?%)(?![\w%])(?!\.\d)")
FENCED = re.compile(r"^```.*?^```", re.M | re.S)
IN_SOURCE = re.compile(NUMBER.pattern.replace(r"(?![\w%])", r"(?!\d)"))  # a source's 1.23x is 1.23
CODE = re.compile(r"`[^`]+`")  # a setting, a signature, a command or a name: cut before the page is read

# (page, pattern): numbers that are not a study's measurement, cut from the page before it is read. A pattern that no
# longer matches its page fails the test, so that the list cannot outlive what it explains.
NOT_MEASURED = [
    ("README.md", re.escape("0.8 − 0.6 · exp(−0.3 · layer)")),  # the paper's lambda_init
    ("docs/tutorials/add-to-your-model.md", re.escape("0.8 - 0.6 * exp(-0.3 * layer_idx)")),
    (None, r"95%"),  # the intervals' level
    (None, r"(?:\b(?:Python|torch|Triton|transformers`?|torchao)|`mslk`) (?:>= )?\d+\.\d+"),  # versions
    ("docs/guide/inference.md", r"4\.48|4\.57"),  # transformers' versions
    ("docs/tutorials/convert-your-llama.md", r"4\.48|4\.57"),
    # settings, not results
    ("docs/guide/modules.md", re.escape("parameter counts within 0.1%")),  # tests/test_config.py asserts it
    ("docs/cli.md", re.escape("stays 2.5 times below")),
    ("docs/guide/inference.md", re.escape("the 99.99th percentile")),
    ("docs/guide/speed.md", re.escape("each part's timeout is 1.5 times a prediction")),
    ("docs/guide/speed.md", re.escape("about 25% more saved activations")),  # by construction: 2d-wide q and k
    # the limits docs/paper.md derives from the arithmetic
    ("docs/guide/speed.md", r"is 1\.0x the baseline|1\.5x for two flash-style passes|2\.0x for the `sdpa` path"),
    ("docs/guide/reproduction.md", r"initial std \(?0\.0[27]"),
    ("docs/guide/training.md", re.escape("betas (0.9, 0.98), lr 1.5e-3 and weight decay 0.05")),
    ("docs/guide/training.md", re.escape("cosine decay to 10%, gradient clipping at\n  1.0")),
    ("docs/guide/training.md", re.escape("1.5e-3 against 1.0e-3")),
    ("docs/guide/training.md", r"1\.5 times (?:the run's|its) lowest"),
    ("docs/guide/training.md", re.escape("10.8 MB")),  # a size of the corpus's download
    # the rule's gains at initialisation, computed, not trained: test_the_quoted_gains_are_the_rules below
    ("README.md", r"2\.7 to 14 times|weights 0\.07 to 0\.38"),
    ("docs/guide/modules.md", r"(?m)2\.7 to 14 times|^\| (first|last) layer \|.*$"),
]


def _numbers(text: str, pattern: re.Pattern = NUMBER) -> list[tuple[str, float, int, bool]]:
    """(as written, value, decimals, unsigned) for each number in ``text``."""
    found = []
    for m in pattern.finditer(text):
        sign, body = m.group(1) or "", m.group(2).rstrip("%")
        value = -float(body) if sign in ("-", "−") else float(body)
        found.append((m.group(0), value, len(body.partition(".")[2]), sign in ("", "+-")))
    return found


@cache
def _source_numbers(names: frozenset[str]) -> tuple:
    text = ""
    for name in sorted(names):
        path = ROOT / name
        files = [path] if path.is_file() else sorted(path.rglob("*"))
        text += "\n".join(f.read_text() for f in files if f.suffix in (".md", ".log"))
    return tuple(_numbers(text, IN_SOURCE))


def _in(quoted, numbers) -> bool:
    """Whether a number of the source rounds to ``quoted`` at its precision (an unsigned one: either sign)."""
    _, value, decimals, unsigned = quoted
    tolerance = 0.5 * 10**-decimals + 1e-9
    for _, x, d, other_unsigned in numbers:
        if d >= decimals and abs((abs(x) - abs(value)) if unsigned or other_unsigned else (x - value)) <= tolerance:
            return True
    return False


def _blocks(text: str):
    """(block, the sources it and its section name) for each paragraph, list item and table row."""
    for section in re.split(r"\n(?=#+ )", FENCED.sub("", text)):
        names = frozenset(SOURCE.findall(section))
        section = CODE.sub("`code`", section)
        for paragraph in re.split(r"\n\s*\n", section):
            if paragraph.startswith("    "):
                continue  # an indented code block
            pieces = re.split(r"\n(?=\s*(?:\||- |\d+\. ))", paragraph)
            for piece in pieces:
                yield piece, frozenset(SOURCE.findall(piece)) | names


def _page(path: Path) -> str:
    text = path.read_text()
    for page, pattern in NOT_MEASURED:
        if page is None:
            text = re.sub(pattern, "", text)
        elif ROOT / page == path:
            assert re.search(pattern, text), f"{page} no longer matches {pattern!r}: remove it from NOT_MEASURED"
            text = re.sub(pattern, "", text)
    return text


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_number_a_page_quotes_is_in_the_committed_source_it_names(path):
    unread = []
    for block, names in _blocks(_page(path)):
        quoted = _numbers(block)
        if quoted:
            numbers = _source_numbers(names) if names else ()
            missing = [q[0] for q in quoted if not _in(q, numbers)]
            if missing:
                unread.append(f"{missing} in: {block[:100]!r} (sources: {sorted(names) or 'none named'})")
    assert not unread, "\n".join(unread)


def test_each_pattern_that_cuts_a_number_for_every_page_still_cuts_one():
    everywhere = [pattern for page, pattern in NOT_MEASURED if page is None]
    assert all(any(re.search(pattern, path.read_text()) for path in PAGES) for pattern in everywhere)


def test_the_quoted_gains_are_the_rules():
    """The matched gains that docs/guide/modules.md's table gives for tiny and small (`difftx presets --gains`; the
    larger presets take a minute), and what the README and that page say of tiny's, from the rule itself."""
    modules = (ROOT / "docs" / "guide" / "modules.md").read_text()
    rows = {
        row: re.search(rf"(?m)^\| {row} \|.*$", modules).group(0).split("|")
        for row in ("preset", "first layer", "last layer")
    }
    for name in ("tiny", "small"):
        gains = matched_gains(ModelConfig.preset(name))
        column = [c.strip() for c in rows["preset"]].index(name)
        assert (rows["first layer"][column].strip(), rows["last layer"][column].strip()) == (
            f"{gains[0]:.3f}",
            f"{gains[-1]:.3f}",
        ), name
        if name == "tiny":
            scale = f"{1 / gains[-1]:.1f} to {1 / gains[0]:.0f} times"
            weights = f"weights {gains[0]:.2f} to {gains[-1]:.2f}"
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert scale in readme and weights in readme and modules.count(scale) == 2, (scale, weights)


def test_the_demos_printed_study_numbers_are_in_the_reports_it_names(monkeypatch):
    """`make demo` prints the committed studies' findings beside its own (part 1 and part 2): each number it prints
    is in the report that its lines name."""
    from difftransformer.apps import demo, demo_icl

    monkeypatch.chdir(ROOT)  # the lines name the reports relative to the working directory
    text = "\n".join(demo.study_context() + demo_icl.study_lines(demo_icl.STEPS))
    names = frozenset(SOURCE.findall(text))
    assert {"experiments/reports/lm", "experiments/reports/lm-norm", "experiments/reports/icl"} <= names, names
    missing = [q[0] for q in _numbers(text) if not _in(q, _source_numbers(names))]
    assert not missing, (missing, text)
