"""Inference: the key/value cache, generation and sampling, perplexity with lm-eval, activation statistics and
post-training quantization. Builds on the core and the store (run directories, tokenizers, data)."""
