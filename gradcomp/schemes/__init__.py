"""Training schemes whose workers' params differ.

A scheme wraps the worker's local optax optimizer and returns an
``optax.GradientTransformation`` whose ``update(grads, state, params)`` takes
raw gradients and the worker's own params and returns the update that makes
the params what the scheme says. May import ``gradcomp.compressors``,
``gradcomp.parallel`` and ``gradcomp.kernels``; never fusion, train or bench.
"""
