"""LayerFusion (paper 000 §4): plans, gradient-ready order, profiling and the search.

``python -m gradcomp.fusion`` compares plans for a built-in model on a described
cluster (:mod:`gradcomp.fusion.cli`). Imports compressors, parallel and sim.
"""
