"""The documentation site's build hooks (mkdocs.yml `hooks`), so that the site works offline and cannot drift from
the code: formulas become MathML at build time (the browser draws them; no script, no CDN), the Results page shows
every figure of the committed reports, and the command-line page lists every flag of every command, read from
difftx's own parsers."""

from __future__ import annotations

import argparse
import html
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[2]
REPORTS = ROOT / "experiments" / "reports"
RESULTS_MARK = "<!-- the committed reports' figures -->"
CLI_MARK = "<!-- every command's flags -->"
MATH = re.compile(r'<(span|div) class="arithmatex">\\[(\[](.*?)\\[)\]]</\1>', re.S)


def on_files(files, config):
    """The committed reports' figures, from outside docs/, as files of the site (the Results page shows them)."""
    for figure in sorted(REPORTS.glob("*/*.png")):
        files.append(File(str(figure.relative_to(ROOT)), str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if RESULTS_MARK in markdown:
        markdown = markdown.replace(RESULTS_MARK, results_markdown())
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, cli_markdown())
    return markdown


def on_page_content(content: str, page, config, files) -> str:
    """Each formula (pymdownx.arithmatex's generic output) as MathML."""
    from latex2mathml.converter import convert

    def mathml(match: re.Match) -> str:
        display = "block" if match.group(1) == "div" else "inline"
        return convert(html.unescape(match.group(2)).strip(), display=display)

    return MATH.sub(mathml, content)


def results_markdown() -> str:
    """One section per committed report: its heading, what it can answer (its README.md: a report whose models
    never learned says so there), its first paragraph and every figure beside it."""
    parts = []
    for section in sorted(REPORTS.glob("*/section.md")):
        figures = sorted(section.parent.glob("*.png"))
        if not figures:
            continue
        lines = section.read_text(encoding="utf-8").split("\n\n")
        heading = lines[0].lstrip("# ").strip()
        first = next((p for p in lines[1:] if p.strip() and not p.lstrip().startswith(("|", "#", "!", "-", "**"))), "")
        where = section.parent.relative_to(ROOT)
        about = section.parent / "README.md"
        if not about.is_file():
            raise ValueError(f"{about.relative_to(ROOT)} is missing: each report says what it can answer there")
        label = about.read_text(encoding="utf-8").strip()
        parts.append(f"## {heading} (`{section.parent.name}`)\n\n{label}\n\n{first.strip()}\n\n"
                     f"The report: `{where}/section.md`.")  # fmt: skip
        parts += [f"![{figure.stem}]({figure.relative_to(ROOT)})" for figure in figures]
    return "\n\n".join(parts)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def cli_markdown() -> str:
    """Every command: what it does, a table of its arguments (flag, default, meaning) and its examples."""
    from difftransformer.apps.cli import build_parser
    from difftransformer.apps.cli.parsing import leaf_commands, shown_default

    parts = []
    for path, parser in leaf_commands(build_parser()):
        rows = ["| argument | default | what it is |", "|---|---|---|"]
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            name = ", ".join(f"`{flag}`" for flag in action.option_strings) or f"`{action.dest}` (positional)"
            if action.choices and not isinstance(action, argparse._SubParsersAction):
                name += " " + "/".join(f"`{choice}`" for choice in action.choices)
            shown = shown_default(action)
            default = "required" if action.required and action.option_strings else "" if shown is None else f"`{shown}`"
            help_text = re.sub(r" \(default [^)]*\)$", "", action.help or "")
            rows.append(f"| {name} | {default} | {_cell(help_text)} |")
        example = "\n".join(line.strip() for line in (parser.epilog or "").splitlines()[1:])
        parts.append(f"### `difftx {' '.join(path)}`\n\n{_cell(parser.description or '')}\n\n" + "\n".join(rows)
                     + f"\n\nExample:\n\n```bash\n{example}\n```")  # fmt: skip
    return "\n\n".join(parts)
