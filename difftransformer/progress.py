"""A live progress line for work that takes more than a few seconds: done/total, the latest loss, a smoothed
throughput and the time left (at the average pace since the start: work with pauses, such as a validation every
few steps, would swing an estimate from the recent pace many times over).

On a terminal it is one line rewritten in place (at most a few times a second), cleared to its end each time and at
most as wide as the terminal: when narrow, fields go in the order of ``DROPPED`` (the bar, the label, the elapsed
time, the pace warning's explanation, the note, the throughput, the loss, the pace warning); the count and the
time left stay.
Elsewhere (a log file, CI) it prints a plain line every ``every_s`` seconds, so a log shows progress without a flood.
"""

from __future__ import annotations

import io
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

TAU_S = 20.0  # the smoothing window of the throughput: older intervals weigh exp(-age / TAU_S)
SLOW = 2.5  # a pace this many times below the expected one is named on the line ...
SLOW_FOR_S = 30.0  # ... once it has lasted this long (a validation pause recovers sooner)
WARM_UNITS = 3  # once this many units are done, the time left shown moves by at most a third between two lines
# what a narrow terminal's line leaves out first ("why": the pace warning's explanation)
DROPPED = ("bar", "label", "elapsed", "why", "note", "rate", "loss", "pace")
CLEAR = "\x1b[K"  # erases from the cursor to the end of the line (what a longer line before left there)


def duration(seconds: float) -> str:
    """12s, 3m05s, 1h02m."""
    if not math.isfinite(seconds):
        return "?"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def batches(items, size: int, progress: Progress | None = None, tokens_per_item: int = 0) -> Iterator:
    """``items[i : i + size]`` for i = 0, size, 2 size, ...; with ``progress``, each batch done is counted on it (items
    and their tokens), and the line is closed when the loop ends."""
    try:
        for i in range(0, len(items), size):
            yield items[i : i + size]
            if progress is not None:
                done = min(i + size, len(items))
                progress.update(done, tokens=done * tokens_per_item)
    finally:
        if progress is not None:
            progress.close()


class Progress:
    """``update(done, tokens=..., loss=...)`` after each unit of work (``done`` counts units from 0 to ``total``;
    ``tokens`` is the running total of tokens processed, for the tokens/s figure); ``write(line)`` prints a line
    without breaking the live one; ``close()`` ends it. ``enabled=False`` makes every call a no-op."""

    def __init__(
        self,
        total: int,
        label: str = "",
        unit: str = "steps",
        enabled: bool = True,
        stream=None,
        every_s: float = 30.0,
        watch_pace: bool = False,
        expected: tuple[float, str] | None = None,
    ) -> None:
        """``watch_pace``: the line says when the pace stays far below its own best (for work of equal units, such
        as training steps; not for benchmarks whose calls differ); ``expected``: (units/s, what it is), a pace this
        work should reach here (e.g. measured on a reference machine), watched the same way."""
        self.total, self.label, self.unit, self.enabled = max(1, total), label, unit, enabled
        self.watch_pace, self.expected = watch_pace or expected is not None, expected
        self._best_rate = None  # the fastest smoothed pace once the smoothing has settled
        self._slow_since = None
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = 0.25 if self.tty else every_s
        self.start = self._last_t = time.monotonic()
        self._first_done = self._last_done = self._last_tokens = 0
        self._rate = self._token_rate = None  # units/s and tokens/s, smoothed
        self._shown_at, self._shown_done, self._drawn, self._shown_left = -math.inf, -1, False, None
        self._fields: dict[str, str] = {}
        self._lock = threading.Lock()  # watching() updates from a thread while the caller may write()

    def begin(self, done: int = 0, tokens: int = 0) -> None:
        """Restart the clock at ``done`` units (a resumed run counts its speed from here)."""
        self.start = self._last_t = time.monotonic()
        self._first_done, self._last_done, self._last_tokens = done, done, tokens
        self._shown_left = None

    def update(self, done: int, tokens: int | None = None, loss: float | None = None, note: str = "") -> None:
        if not self.enabled:
            return
        with self._lock:
            self._update(done, tokens, loss, note)

    def _update(self, done: int, tokens: int | None, loss: float | None, note: str) -> None:
        now = time.monotonic()
        dt = now - self._last_t
        if dt > 0 and done > self._last_done:
            weight = 1 - math.exp(-dt / TAU_S)
            rate, old = (done - self._last_done) / dt, self._rate
            self._rate = rate if old is None else old + weight * (rate - old)
            if tokens is not None:
                rate = (tokens - self._last_tokens) / dt
                old = self._token_rate
                self._token_rate = rate if old is None else old + weight * (rate - old)
                self._last_tokens = tokens
            self._last_t, self._last_done = now, done
        self._fields = {"label": self.label, "count": f"{done}/{self.total} {self.unit}"}
        if loss is not None and math.isfinite(loss):
            self._fields["loss"] = f"loss {loss:.4f}"
        if self._token_rate is not None:
            self._fields["rate"] = f"{self._token_rate:,.0f} tok/s"
        elif self._rate is not None:
            rate, per = (self._rate, "s") if self._rate >= 0.1 else (60 * self._rate, "min")
            self._fields["rate"] = f"{rate:.2f} {self.unit}/{per}"
        self._fields["note"] = note
        self._fields["pace"], self._fields["why"] = self._slow_note(now)
        if now - self._shown_at >= self.every_s or (done >= self.total and self._shown_done != done):
            self._show(now)
            self._shown_at, self._shown_done = now, done

    def _time_left(self, now: float) -> float:
        """Seconds left at the average pace of the units done since the start, counted down between units (not
        re-estimated from a unit still running), and once WARM_UNITS are done, within a third of the last line's
        time left counted down since."""
        remaining, units = self.total - self._last_done, self._last_done - self._first_done
        if remaining <= 0:
            return 0.0
        if units <= 0 or self._last_t <= self.start:
            return math.inf
        per_unit = (self._last_t - self.start) / units
        left = max(remaining * per_unit - (now - self._last_t), (remaining - 1) * per_unit)
        if units >= WARM_UNITS and self._shown_left is not None and math.isfinite(self._shown_left[0]):
            shown, at = self._shown_left
            expected = max(1.0, shown - (now - at))  # the last line's time left, counted down since
            left = min(max(left, expected * 2 / 3), expected * 4 / 3)
        return left

    def _slow_note(self, now: float) -> tuple[str, str]:
        """('pace 3.1x below ...', its explanation) when the smoothed pace has stayed SLOW times below the expected
        one (or this line's own best) for SLOW_FOR_S seconds; else ('', '')."""
        if self._rate is None or not self.watch_pace:
            return "", ""
        if now - self.start >= TAU_S:
            self._best_rate = max(self._best_rate or 0.0, self._rate)
        references = [(self._best_rate, "this run's best")] if self._best_rate else []
        references += [self.expected] if self.expected else []
        if not references:
            return "", ""
        rate, what = max(references)
        if self._rate * SLOW > rate:
            self._slow_since = None
            return "", ""
        self._slow_since = now if self._slow_since is None else self._slow_since
        if now - self._slow_since < SLOW_FOR_S:
            return "", ""
        return f"pace {rate / self._rate:.1f}x below {what}", ": other programs may be using the cores"

    def _show(self, now: float) -> None:
        fields = dict(self._fields)
        left = self._time_left(now)
        self._shown_left = (left, now)
        fields["elapsed"] = f"{duration(now - self.start)} elapsed"
        fields["left"] = f"{duration(left)} left"
        if self.tty:
            fields["bar"] = f"[{'#' * int(20 * min(1.0, self._last_done / self.total)):-<20}]"
            self.stream.write("\r" + fit(fields, self._columns() - 1) + CLEAR)
        else:
            self.stream.write(fit(fields) + "\n")
        self.stream.flush()
        self._drawn = self.tty

    def _columns(self) -> int:
        """The terminal's width now (it may have been resized): the stream's own, else COLUMNS or 80."""
        try:
            return max(20, os.get_terminal_size(self.stream.fileno()).columns)
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            return max(20, shutil.get_terminal_size().columns)

    def write(self, line: str, stream=None) -> None:
        """Print ``line`` (to stdout by default) above the live line, which is drawn again under it."""
        with self._lock:
            live = self.enabled and self._drawn
            if live:
                self.stream.write("\r" + CLEAR)
                self.stream.flush()
            print(line, file=sys.stdout if stream is None else stream, flush=True)
            if live:
                self._show(time.monotonic())

    @contextmanager
    def watching(self, count: Callable[[], int], every_s: float = 1.0, after: str = "") -> Iterator[Progress]:
        """Poll ``count()`` (units done, e.g. steps of worker processes) from a thread every ``every_s`` seconds and
        show it, until the block ends; then show the last count and close the line. ``after`` is shown once the
        count is complete while the block still works (e.g. "evaluating")."""
        stop = threading.Event()

        def poll() -> None:
            while not stop.wait(every_s):
                done = count()
                self.update(done, note=after if done >= self.total else "")

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            self.update(count())
            self.close()

    def close(self) -> None:
        with self._lock:
            if self.enabled and self._drawn:
                self.stream.write("\n")
                self.stream.flush()
                self._drawn = False


def fit(fields: dict[str, str], width: int | None = None) -> str:
    """The line of ``fields`` (bar, label, count, loss, rate, note, pace and its why, elapsed, left; empty ones
    left out), without those named first in DROPPED until it is at most ``width`` characters (cut there if the count
    and time left alone are wider)."""
    fields = {name: text for name, text in fields.items() if text}
    for name in (None, *DROPPED):
        fields.pop(name, None)
        time_part = ", ".join(fields[k] for k in ("elapsed", "left") if k in fields)
        pace = fields.get("pace", "") + fields.get("why", "")
        parts = [fields.get(k, "") for k in ("label", "count", "loss", "rate", "note")] + [pace, time_part]
        line = "  ".join(part for part in parts if part)
        line = f"{fields['bar']} {line}" if "bar" in fields else line
        if width is None or len(line) <= width:
            return line
    return line[: max(0, width)]
