"""Benchmarks of gradcomp: runnable modules that print tables and write JSON.

``python -m bench compress`` times compress + decompress of every
compressor on a model's gradient, layer-wise and fused, against a memory-bandwidth
floor measured in the same run (paper 000 §3.1, Table 1). Benchmarks measure;
tests check (they are not run by pytest).
"""
