"""Optimizers that compress what they exchange: adaptive ones.

Compressing the gradient *before* Adam breaks error feedback (Adam's
per-coordinate normalisation rescales what was decoded); these compress the
*momentum* instead. Each is a whole optimizer, an
``optax.GradientTransformation`` returning updates, used alone (not chained
after another optimizer), and exchanging over ``axis_name`` itself.
"""
