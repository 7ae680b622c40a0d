"""One definition per architecture of the papers (flax), and the shapes derived from it.

Imports nothing else from gradcomp: the training program, the cost model and the
benchmarks all read their networks from here.
"""
