"""What every command's parser shares: the one-line error parser, help with defaults, flags built from a config
dataclass, the flag that names a field, the UTF-8 check of text flags, and the one-line failure message."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from difftransformer.errors import name_fields


def command(sub, name: str, func, help: str, example: str) -> argparse.ArgumentParser:
    """The subcommand ``name`` of ``sub``, run by ``func``; its help ends with ``example`` (a whole command line, or
    several, one per line), which tests/test_cli_help.py parses with this parser."""
    command = sub.add_parser(name, help=help, description=help, epilog="example:\n" + _indent(example))
    command.set_defaults(func=func, parser=command)
    return command


def leaf_commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(the words that name it, its parser) of every command under ``parser`` that runs something (``bench train``,
    not ``bench``): what the help test and the docs' command-line reference walk."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        yield path, parser
        return
    for name, child in groups[0].choices.items():
        yield from leaf_commands(child, (*path, name))


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def config_flags(parser, config, skip: tuple[str, ...] = (), defaults: dict[str, str] | None = None) -> None:
    """One flag per field of the dataclass ``config`` (help, choices and defaults from the fields' metadata). The flags
    default to None, so that only what the user gives reaches the config (and a resume can tell what was given)."""
    for f in dataclasses.fields(config):
        if f.name in skip:
            continue
        meta = f.metadata
        default = (defaults or {}).get(f.name) or meta.get("default")
        if default is None and f.default is not dataclasses.MISSING:
            default = f.default
        elif default is None and f.default_factory is not dataclasses.MISSING:
            default = json.dumps(f.default_factory())
        shown = "" if default is None else f" (default {default})"
        text = name_fields(meta["help"], lambda name: "--" + name.replace("_", "-")) + shown
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        if kind == "bool":
            parser.add_argument(flag, action="store_true", default=None, help=text)
            continue
        convert = int if kind.startswith("int") else float if kind.startswith("float") else str
        if meta.get("path"):
            convert = PathArg(meta["path"])
        metavar = "JSON" if kind.startswith("dict") else None
        parser.add_argument(flag, type=convert, choices=meta.get("choices"), metavar=metavar, help=text)


def shown_default(action: argparse.Action) -> str | None:
    """A flag's default as help shows it (a list's items joined by spaces); None when there is none to show (None,
    False, a required flag's or a positional's)."""
    value = action.default
    if value is None or value is False or value == argparse.SUPPRESS or action.required or not action.option_strings:
        return None
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


class Formatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the default is None or False or the help already says it,
    and a required flag's with "(required)"; a text of several lines (an epilog's examples) is kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required and action.option_strings:
            return text + " (required)"
        shown = shown_default(action)
        if shown is not None and "(default" not in text:
            text += f" (default {shown})".replace("%", "%%")
        return text

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line + "\n" for line in text.splitlines())
        return super()._fill_text(text, width, indent)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): the message and where to find help; help shows defaults."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        """As argparse, but the value of a free-text flag (an action marked ``free_text``, e.g. ``--prompt``) may be
        any text: argparse reads a value that begins with '-' (``-5 degrees``) as another flag, and drops a value
        ``--``, so each such value is parsed as a stand-in (a NUL, which no command line holds, and its place) and
        put back after."""
        free = [a for a in self._actions if getattr(a, "free_text", False)]
        kept = {}
        if free and args is not None:
            args = list(args)
            flags = {o for a in free for o in a.option_strings}
            for i in range(len(args) - 1):
                if args[i] in flags and "--" not in args[:i]:
                    kept[f"\0{i}"], args[i + 1] = args[i + 1], f"\0{i}"
        namespace, rest = super().parse_known_args(args, namespace)
        for action in free:
            value = getattr(namespace, action.dest, None)
            if isinstance(value, str) and value in kept:
                setattr(namespace, action.dest, kept[value])
        return namespace, rest


def threads_flag(parser) -> None:
    """``--threads N``: the CPU threads of a command that computes; exits.py sets torch's count from it before the
    command runs (``difftx train`` takes it as a TrainConfig field, ``difftx bench`` as a benchmark's own)."""
    parser.add_argument(
        "--threads",
        dest="cpu_threads",
        type=at_least(1),
        help="CPU threads (default: torch's, one per core this process may use)",
    )


class PathArg:
    """The type of a flag that takes a path: ``input`` (paths.check_input's rule) or ``output`` (paths.check_output's
    rule). Parsing keeps the text; ``check_paths`` applies the rule to every such flag given, before the command runs,
    so that each message names its flag."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.__name__ = f"{role} path"

    def __call__(self, text: str) -> str:
        return text


INPUT, OUTPUT = PathArg("input"), PathArg("output")


def check_paths(args: argparse.Namespace) -> None:
    """Apply the path rule to every path flag of ``args.parser`` (a flag not given, None, is the command's to fill)."""
    from difftransformer.paths import check_input, check_output

    for action in args.parser._actions:
        role = getattr(action.type, "role", None)
        values = getattr(args, action.dest, None)
        if role is None or values is None:
            continue
        flag = action.option_strings[-1] if action.option_strings else action.dest.upper()
        for value in values if isinstance(values, list) else [values]:
            check_utf8(value, flag)
            if role == OUTPUT.role:
                check_output(value, flag)
            else:  # a missing input: the command says what to make or give
                check_input(value, flag, missing_ok=True)


def at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer value: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def flag_namer(parser: argparse.ArgumentParser, owner: str | None = None):
    """Field name -> the flag that sets it in this command (``n_layers (in --model)`` for model fields); a field
    without a flag keeps its name (``owner.field`` for a config's)."""
    flags = {a.dest: a.option_strings[-1] for a in parser._actions if a.option_strings}

    def name_of(field: str) -> str:
        if field in flags:
            return flags[field]
        if owner == "ModelConfig" and "model" in flags:
            return f"{field} (in --model)"
        return f"`{field}`" if owner is None else f"{owner}.{field}"

    return name_of


def check_utf8(text: str, flag: str) -> None:
    """Refuse an argument that is not UTF-8 text (Python keeps such bytes as lone surrogates)."""
    from difftransformer.errors import InputError

    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        byte = ord(text[err.start]) - 0xDC00 if "\udc80" <= text[err.start] <= "\udcff" else None
        what = f"byte 0x{byte:02x}" if byte is not None else f"character {text[err.start]!r}"
        raise InputError(
            f"{flag} is not valid UTF-8 ({what} at position {err.start}): give text in UTF-8 (check the terminal's "
            "encoding)"
        ) from None


def fail(where: str, message: str, code: int = 2, label: str = "error") -> int:
    """Print ``where: label: message`` as one line on stderr and return ``code``. One write with its newline: print
    writes the text and the newline apart, and under torchrun the processes' lines then run together on a shared
    stderr (a pipe takes one write of up to 4096 bytes, PIPE_BUF on Linux, whole)."""
    sys.stderr.write(f"{where}: {label}: {' '.join(message.split())}\n")
    sys.stderr.flush()
    return code
