"""The paper's attention-noise claims on synthetic tasks (`difftx repro`): multi-needle retrieval, attention
allocation and in-context learning, each training matched DIFF / standard pairs and writing a report."""
