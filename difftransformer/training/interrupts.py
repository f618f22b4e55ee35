"""SIGINT (Ctrl-C) and SIGTERM during training: the first one is recorded, so that the loop can finish its step
and write a checkpoint; a second one stops at once (KeyboardInterrupt, or the default SIGTERM death)."""

from __future__ import annotations

import os
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Within ``with StopSignals() as s:``, ``s.received`` is the first stop signal's number (None before).

    Handlers are installed only in the main thread (elsewhere Python cannot), and the previous ones come back
    on exit."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    @staticmethod
    def name(signum: int) -> str:
        return signal.Signals(signum).name

    def _handle(self, signum: int, _frame) -> None:
        if self.received is None:
            self.received = signum
            # os.write, not print: a handler may run while print holds the stream's lock
            message = (
                f"\n{self.name(signum)}: finishing this step and writing a checkpoint "
                f"(send {self.name(signum)} again to stop at once, without one)\n"
            )
            os.write(2, message.encode())
            return
        self.__exit__()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        os.kill(os.getpid(), signum)
