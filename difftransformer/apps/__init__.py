"""Applications on top of the library: the ``difftx`` CLI, benchmarks, the demo, analyses and the reproduction
experiments (``repro``)."""
