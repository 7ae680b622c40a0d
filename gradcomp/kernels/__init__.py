"""Primitives the codecs share: selection, count sketch, hashing, bit packing, numerics.

The lowest layer: imports nothing else from gradcomp (checked by the import
contracts in ``pyproject.toml``).
"""
