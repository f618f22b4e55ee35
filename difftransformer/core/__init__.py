"""The core: the model's shape (config), rotary embedding, layers, the attention variants and the decoder model.

Imports nothing of the layers above it (training, inference, interop, apps): only torch and the foundation
modules ``difftransformer.errors`` and ``difftransformer.fsutil``.
"""
