"""The paper's claims measured (`difftx repro`): the attention-noise experiments on synthetic tasks (multi-needle
retrieval, attention allocation, in-context learning), the language-model study, and outliers and quantization; each
trains or reads matched DIFF / standard pairs and writes a report."""
