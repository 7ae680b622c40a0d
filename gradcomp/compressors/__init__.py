"""The codec core (codec, exchange, memory; DESIGN §1) and one module per algorithm family.

May import ``gradcomp.kernels`` and ``gradcomp.parallel``; never fusion, sim,
schemes or bench.
"""
