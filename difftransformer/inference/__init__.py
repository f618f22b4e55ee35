"""Inference: the key/value cache, generation and sampling, evaluation (loss, bits per byte), and post-training
quantization. Builds on the core and on training's run directories."""
