"""Naive ``jax.numpy`` peers of gradcomp's compressors, for the compress suite.

Each peer is the algorithm written the obvious way, one function of one tensor
(``x -> decompressed x``, one worker), lifted over a list of tensors inside one
``jit`` by :func:`lift`: the "per tensor" peer gets the model's 161 tensors, the
"one buffer" peer a list holding the pre-flattened gradient. :func:`lift` adds
the obvious error feedback (``e = r + g``, ``r = e - out``, no finite check)
when asked, so that compressors gradcomp runs with error feedback are compared
with a peer doing the same work (ISSUE 18). Obvious choices, as a user would
write them and as ``PERFORMANCE_NOTES.md``'s naive-JAX column measured:

* random-k draws its ``k`` indices with ``jax.random.randint`` (with
  replacement: about ``k^2 / 2d`` duplicates, 0.5 % of ``k`` at 1 %; a sample
  without replacement, ``jax.random.choice(replace=False)``, sorts ``d`` keys);
* top-k takes the exact ``lax.top_k`` of ``|x|``; DGC (momentum 0.9,
  momentum-factor masking) takes its threshold as the paper does, from the
  ``lax.top_k`` of a 1 % random sample of ``|v|``, and sends the first ``k``
  coordinates at or above it as (values, indices) (``jnp.nonzero(size=k)``),
  the payload gradcomp's DGC sends too (an exact ``lax.top_k`` of 25.6M
  values took 7.5 s on this CPU, which no DGC user would run);
* QSGD uses buckets of 512 like gradcomp's default; PowerSGD (rank 4) passes
  1-D tensors through uncompressed, as PyTorch's ``powerSGD_hook`` does, and
  treats a 1-D buffer like gradcomp, as a zero-padded near-square matrix;
* signSGD and EF-signSGD send packed sign bits (``jnp.packbits``, 1 bit per
  value, +1 for zero) and unpack them, as gradcomp's payload does; a bare
  ``jnp.sign(x)`` is one fused pass that leaves no payload (BUILD_NOTES,
  issue 18, has both);
* random numbers come from the default PRNG, one key per tensor per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Peer(NamedTuple):
  """A naive compressor over a list of float32 tensors (compress + decompress).

  Attributes:
    init: ``init(tensors) -> state``.
    update: ``update(tensors, state) -> (outputs, state)``, to be jitted with
      both arguments donated.
  """

  init: Callable[[list[jax.Array]], Any]
  update: Callable[[list[jax.Array], Any], tuple[list[jax.Array], Any]]


def _keep(x: jax.Array, ratio: float) -> int:
  return max(1, math.ceil(ratio * x.size))


def topk(x, leaf_state, key, ratio=0.01):
  del key
  flat = x.ravel()
  _, idx = jax.lax.top_k(jnp.abs(flat), _keep(x, ratio))
  return jnp.zeros_like(flat).at[idx].set(flat[idx]).reshape(x.shape), leaf_state


def randomk(x, leaf_state, key, ratio=0.01):
  flat = x.ravel()
  idx = jax.random.randint(key, (_keep(x, ratio),), 0, flat.size)
  return jnp.zeros_like(flat).at[idx].set(flat[idx]).reshape(x.shape), leaf_state


def dgc(x, leaf_state, key, ratio=0.01, momentum=0.9, sample_ratio=0.01):
  u, v = leaf_state
  u = momentum * u + x
  v = v + u
  # The paper's threshold (Lin et al. 2018 §3.1): top-k of a random sample.
  flat = v.ravel()
  n = max(1, min(flat.size, math.ceil(sample_ratio * flat.size)))
  sample = jnp.abs(flat[jax.random.randint(key, (n,), 0, flat.size)])
  thr = jax.lax.top_k(sample, _keep(sample, ratio))[0][-1]
  # The payload: (values, indices) of the first k coordinates at or above it.
  idx = jnp.nonzero(jnp.abs(flat) >= thr, size=_keep(x, ratio), fill_value=flat.size)[0]
  out = jnp.zeros_like(flat).at[idx].set(flat.at[idx].get(mode="fill", fill_value=0))
  sent = jnp.zeros(flat.shape, bool).at[idx].set(True, mode="drop").reshape(x.shape)
  return out.reshape(x.shape), (jnp.where(sent, 0.0, u), jnp.where(sent, 0.0, v))


def qsgd(x, leaf_state, key, levels=4, bucket=512):
  flat = x.ravel()
  b = jnp.pad(flat, (0, -flat.size % bucket)).reshape(-1, bucket)
  norm = jnp.linalg.norm(b, axis=1, keepdims=True)
  level = jnp.abs(b) / jnp.where(norm > 0, norm, 1.0) * levels
  xi = jnp.floor(level + jax.random.uniform(key, b.shape))
  out = norm * jnp.sign(b) * xi / levels
  return out.ravel()[: flat.size].reshape(x.shape), leaf_state


def terngrad(x, leaf_state, key):
  s = jnp.max(jnp.abs(x))
  b = jax.random.uniform(key, x.shape) * s < jnp.abs(x)
  return s * jnp.sign(x) * b, leaf_state


def _sign_bits(x):
  """``x`` through a 1-bit wire payload: packed signs, unpacked to +-1."""
  bits = jnp.packbits(x.ravel() >= 0)  # the payload: d / 8 bytes
  signs = jnp.unpackbits(bits, count=x.size).astype(jnp.float32) * 2 - 1
  return signs.reshape(x.shape)


def signsgd(x, leaf_state, key):
  del key
  return _sign_bits(x), leaf_state


def scaled_sign(x, leaf_state, key):
  del key
  return jnp.mean(jnp.abs(x)) * _sign_bits(x), leaf_state


def fp16(x, leaf_state, key):
  del key
  return x.astype(jnp.float16).astype(jnp.float32), leaf_state


def powersgd(x, q, key):
  del key
  if q is None:  # PyTorch's hook: 1-D tensors go uncompressed.
    return x, q
  if x.ndim >= 2:
    m = x.reshape(-1, x.shape[-1])
  else:  # the one buffer: near-square, zero-padded (as gradcomp does).
    rows = math.isqrt(x.size - 1) + 1
    m = jnp.pad(x, (0, rows * q.shape[0] - x.size)).reshape(rows, q.shape[0])
  p, _ = jnp.linalg.qr(m @ q)
  q = m.T @ p
  return (p @ q.T).ravel()[: x.size].reshape(x.shape), q


def _powersgd_init(x, alone, rank=4):
  if x.ndim >= 2:
    cols = x.shape[-1]
  elif alone:  # the one buffer
    cols = -(-x.size // (math.isqrt(x.size - 1) + 1))
  else:
    return None
  return jax.random.normal(jax.random.PRNGKey(0), (cols, rank))


def _none(x, alone):
  del x, alone


def _dgc_init(x, alone):
  del alone
  return jnp.zeros_like(x), jnp.zeros_like(x)


# label -> (per-tensor function, its state's init(x, alone), gradcomp's row has
# error feedback). DGC's memory is part of the algorithm, so it has no flag.
PEERS: dict[str, tuple[Callable, Callable, bool]] = {
  "fp16": (fp16, _none, False),
  "topk": (topk, _none, True),
  "randomk": (randomk, _none, True),
  "dgc": (dgc, _dgc_init, False),
  "qsgd": (qsgd, _none, False),
  "terngrad": (terngrad, _none, False),
  "signsgd": (signsgd, _none, False),
  "ef_signsgd": (scaled_sign, _none, True),
  "powersgd": (powersgd, _powersgd_init, True),
}


def lift(label: str, error_feedback: bool) -> Peer:
  """The peer of ``label`` over a list of tensors, with or without error feedback."""
  fn, leaf_init, _ = PEERS[label]

  def init(xs):
    residuals = [jnp.zeros_like(x) for x in xs] if error_feedback else None
    return jax.random.PRNGKey(1), residuals, [leaf_init(x, len(xs) == 1) for x in xs]

  def update(xs, state):
    key, residuals, leaf_states = state
    key, *keys = jax.random.split(key, len(xs) + 1)
    es = [r + x for r, x in zip(residuals, xs, strict=True)] if error_feedback else xs
    outs, new_states = [], []
    for e, s, k in zip(es, leaf_states, keys, strict=True):
      out, s = fn(e, s, k)
      outs.append(out)
      new_states.append(s)
    if error_feedback:
      residuals = [e - out for e, out in zip(es, outs, strict=True)]
    return outs, (key, residuals, new_states)

  return Peer(init, update)
