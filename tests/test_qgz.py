"""qgz: ZeRO++'s two-hop block-int4 reduce-scatter, on a (2 x 4) mesh (issue 32).

``axis_name=("local", "node")``: hop 1 over the 4 devices of a node, hop 2
over the 2 nodes (device ``w = 4 node + local`` owns chunk ``w``). Checked
against a NumPy transcription of the hops (``kernels.blockq``'s arithmetic:
block scales, round to nearest even, averages in the exchange's order), the
error against the exact mean within the bound of its quantizations, each
hop's error feedback conserving mass, packed uint8 codes on the wire, and
the hostile-value matrix. Four programs are compiled, once each.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradcomp
from gradcomp.compressors import axes
from gradcomp.compressors.exchange import Pushes
from gradcomp.compressors.qgz import qgz_wire
from gradcomp.compressors.spec import spec_of
from gradcomp.parallel import wire

import harness

S, G = 2, 4
N = S * G
MESH = jax.make_mesh((S, G), ("node", "local"))
BOTH = ("node", "local")
HOPS = ("local", "node")  # (fast, slow)
U = 2.0**-24
BITS, BLOCK = 4, 16
Q = 2 ** (BITS - 1) - 1
SHAPES = {"kernel": (10, 13), "bias": (9,)}  # 130 values: c = 17; 9: c = 2

rng = np.random.default_rng(0)
STEPS = 3
GRADS = {
  k: rng.standard_normal((STEPS, N, *shape)).astype(np.float32)
  for k, shape in SHAPES.items()
}
PARAMS = {k: jnp.zeros(shape, jnp.float32) for k, shape in SHAPES.items()}


def _put(tree, spec):
  return jax.device_put(tree, NamedSharding(MESH, spec))


def _steps_program(txs, params):
  """A jitted shard_map running each of ``txs`` over the steps of its grads.

  ``f(grads) -> ([outputs], [states])``: outputs ``(N, steps, ...)`` (every
  device's view), final states with a leading device axis.
  """
  states = []
  for tx in txs:
    with jax.set_mesh(MESH):
      state = tx.init(params)
    states.append(_put(gradcomp.add_worker_axis(state, N), P(BOTH)))

  def per_device(grads, states):
    grads = jax.tree.map(lambda x: x[:, 0], grads)
    outs, finals = [], []
    for tx, state in zip(txs, states, strict=True):

      def body(state, g, tx=tx):
        out, state = tx.update(g, state)
        return state, out

      state, out = jax.lax.scan(body, gradcomp.drop_worker_axis(state), grads)
      outs.append(out)
      finals.append(state)
    return gradcomp.add_worker_axis((outs, finals))

  f = jax.jit(
    jax.shard_map(
      per_device, mesh=MESH, in_specs=(P(None, BOTH), P(BOTH)), out_specs=P(BOTH)
    )
  )
  return lambda grads: jax.device_get(f(_put(grads, P(None, BOTH)), states))


# --- NumPy transcription ---------------------------------------------------

_TINY = np.float32(np.finfo(np.float32).tiny)


def np_quantize(rows):
  """``(decoded, half_steps)`` of each row of float32 ``rows`` (r, m).

  Blocks of ``ceil(m / ceil(m / BLOCK))`` values; ``half_steps`` is each
  value's ``s_B / 2``, the bound of its rounding error.
  """
  r, m = rows.shape
  nb = -(-m // BLOCK)
  b = -(-m // nb)
  padded = np.zeros((r, nb * b), np.float32)
  padded[:, :m] = rows
  blocks = padded.reshape(r, nb, b)
  finite = np.where(np.isfinite(blocks), blocks, np.float32(0))
  top = np.maximum(finite.max(-1), -finite.min(-1))
  scale = np.where(top > 0, np.maximum(top * np.float32(1 / Q), _TINY), 0)
  scale = scale.astype(np.float32)
  inverse = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0)
  y = np.clip(blocks * inverse.astype(np.float32)[..., None], -Q, Q)
  codes = np.where(np.isnan(blocks), 0, np.round(y)).astype(np.float32)
  decoded = (codes * scale[..., None]).reshape(r, -1)[:, :m]
  half = np.broadcast_to(scale[..., None] / 2, blocks.shape).reshape(r, -1)[:, :m]
  return decoded.astype(np.float32), half


def np_mean_rows(rows):
  total = rows[0] / np.float32(len(rows))
  for row in rows[1:]:
    total = total + row / np.float32(len(rows))
  return total


def np_qgz(x):
  """qgz of one step: x (N, d) float32 per device.

  Returns the gathered mean (d,), the chunks (N, c) (gather=False), and the
  per-coordinate bounds of the two hops' and of the gather's rounding.
  """
  n, d = x.shape
  c = -(-d // n)
  flat = np.zeros((S, G, S * G * c), np.float32)
  flat[..., :d] = x.reshape(S, G, d)
  view = flat.reshape(S, G, S, G, c)  # [device i', j'][chunk i, j]
  # Hop 1: device (i', j') sends x[:, j] to fast peer j.
  rows = view.transpose(0, 1, 3, 2, 4).reshape(S, G, G, S * c)  # [i', j', j]
  sent1, half1 = np_quantize(rows.reshape(-1, S * c))
  sent1 = sent1.reshape(S, G, G, S * c)
  half1 = half1.reshape(S, G, G, S, c)
  y = np.stack(
    [np.stack([np_mean_rows(sent1[i, :, j]) for j in range(G)]) for i in range(S)]
  )  # [i', j] (S c)
  # Hop 2: device (i', j) sends row i of y to slow peer i.
  sent2, half2 = np_quantize(y.reshape(-1, c))
  sent2 = sent2.reshape(S, G, S, c)  # [i', j, i]
  half2 = half2.reshape(S, G, S, c)
  z = np.stack(
    [np.stack([np_mean_rows(sent2[:, j, i]) for j in range(G)]) for i in range(S)]
  )  # [i, j] (c)
  sent3, half3 = np_quantize(z.reshape(-1, c))
  # Bounds per chunk (i, j): hop 1's half-steps averaged over all devices,
  # hop 2's over the nodes.
  b1 = half1.mean(axis=(0, 1))  # [j][i, c] -> per chunk (i, j)
  b1 = b1.transpose(1, 0, 2)  # [i, j, c]
  b2 = half2.mean(axis=0).transpose(1, 0, 2)  # [i, j, c]
  two = (b1 + b2).reshape(-1)[:d]
  three = two + half3.reshape(-1)[:d]
  return sent3.reshape(-1)[:d], z.reshape(N, c), two, three


# --- The programs --------------------------------------------------------------


@functools.cache
def _plain_run():
  """One step of qgz (gather and chunks) and hierarchical(qgz over "node")."""
  txs = (
    gradcomp.qgz(bits=BITS, block_size=BLOCK, axis_name=HOPS),
    gradcomp.qgz(bits=BITS, block_size=BLOCK, axis_name=HOPS, gather=False),
    gradcomp.hierarchical(
      gradcomp.qgz(bits=BITS, block_size=BLOCK, axis_name="node"), "local"
    ),
  )
  grads = {k: g[:1] for k, g in GRADS.items()}
  return _steps_program(txs, PARAMS)(grads)[0]


@functools.cache
def _feedback_run():
  txs = (
    gradcomp.qgz(bits=BITS, block_size=BLOCK, axis_name=HOPS, error_feedback=True),
    gradcomp.qgz(
      bits=BITS, block_size=BLOCK, axis_name=HOPS, error_feedback=True, gather=False
    ),
  )
  return _steps_program(txs, PARAMS)(GRADS)


def _flat(g):
  return np.asarray(g, np.float32).reshape(g.shape[0], -1)


# --- Tests -----------------------------------------------------------------


def test_two_hops_match_the_numpy_transcription():
  """The same arithmetic in the same order: equal but for float32 rounding.

  Both compute the codes from identical float32 operations; XLA may fuse
  the division by the row count into a multiply (exact: 4 and 2 are powers
  of two), so the results agree to the last bit except where a value sits
  on a rounding boundary, which a one-ulp difference would move by a whole
  step. The data hit no such boundary, so the comparison is exact.
  """
  gathered, chunks, _ = _plain_run()
  for k, shape in SHAPES.items():
    want, want_chunks, _, _ = np_qgz(_flat(GRADS[k][0]))
    for w in range(N):
      np.testing.assert_array_equal(gathered[k][w, 0], want.reshape(shape))
      np.testing.assert_array_equal(chunks[k][w, 0], want_chunks[w])
    # The chunks, concatenated in device order, unshard to the leaf.
    full = gradcomp.fusion.unshard({k: chunks[k][:, 0].reshape(-1)}, {k: PARAMS[k]})
    np.testing.assert_allclose(
      full[k], want_chunks.reshape(-1)[: want.size].reshape(shape)
    )


def _slop(x):
  """Float32 rounding on top of the quantizations' half-steps.

  Every value handled is at most 2 max|x| (a decoded value is at most its
  block's largest magnitude); each of the G + S adds of the two averages,
  the three products codes * scale and the requantizations' inputs rounds
  once by at most u times that: (G + S + 4) u 2 max|x|.
  """
  return (G + S + 4) * U * 2 * float(np.max(np.abs(x)))


def test_error_is_within_the_bound_of_its_quantizations():
  """|z - mean| <= mean_w s_B1 / 2 + mean_nodes s_B2 / 2 (two quantizations),
  plus s_B3 / 2 for the gathered output, plus float32 rounding."""
  gathered, chunks, _ = _plain_run()
  for k in SHAPES:
    x = _flat(GRADS[k][0])
    _, _, two, three = np_qgz(x)
    exact = x.astype(np.float64).mean(axis=0)
    slop = _slop(x)
    d = exact.size
    got_chunks = chunks[k][:, 0].reshape(-1)[:d]
    err2 = np.abs(got_chunks - exact)
    err3 = np.abs(gathered[k][0, 0].reshape(-1) - exact)
    assert np.all(err2 <= two + slop), float(np.max(err2 - two))
    assert np.all(err3 <= three + slop), float(np.max(err3 - three))
    # Not vacuous: the errors reach a good part of their bounds.
    assert np.max(err2 / (two + slop)) > 0.3


def test_hierarchical_of_one_hop_qgz():
  """hierarchical(qgz over "node"): float32 reduce-scatter in the node, then
  one int4 hop and the gathered codes across nodes: within two half-steps
  (the hop's and the gather's) of the mean, plus float32 rounding.

  Device (i, j) holds chunk j of node i's mean (c values); qgz splits it in
  S pieces of ceil(c / S), piece r quantized for node r; node r averages the
  pieces and quantizes the result for the gather.
  """
  _, _, hier = _plain_run()
  for k in SHAPES:
    x = _flat(GRADS[k][0])
    d = x.shape[1]
    exact = x.astype(np.float64).mean(axis=0)
    c = -(-d // G)
    cq = -(-c // S)
    means = np.zeros((S, G * c))
    means[:, :d] = x.reshape(S, G, d).astype(np.float64).mean(axis=1)
    shards = np.zeros((S, G, S * cq))
    shards[..., :c] = means.reshape(S, G, c)
    pieces = shards.reshape(S, G, S, cq).astype(np.float32)  # [i, j, r]
    _, half1 = np_quantize(pieces.reshape(-1, cq))
    z = pieces.astype(np.float64).mean(axis=0)  # [j, r]
    _, half3 = np_quantize(z.reshape(-1, cq).astype(np.float32))
    bound = half1.reshape(S, G, S, cq).mean(axis=0) + half3.reshape(G, S, cq)
    bound = bound.reshape(G, S * cq)[:, :c].reshape(-1)[:d]
    # Scales from float64 means, not the device's float32 ones: 1 % margin.
    bound = 1.01 * bound + _slop(x)
    for w in range(N):
      err = np.abs(hier[k][w, 0].reshape(-1) - exact)
      assert np.all(err <= bound), float(np.max(err - bound))


def test_error_feedback_at_each_hop_conserves_mass():
  """Sum of outputs + every hop's residual, each mapped to the coordinates it
  stands for, is the sum of the mean gradients:

    sum_t out_t[i, j] + mean_w r1_w[i, j] + (1/s) sum_n r2_(n, j)[i] + r3_(i, j)
      = sum_t mean_w x_w,t[i, j]

  (each hop sends Q(e) = e - r', so the identities telescope). Rounding: a
  few float32 roundings of values at most (STEPS + 1) max|x| per step.
  """
  (out, chunks), (state, state_chunks) = _feedback_run()
  for k in SHAPES:
    x = GRADS[k].astype(np.float64).reshape(STEPS, N, -1)
    d = x.shape[-1]
    c = -(-d // N)
    want = x.mean(axis=1).sum(axis=0)
    tol = 16 * STEPS * (STEPS + 1) * U * float(np.abs(x).max())
    for outputs, st, gathered in ((out, state, True), (chunks, state_chunks, False)):
      leaf = st.leaves[k]
      r1 = np.asarray(leaf.residual, np.float64).reshape(N, -1).mean(axis=0)
      hop = np.asarray(leaf.inner.hop, np.float64).reshape(S, G, S, c)  # [n, j][i]
      r2 = np.zeros((S, G, c))
      for i in range(S):
        r2[i] = hop[:, :, i].mean(axis=0)
      total = r1 + r2.reshape(-1)[:d]
      if gathered:
        total = total + np.asarray(leaf.inner.gather, np.float64).reshape(-1)[:d]
        sent = np.asarray(outputs[k][0], np.float64).reshape(STEPS, -1).sum(axis=0)
      else:
        assert leaf.inner.gather == () or np.size(leaf.inner.gather) == 0
        sent = np.asarray(outputs[k], np.float64).sum(axis=1).reshape(-1)[:d]
      np.testing.assert_allclose(sent + total, want, rtol=0, atol=tol)
      assert np.max(np.abs(total)) > 100 * tol  # the residuals hold real mass


_DEF = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.*?)\s+([a-z][\w\-]*)\(")


def _hlo_collectives(text):
  """``(kind, dtype)`` of every array in the collectives' results in HLO text."""
  out = []
  for line in text.splitlines():
    m = _DEF.match(line)
    if not m:
      continue
    kind = m.group(2).removesuffix("-start")
    if kind in wire.COLLECTIVES and not m.group(2).endswith("-done"):
      out += [(kind, t) for t in re.findall(r"([a-z]+[0-9]+)\[", m.group(1))]
  return out


def test_the_wire_carries_packed_int4_codes():
  d = 4096
  tx = gradcomp.qgz(axis_name=HOPS)  # bits=4, block_size=512

  def step(g):
    return tx.update({"w": g}, tx.init({"w": g}))[0]["w"]

  spec = P(BOTH)
  f = jax.jit(jax.shard_map(step, mesh=MESH, in_specs=spec, out_specs=P()))
  g = jax.ShapeDtypeStruct((N * d,), jnp.float32, sharding=NamedSharding(MESH, spec))
  text = f.lower(g).compile().as_text()
  kinds = _hlo_collectives(text)
  assert {k for k, _ in kinds} == {"all-to-all", "all-gather"}
  assert {t for _, t in kinds} == {"u8", "f32"}  # codes and scales, nothing else
  records = wire.collectives(text, MESH)
  got = {}
  for r in records:
    key = (r.kind, {("local",): "fast", ("node",): "slow"}[r.axes])
    got[key] = got.get(key, 0) + r.operand_bytes
  want = {(kind, axis): b for kind, axis, b in qgz_wire(d, 4, 512, G, S)}
  assert got == want
  # Cross-node: the int4 codes of 1/4 of the gradient and one chunk's gather,
  # against 4 bytes a value for a float32 all-reduce.
  slow = sum(b for (_, axis), b in got.items() if axis == "slow")
  assert slow == (d // G) // 2 + 4 * S + (d // N) // 2 + 4
  assert wire.collective_bytes(text)["all-to-all"] == sum(
    b for (kind, _), b in got.items() if kind == "all-to-all"
  )


def test_spec_and_axes():
  tx = gradcomp.qgz(axis_name=HOPS)
  assert spec_of(tx).name == "qgz"
  assert axes.group_of(tx) == HOPS
  with jax.set_mesh(MESH):
    state = gradcomp.qgz(axis_name=HOPS, error_feedback=True).init(
      {"w": jnp.zeros(1000)}
    )
  c = -(-1000 // N)
  leaf = state.leaves["w"]
  assert leaf.residual.shape == (1000,)
  assert leaf.inner.hop.shape == (S * c,) and leaf.inner.gather.shape == (c,)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"bits": 2}, "bits must be one of \\(4, 8\\), got 2"),
    ({"bits": True}, "bits must be one of"),
    ({"block_size": 0}, r"block_size must be an integer in \[1, inf\), got 0"),
    ({"gather": "yes"}, "gather must be True or False, got 'yes'"),
    ({"error_feedback": 1}, "error_feedback must be True or False, got 1"),
    ({"axis_name": ("a", "b", "c")}, "one mesh axis or two distinct ones"),
    ({"axis_name": ("a", "a")}, "one mesh axis or two distinct ones"),
    ({"axis_name": Pushes("a")}, "all-to-alls"),
  ],
)
def test_bad_hyperparameters_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    gradcomp.qgz(**kwargs)


# --- Hostile values ----------------------------------------------------------

LEAVES, CASES = harness.HOSTILE_LEAVES, harness.HOSTILE_CASES


@functools.cache
def _hostile_program():
  txs = (
    gradcomp.qgz(bits=BITS, block_size=BLOCK, axis_name=HOPS),
    gradcomp.qgz(bits=BITS, block_size=BLOCK, axis_name=HOPS, error_feedback=True),
  )
  params = {k: jnp.zeros(shape, dtype) for k, (shape, dtype) in LEAVES.items()}
  return _steps_program(txs, params)


def test_hostile_values_give_finite_outputs_and_state():
  """qgz's outputs are always finite (blockq saturates Inf, sends NaN as 0),
  its error-feedback state stays finite, and the clean step after a hostile
  one is the same on every device."""
  run = _hostile_program()
  r = np.random.default_rng(1)
  problems = []
  for case in CASES:
    grads = {}
    for k, (shape, dtype) in LEAVES.items():
      g = r.standard_normal((2, N, *shape)).astype(dtype)
      g[0, 0] = harness.hostile(g[0, 0], case)
      grads[k] = g
    outs, states = run(grads)
    for name, out, state in zip(("plain", "feedback"), outs, states, strict=True):
      if not all(
        np.all(np.isfinite(np.asarray(s, np.float32))) for s in jax.tree.leaves(state)
      ):
        problems.append(f"{name} {case}: non-finite state")
      for k, (shape, dtype) in LEAVES.items():
        o = out[k]
        assert o.dtype == jnp.dtype(dtype) and o.shape == (N, 2, *shape)
        o = o.astype(np.float32)
        if not np.all(np.isfinite(o)):
          problems.append(f"{name} {case}: non-finite output {k!r}")
        if not all(np.array_equal(o[w, 1], o[0, 1]) for w in range(N)):
          problems.append(f"{name} {case}: clean-step {k!r} differs between devices")
  assert not problems, "\n".join(problems)
