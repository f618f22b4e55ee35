"""`difftx`'s entry point and its exit codes, in one place: every error a user can cause becomes one line on stderr
and its exit code."""

from __future__ import annotations

import os
import signal
import sys

from difftransformer.apps.cli.parser import build_parser
from difftransformer.apps.cli.parsing import check_paths, fail, flag_namer
from difftransformer.errors import name_fields

GROUP_FAILED = 4  # the exit code of a process whose torchrun group broke
STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what stops a command: Ctrl-C, kill, a closed terminal


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit codes: 0 done, 2 bad input or a file problem (one line on stderr), 3 training
    diverged, 4 another process of the group failed (torchrun), 130/143 interrupted by SIGINT/SIGTERM, 1 a defect
    (with its traceback: please report it)."""
    code = None
    try:
        code = _start_and_run(argv)
        return code
    finally:
        if code != GROUP_FAILED:  # a broken group is torchrun's to end: destroying it could wait on a dead process
            _leave_process_group()


def _start_and_run(argv: list[str] | None) -> int:
    import threading

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in STOPS} if main_thread else {}
    try:
        if signum := _start_up_interrupted():
            return _interrupted("difftx", signum)
        return _main(argv)
    except KeyboardInterrupt as err:  # before the command started (imports, parsing): nothing was written
        return _interrupted("difftx", getattr(err, "signum", signal.SIGINT))
    finally:  # the handlers as they were (main may be called again, in a process that goes on)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _refused_allocation(err: RuntimeError) -> str | None:
    """The size in words when ``err`` is PyTorch's CPU allocator refusing memory, else None."""
    import re

    found = re.search(r"can't allocate memory: you tried to allocate (\d+) bytes", str(err))
    if found is None:
        return None
    size = int(found.group(1))
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def _leave_process_group() -> None:
    """Leave the torchrun process group a command joined (training/distributed.leave_world), while Python is
    still whole: exiting with it joined could abort a run that had succeeded. A failure to leave is reported and
    does not change the command's outcome."""
    distributed = sys.modules.get("difftransformer.training.distributed")
    if distributed is None:
        return
    try:
        distributed.leave_world()
    except Exception as err:  # the command has ended: its result and its message stand
        fail("difftx", f"leaving the process group failed ({type(err).__name__}: {err})", label="warning")


def _start_up_interrupted() -> int | None:
    """Import torch, the slow part of every command's start-up, with the stop signals held back until it is done (an
    import cut short by KeyboardInterrupt can leave a module half-initialised, and a library's bare ``except``
    can swallow it); the first that came meanwhile, or None. After it, SIGTERM and SIGHUP raise ``Stopped`` as
    SIGINT raises KeyboardInterrupt, so that every command cleans up and says so on each of them. A signal the
    process was started ignoring stays ignored (``nohup`` ignores SIGHUP; a shell's background job, SIGINT)."""
    import threading

    # OpenMP's wait policy is already set: importing the difftransformer package did it (difftransformer/threads.py)
    if threading.current_thread() is not threading.main_thread():
        import torch  # noqa: F401

        return None
    received: list[int] = []
    heard = [s for s in STOPS if signal.getsignal(s) is not signal.SIG_IGN]
    previous = {s: signal.signal(s, lambda signum, _frame: received.append(signum)) for s in heard}
    try:
        import torch  # noqa: F401
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for signum in {signal.SIGTERM, signal.SIGHUP} & set(heard):
        signal.signal(signum, _raise_stopped)
    return received[0] if received else None


def _raise_stopped(signum: int, _frame) -> None:
    from difftransformer.errors import Stopped

    raise Stopped(signum)


def _stopped(where: str, err: KeyboardInterrupt) -> int:
    """The one line of a command stopped by a signal, with what was not written (or that nothing was left half
    written: every output is written whole or not at all)."""
    discarded = getattr(err, "discarded", [])
    left = (
        f"{discarded[0]} was not written (nothing of it was left)"
        if discarded
        else "nothing half-written was left (every output is written whole or not at all)"
    )
    return _interrupted(where, getattr(err, "signum", signal.SIGINT), left)


def _interrupted(where: str, signum: int, left: str = "") -> int:
    """``where: interrupted: stopped by SIGNAME[; left]``, and the exit code 128 + the signal's number."""
    text = f"stopped by {signal.Signals(signum).name}" + (f"; {left}" if left else "")
    return fail(where, text, code=128 + signum, label="interrupted")


def _main(argv: list[str] | None) -> int:
    from difftransformer.errors import (
        OPTIONAL_EXTRA,
        ConfigError,
        InputError,
        Interrupted,
        TrainingDiverged,
        install_hint,
    )

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as done:  # --help, --version, or a malformed command line (already printed)
        return done.code
    where = args.parser.prog
    if threads := getattr(args, "cpu_threads", None):  # threads_flag's --threads
        import torch

        torch.set_num_threads(threads)
    try:
        check_paths(args)
        return args.func(args)
    except ConfigError as err:
        return fail(where, err.render(flag_namer(args.parser, err.owner)))
    except InputError as err:
        return fail(where, name_fields(str(err), flag_namer(args.parser)))
    except OSError as err:
        return fail(where, name_fields(str(err), flag_namer(args.parser)))
    except TrainingDiverged as err:
        return fail(where, name_fields(str(err), flag_namer(args.parser)), code=3)
    except Interrupted as err:
        return fail(where, str(err), code=128 + err.signum, label="interrupted")
    except KeyboardInterrupt as err:
        return _stopped(where, err)
    except MemoryError:
        return fail(where, "out of memory: use a smaller model, batch or sequence length")
    except ModuleNotFoundError as err:
        extra = OPTIONAL_EXTRA.get((err.name or "").split(".")[0])
        if extra is None:
            raise
        extra = "eval" if args.command == "eval" else extra  # lm-eval needs transformers too: one install for both
        return fail(where, f"this needs {err.name.split('.')[0]}, an optional dependency: {install_hint(extra)}")
    except BrokenPipeError:  # the reader went away (difftx ... | head): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 0
    except RuntimeError as err:
        if type(err).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch here
            first = str(err).splitlines()[0]
            return fail(where, f"out of memory on the device ({first}): use a smaller batch or model")
        if (asked := _refused_allocation(err)) is not None:  # the CPU allocator's error is a RuntimeError
            return fail(where, f"out of memory: an allocation of {asked} was refused; use a smaller batch, model or "
                               "sequence length")  # fmt: skip
        from difftransformer.training.distributed import group_failure

        if (failure := group_failure(err)) is None:
            raise
        problem = (
            f"{failure}: another process of the group stopped first (torchrun's report names it; its own error, if "
            "it printed one, is above) or hangs (`collective_timeout`)"
        )
        return fail(where, name_fields(problem, flag_namer(args.parser)), code=GROUP_FAILED)
