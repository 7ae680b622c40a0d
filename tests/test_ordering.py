"""In-place updates: ``kernels.ordering`` and the compressors that rely on it.

XLA copies a donated buffer that an operation overwrites unless a data
dependency orders the overwrite after every read of the old contents
(``gradcomp/kernels/ordering.py``). These tests read the compiled program:
with the gradient and state donated, random-k and DGC must need no
temporary buffer of the gradient's size (fresh memory, page-faulted on every
call on CPU), which they did before the dependencies were added (BUILD_NOTES,
issue 18).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradcomp
from gradcomp.compressors import sparse
from gradcomp.kernels import ordering

SIZE = 1 << 18  # above selection._DIRECT_ALWAYS: DGC takes its sampled path


@pytest.mark.parametrize(
  "value", [0.0, -0.0, 1.5, -2.0, np.inf, -np.inf, np.nan, 3.4e38, 1e-45]
)
def test_zero_after_is_positive_zero_for_every_value(value):
  x = jnp.full((3,), value, jnp.float32)
  zero = jax.jit(ordering.zero_after)(x)
  assert zero.dtype == jnp.float32 and zero.shape == ()
  assert float(zero) == 0.0 and not np.signbit(float(zero))


def test_zero_after_of_an_empty_array():
  assert float(ordering.zero_after(jnp.zeros((0,), jnp.float32))) == 0.0


@pytest.mark.parametrize("first", [0.0, -0.0, np.nan, -np.inf, 7.0])
def test_one_device_exchange_hands_back_the_payload(first):
  # exchange._on_one_device materialises the payload through a conditional
  # whose predicate reads the first value; it must be true for every value.
  from gradcomp.compressors import exchange

  payload = {
    "codes": jnp.array([first, 1.0, -2.0], jnp.float32),
    "scale": jnp.array([0, 3], jnp.int8),
  }
  got = jax.jit(exchange._on_one_device)(payload)
  for key in payload:
    np.testing.assert_array_equal(got[key], payload[key])
    assert got[key].dtype == payload[key].dtype


@pytest.mark.parametrize("shape", [(), (7,), (3, 4, 5)])
def test_sparse_helpers_on_the_leaf_shape_match_the_flat_view(shape):
  x = np.arange(1, math.prod(shape) + 1, dtype=np.float32).reshape(shape)
  size = x.size
  indices = np.array([size - 1, 0, size, size // 2], np.int32)  # size: empty slot
  values = np.array([10.0, 20.0, 30.0, 40.0], np.float32)
  if size == 1:  # distinct indices: size - 1 and size // 2 are both 0
    indices, values = indices[1:3], values[1:3]
  kept = indices < size
  flat = x.reshape(-1)
  want_gather = np.where(kept, flat[np.minimum(indices, size - 1)], 0.0)
  want_zeroed, want_added, want_scattered = flat.copy(), flat.copy(), np.zeros(size)
  want_zeroed[indices[kept]] = 0.0
  want_added[indices[kept]] += values[kept]
  want_scattered[indices[kept]] = values[kept]
  i, v, a = jnp.asarray(indices), jnp.asarray(values), jnp.asarray(x)
  np.testing.assert_array_equal(sparse.gather_at(a, i), want_gather)
  for got, want in [
    (sparse.zero_at(a, i), want_zeroed),
    (sparse.add_at(a, i, v), want_added),
    (sparse.scatter_into_zeros(v, i, shape), want_scattered),
    (sparse.scatter_mean(v, i, shape, 2), want_scattered / 2),
  ]:
    assert got.shape == shape
    np.testing.assert_array_equal(got.reshape(-1), want)


def _temporaries_over_gradient(name, shape, **kwargs):
  """XLA's temporary bytes of a donated update, over the gradient's bytes."""
  tx = gradcomp.get(name, **kwargs)
  grads = {"w": jnp.zeros(shape, jnp.float32)}
  update = jax.jit(lambda g, s: tx.update(g, s, None), donate_argnums=(0, 1))
  memory = update.lower(grads, tx.init(grads)).compile().memory_analysis()
  return memory.temp_size_in_bytes / (4 * SIZE)


@pytest.mark.parametrize("shape", [(SIZE,), (512, SIZE // 512)], ids=["1d", "2d"])
@pytest.mark.parametrize(
  "name, kwargs",
  [
    ("randomk", {"ratio": 0.01}),
    ("randomk", {"ratio": 0.01, "error_feedback": False}),
    ("topk", {"ratio": 0.01}),
    ("dgc", {"ratio": 0.01}),
    ("sparse_quantize", {"threshold": 0.01}),
    ("ef_signsgd", {}),
    ("threshold_quantize", {"threshold": 0.01}),
    ("terngrad", {}),
  ],
)
def test_donated_update_needs_no_gradient_sized_temporary(name, kwargs, shape):
  # Before the dependencies: 1.04 (random-k), 1.03 (without error feedback)
  # and 2.09 (DGC) gradients of fresh memory per call; what remains is the
  # O(k) payload and index work (k = 1 % of the gradient), or EF-signSGD's
  # bits (1.03 when its residual did not wait for the payload's pass). On a
  # 2-D leaf, before the sparse scatters took the leaf's shape: 1.03
  # (random-k), 2.03 (top-k), 2.09 (DGC), 3.01 (sparse quantization).
  # Threshold quantization copied both donated buffers (1.06) before its
  # writes were ordered after its payload; TernGrad materialised |g| (1.00).
  assert _temporaries_over_gradient(name, shape, **kwargs) < 0.25


def test_onebit_on_one_column_needs_only_payload_sized_temporaries():
  # A vector (a fused buffer) is one column. Before: 1.03 gradients (an int32
  # count of every sign, and each column sum's select written out for
  # XLA:CPU's YNNPACK reduction). What remains is work on the d/8 payload
  # bytes: their uint32 row sums (1/8 of the gradient's bytes), the bytes
  # (1/32) and their int32 popcounts (1/8), 0.28 in all.
  assert _temporaries_over_gradient("onebit_sgd", (SIZE,)) < 0.3


def test_dynamic_fixed_point_writes_its_output_over_the_gradient():
  # The output (decoded from the payload) overwrites the donated gradient; it
  # must wait for both overflow counts, which read the gradient too. With
  # the order read from one count only, XLA copied the whole gradient.
  tx = gradcomp.get("dynamic_fixed_point", bits=12)
  grads = {"w": jnp.zeros((SIZE,), jnp.float32)}
  update = jax.jit(lambda g, s: tx.update(g, s, None), donate_argnums=(0, 1))
  text = update.lower(grads, tx.init(grads)).compile().as_text()
  assert f"f32[{SIZE}]{{0}} copy(" not in text
