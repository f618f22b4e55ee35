"""Interop with Hugging Face ``transformers``: the weight mapping and the run converters."""
