"""The codec core (codec, exchange, memory) and one module per algorithm family.

May import ``gradcomp.kernels`` and ``gradcomp.parallel``; never fusion, sim,
schemes or bench.
"""
