"""The errors a user can cause, and the range checks that raise them for every config.

``InputError`` is bad input: a value out of range, a missing or corrupt file, a shape that does not divide. The CLI
prints it as one line and exits 2; any other exception is a defect and keeps its traceback. ``ConfigError`` names
the config field, so that the CLI can name the flag instead. ``TrainingDiverged`` and ``Interrupted`` end a
training run on purpose, each with its last checkpoint intact.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# the optional extras of pyproject.toml, by the top-level module each one provides: what to pip install when an
# import fails (the CLI's message, the tests' skip reasons)
OPTIONAL_EXTRA = {
    "transformers": "hf",
    "matplotlib": "plot",
    "lm_eval": "eval",
    "accelerate": "eval",
    "triton": "triton",
    "yaml": "yaml",
    "tensorboard": "track",
    "wandb": "track",
}


def install_hint(extra: str) -> str:
    """How to install an extra here: ``pip install 'difftransformer[hf]'``, or, in a checkout of the repository (an
    editable install beside its pinned requirements-dev.txt), the checkout's way: an unpinned install there would
    fetch versions that ``make test`` later replaces."""
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "requirements-dev.txt").is_file() and (checkout / "pyproject.toml").is_file():
        return (
            f"in this checkout, `make test` installs every extra into .venv (or, for this one alone: "
            f".venv/bin/pip install -e '.[{extra}]' -c requirements-dev.txt)"
        )
    return f"pip install 'difftransformer[{extra}]'"


class InputError(ValueError):
    """Bad input from the user, with a message that names the problem and the fix. A setting the user can change
    is written as `field` (its argument or config name); the CLI names its flag instead (``name_fields``)."""


def name_fields(message: str, name_of: Callable[[str], str]) -> str:
    """``message`` with every `field` replaced by ``name_of(field)``."""
    return re.sub(r"`(\w+)`", lambda m: name_of(m.group(1)), message)


class ConfigError(InputError):
    """A config field with a value out of its range. ``problem`` may name other fields as `field`."""

    def __init__(self, owner: str, field: str, problem: str) -> None:
        self.owner, self.field, self.problem = owner, field, problem
        super().__init__(self.render(lambda name: f"{owner}.{name}" if name == field else name))

    def render(self, name_of: Callable[[str], str]) -> str:
        """The message with every field written as ``name_of(field)`` (the CLI gives its flags)."""
        return f"{name_of(self.field)} " + name_fields(self.problem, name_of)


class TrainingDiverged(RuntimeError):
    """The run diverged (non-finite steps, or a state that is not healthy) and stopped without saving.
    ``init_from`` is the checkpoint to start a new run from (None: start again), ``lr`` a lower learning rate."""

    def __init__(self, message: str, init_from=None, lr: float | None = None) -> None:
        self.init_from, self.lr = init_from, lr
        super().__init__(message)


class Interrupted(Exception):
    """Training stopped on SIGINT or SIGTERM after writing a checkpoint."""

    def __init__(self, signum: int, message: str) -> None:
        self.signum = signum
        super().__init__(message)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a closed terminal) while a command runs, outside training's own handling: raised as Ctrl-C's
    KeyboardInterrupt is, so that whatever cleans up after Ctrl-C (a half-written directory removed, a demo's models
    saved) does after these too. ``discarded`` may list what was not written (fsutil.write_new_dir adds it)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signum)


class Fields:
    """Range checks of one config object's fields, each raising a ConfigError that names the field."""

    def __init__(self, obj: Any) -> None:
        self.obj, self.owner = obj, type(obj).__name__

    @classmethod
    def of(cls, owner: str, **values: Any) -> Fields:
        """Checks of a function's arguments, reported as fields of ``owner``."""
        checks = cls(SimpleNamespace(**values))
        checks.owner = owner
        return checks

    def fail(self, field: str, problem: str) -> None:
        raise ConfigError(self.owner, field, problem)

    def integer(
        self, field: str, low: int | None = None, high: int | None = None, optional: bool = False, hint: str = ""
    ) -> None:
        value = getattr(self.obj, field)
        if value is None and optional:
            return
        if not isinstance(value, int) or isinstance(value, bool) or not _within(value, low, high):
            self.fail(field, f"must be {_describe('an integer', low, high, optional)}{hint}, got {value!r}")

    def number(
        self,
        field: str,
        low: float | None = None,
        high: float | None = None,
        low_open: bool = False,
        high_open: bool = False,
        optional: bool = False,
        hint: str = "",
    ) -> None:
        """A finite int or float in [low, high] (``low_open``/``high_open`` exclude the bound)."""
        value = getattr(self.obj, field)
        if value is None and optional:
            return
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if ok and low is not None:
            ok = value > low if low_open else value >= low
        if ok and high is not None:
            ok = value < high if high_open else value <= high
        if not ok:
            opening = "(" if low_open or low is None else "["  # an infinite bound is never included
            closing = ")" if high_open or high is None else "]"
            interval = f"{opening}{_fmt(low, '-inf')}, {_fmt(high, 'inf')}{closing}"
            what = f"a finite number in {interval}" + (" or None" if optional else "")
            self.fail(field, f"must be {what}{hint}, got {value!r}")

    def choice(self, field: str, choices: Iterable[Any]) -> None:
        value, choices = getattr(self.obj, field), tuple(choices)
        if isinstance(value, bool) or value not in choices:
            self.fail(field, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")

    def boolean(self, field: str, optional: bool = False) -> None:
        value = getattr(self.obj, field)
        if value is None and optional:
            return
        if not isinstance(value, bool):
            self.fail(field, f"must be true or false{' or None' if optional else ''}, got {value!r}")

    def text(self, field: str, optional: bool = False) -> None:
        value = getattr(self.obj, field)
        if value is None and optional:
            return
        if not isinstance(value, str) or not value.strip() or "\x00" in value:
            self.fail(field, f"must be a non-empty string{' or None' if optional else ''}, got {value!r}")


def _within(value: float, low: float | None, high: float | None) -> bool:
    return (low is None or value >= low) and (high is None or value <= high)


def _fmt(bound: float | None, missing: str) -> str:
    if bound is None:
        return missing
    return f"{bound:,}" if isinstance(bound, int) else f"{bound:g}"


def _describe(kind: str, low: int | None, high: int | None, optional: bool) -> str:
    if low is not None and high is not None:
        text = f"{kind} in [{_fmt(low, '')}, {_fmt(high, '')}]"
    elif low is not None:
        text = f"{kind} >= {_fmt(low, '')}"
    else:
        text = kind
    return text + (" or None" if optional else "")
