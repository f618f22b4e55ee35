"""Training: the training configuration and loop, the optimizer step, evaluation during training, data parallelism,
interrupts, health checks and metric tracking. Builds on the core and the store (run directories, checkpoints,
tokenizers, data)."""
