"""`difftx` that sends itself a signal while it writes its output (run as a script: python tests/signal_at_write.py
data prepare ...), for the signal tests: DIFFTX_SIGNAL=TERM, INT or HUP arrives once every file of the new directory
is written and before it is renamed into place, the last moment at which something half-done could be left."""

import os
import signal
import sys
import time

import difftransformer.apps.analyze_outliers
import difftransformer.inference.quantize
import difftransformer.interop.convert
import difftransformer.store.data
import difftransformer.store.runs
import difftransformer.store.tokenizer  # noqa: F401 (every module that writes a new directory, imported to patch)
from difftransformer import fsutil
from difftransformer.apps.cli import main

SIGNAL = getattr(signal, "SIG" + os.environ["DIFFTX_SIGNAL"])
real = fsutil.write_new_dir


def write_new_dir(out, what, write):
    def written_then_signalled(tmp):
        write(tmp)
        os.kill(os.getpid(), SIGNAL)
        time.sleep(5)  # the handler raises here
        raise AssertionError("the signal did not stop the command")

    return real(out, what, written_then_signalled)


for module in list(sys.modules.values()):
    if getattr(module, "write_new_dir", None) is real:
        module.write_new_dir = write_new_dir
sys.exit(main())
