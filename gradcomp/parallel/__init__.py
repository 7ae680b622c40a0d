"""Running one per-worker program over a worker axis, and reading its collectives.

``workers`` adds and drops the leading worker axis and wraps an update in
``shard_map``; ``wire`` reads the bytes of every collective from a compiled
program; ``traced`` counts them from a traced one (and which depend on an input);
``topology`` describes gossip topologies (who mixes with whom, with what
weights; NumPy) and ``mixing`` mixes a tree or a compressed payload over
``ppermute``. May import ``gradcomp.kernels`` only.
"""
