"""Training: tokenizers, corpora and token data, the training configuration and loop, checkpoints, data
parallelism, interrupts, and the run directory (its layout and ``load_run``). Builds on the core."""
