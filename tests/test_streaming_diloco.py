"""Streaming DiLoCo and eager updates in ``gradcomp.local_sgd``: references, schedule, overlap.

Each run is 8 workers for ``T`` steps (one compile, a ``scan``) on given
per-worker gradients, compared with a float64 NumPy replay of the schedule
(Douillard et al. 2025; Kale et al. 2025, Alg. 3). Error bound: a step's
float32 arithmetic on one coordinate is at most ``n + 18`` roundings (inner
momentum and step 4, pseudo-gradient 1, the ``n``-term mean ``n``, the eager
swap 3, Nesterov 5, the anchor 1, the merge 3, the update and its
application 2), each at most ``u M`` of the largest magnitude ``M`` the run
touches (Higham §2.2, §4.2). An error is carried forward with gain at most
``1 / (1 - mu)`` by the inner momentum and ``lr_out / (1 - mom_out)`` by the
outer Nesterov step; over ``T`` steps the errors add:
``T (n + 18) u M / (1 - mu) * max(1, lr_out / (1 - mom_out))``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradcomp
from gradcomp.parallel import traced
from gradcomp.schemes import local_sgd as local_sgd_module
from gradcomp.schemes.streaming import StreamingState, fragment_groups, fragment_pieces

import harness

pytestmark = pytest.mark.xdist_group("schemes")

N = harness.WORKERS
T = 10  # two rounds of each fragment with every=4, F=2, overlap=1
EVERY = 4
LR, MU = 0.1, 0.5
OUTER_LR, OUTER_MOM = 0.7, 0.9
U = float(jnp.finfo(jnp.float32).eps) / 2
AXIS = harness.AXIS
# Four layers; tree order of the leaves: l0/b, l0/w, l1/w, l2/w, l3/w.
SHAPES = {
  "l0": {"b": (2,), "w": (3,)},
  "l1": {"w": (4,)},
  "l2": {"w": (2, 2)},
  "l3": {"w": (3,)},
}
PARAMS_LIKE = jax.tree.map(
  lambda s: jnp.zeros(s), SHAPES, is_leaf=lambda x: isinstance(x, tuple)
)


def _leaves_of(tree):
  return jax.tree.leaves(tree)


def _data(seed=0, steps=T):
  rng = np.random.default_rng(seed)
  shapes = jax.tree.leaves(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
  treedef = jax.tree.structure(PARAMS_LIKE)
  params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
  grads = [rng.standard_normal((steps, N, *s)).astype(np.float32) for s in shapes]
  return treedef.unflatten(params), treedef.unflatten(grads)


def _tx(**kwargs):
  kwargs.setdefault("outer", optax.sgd(OUTER_LR, momentum=OUTER_MOM, nesterov=True))
  return gradcomp.local_sgd(optax.sgd(LR, momentum=MU), EVERY, axis_name=AXIS, **kwargs)


# --- The defaults are today's DiLoCo ------------------------------------------


def test_defaults_keep_todays_state_and_any_other_setting_streams():
  assert isinstance(_tx().init(PARAMS_LIKE), gradcomp.LocalSGDState)
  explicit = _tx(fragments=1, overlap=0, alpha=0.0, eager=False)
  assert isinstance(explicit.init(PARAMS_LIKE), gradcomp.LocalSGDState)
  for kwargs in ({"fragments": 2}, {"alpha": 0.5}, {"fragments": [[0, 1, 2, 3, 4]]}):
    assert isinstance(_tx(**kwargs).init(PARAMS_LIKE), StreamingState)


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "topk_nesterov"])
def test_one_fragment_is_diloco_bit_for_bit(compressed):
  """The streaming code with one explicit fragment, no overlap: today's rounds."""
  params, grads = _data(seed=1)
  kwargs = (
    {"compressor": gradcomp.topk(0.5, axis_name=AXIS)}
    if compressed
    else {"outer": None}
  )
  want, _ = harness.run_scheme(_tx(**kwargs), params, grads)
  one = _tx(fragments=[list(range(5))], **kwargs)
  got, state = harness.run_scheme(one, params, grads)
  assert isinstance(state, StreamingState)
  for a, b in zip(_leaves_of(got), _leaves_of(want), strict=True):
    np.testing.assert_array_equal(a, b)


# --- Fragments: strided groups of layers ---------------------------------------


def test_every_leaf_in_one_fragment_layers_strided():
  groups = fragment_groups(PARAMS_LIKE, 2)
  assert groups == ((0, 1, 3), (2, 4))  # layers l0, l2 | l1, l3; l0 kept whole
  assert sorted(i for g in groups for i in g) == list(range(5))
  assert fragment_groups(PARAMS_LIKE, 4) == ((0, 1), (2,), (3,), (4,))
  assert fragment_groups(PARAMS_LIKE, 1) == ((0, 1, 2, 3, 4),)
  # Gradient-ready order (output layer first) numbers the layers l3, l2, l1, l0.
  assert fragment_groups(PARAMS_LIKE, 2, order=(4, 3, 2, 1, 0)) == ((2, 4), (0, 1, 3))
  # A leaf's layer is its parent path: leaf 0 joins leaf 1's layer (l0, first),
  # then l3, l1, l2 come in that order; four layers over three fragments.
  order = (1, 4, 0, 2, 3)
  assert fragment_groups(PARAMS_LIKE, 3, order=order) == ((0, 1, 3), (4,), (2,))
  assert local_sgd_module.fragment_groups is fragment_groups


def test_explicit_groups_accepted_and_bad_groups_rejected():
  assert fragment_groups(PARAMS_LIKE, [[4, 0], [1, 2, 3]]) == ((0, 4), (1, 2, 3))
  _tx(fragments=[[4, 0], [1, 2, 3]]).init(PARAMS_LIKE)
  for groups in ([[0, 1], [2, 3]], [[0, 1, 2], [2, 3, 4]], [[0, 1, 2], [3, 4, 5]]):
    with pytest.raises(ValueError, match="fragments must partition the 5 leaf"):
      _tx(fragments=groups).init(PARAMS_LIKE)
  for groups in ([], [[0, 1, 2, 3, 4], []], [["a"]], [0, 1]):
    with pytest.raises(ValueError, match="fragments must be an integer >= 1 or"):
      _tx(fragments=groups)


def test_fragments_above_the_layers_and_bad_order_rejected_at_init():
  tx = gradcomp.local_sgd(optax.sgd(LR), 8, fragments=8)
  with pytest.raises(
    ValueError,
    match=r"fragments must be an integer in \[1, 4\] \(the number of layers.*got 8",
  ):
    tx.init(PARAMS_LIKE)
  tx = gradcomp.local_sgd(optax.sgd(LR), 4, fragments=2, order=(0, 1, 2, 3, 3))
  with pytest.raises(ValueError, match="order must be a permutation of the 5"):
    tx.init(PARAMS_LIKE)


# --- A float64 replay of the schedule, the merge and the eager rule -----------


def streaming_reference(params, grads, groups, *, overlap, alpha, eager, outer):
  """Streaming DiLoCo on ``N`` workers in float64, leaf by leaf.

  Fragment ``f`` sends ``anchor - x`` at the steps where ``t % EVERY == f *
  EVERY / F``; ``overlap`` steps later the mean (eager: plus ``(fresh -
  sent) / N``, Kale et al. Alg. 3) goes through Nesterov SGD at the anchor
  (``outer=True``) or is subtracted, the anchor becomes the global value and
  the worker's params ``alpha x + (1 - alpha) global``. Returns the final
  params and the largest magnitude touched.
  """
  spacing = EVERY // len(groups)
  x = [np.repeat(np.float64(p)[None], N, 0) for p in jax.tree.leaves(params)]
  g = [np.float64(v) for v in jax.tree.leaves(grads)]
  m = [np.zeros_like(v) for v in x]
  anchor = [v.copy() for v in x]  # per worker: eager updates differ per worker
  trace = [np.zeros_like(v) for v in x]
  sent = [np.zeros_like(v) for v in x]
  big = max(np.abs(v).max() for v in x)
  for t in range(1, T + 1):
    for k in range(len(x)):
      m[k] = MU * m[k] + g[k][t - 1]
      x[k] = x[k] - LR * m[k]
    if t % EVERY % spacing == 0:
      for k in groups[t % EVERY // spacing]:
        sent[k] = anchor[k] - x[k]
    a = t - overlap
    if a < 1 or a % EVERY % spacing:
      continue
    for k in groups[a % EVERY // spacing]:
      delta = np.broadcast_to(sent[k].mean(0), x[k].shape)
      if eager:
        delta = delta + ((anchor[k] - x[k]) - sent[k]) / N
      if outer:
        trace[k] = OUTER_MOM * trace[k] + delta
        step = -OUTER_LR * (delta + OUTER_MOM * trace[k])
      else:
        step = -delta
      anchor[k] = anchor[k] + step
      x[k] = alpha * x[k] + (1 - alpha) * anchor[k]
      big = max(big, np.abs(anchor[k]).max(), OUTER_LR * np.abs(trace[k]).max())
    big = max([big] + [np.abs(v).max() for v in x])
  return x, big


CASES = {
  "overlap": {"overlap": 1, "alpha": 0.0, "eager": False, "outer": True},
  "eager_merge": {"overlap": 1, "alpha": 0.5, "eager": True, "outer": True},
  "merge_no_overlap": {"overlap": 0, "alpha": 0.25, "eager": False, "outer": False},
}


@pytest.mark.parametrize("case", CASES)
def test_matches_float64_reference(case):
  kw = CASES[case]
  params, grads = _data(seed=2 + len(case))
  order = (4, 3, 2, 1, 0) if case == "eager_merge" else None
  groups = ((2, 4), (0, 1, 3)) if order else ((0, 1, 3), (2, 4))
  tx = _tx(
    fragments=2,
    overlap=kw["overlap"],
    alpha=kw["alpha"],
    eager=kw["eager"],
    order=order,
    outer=optax.sgd(OUTER_LR, momentum=OUTER_MOM, nesterov=True)
    if kw["outer"]
    else None,
  )
  got, state = harness.run_scheme(tx, params, grads)
  want, big = streaming_reference(params, grads, groups, **kw)
  magnitude = max(
    big, LR * max(np.abs(g).max() for g in jax.tree.leaves(grads)) / (1 - MU), 1.0
  )
  gain = max(1.0, OUTER_LR / (1 - OUTER_MOM)) / (1 - MU)
  bound = T * (N + 18) * U * magnitude * gain
  for k, (a, b) in enumerate(zip(_leaves_of(got), want, strict=True)):
    err = np.max(np.abs(np.float64(a) - b))
    assert err <= bound, f"leaf {k}: error {err:.3g} > bound {bound:.3g}"
  # Two arrivals of each fragment happened: the params moved off the local path.
  np.testing.assert_array_equal(state.count, T)
  if not kw["eager"]:
    harness.assert_same_on_workers(state.anchor)


def test_split_leaves_matches_the_reference_on_its_pieces():
  """Equal fragments that split leaves: the reference run on the pieces.

  16 values in 4 layers: 4 chunks of 4, strided, so each fragment holds 8
  values and l0/w, l1/w and l2/w are each cut between the two.
  """
  kw = CASES["eager_merge"]
  params, grads = _data(seed=11)
  tx = _tx(fragments=2, split_leaves=True, overlap=1, alpha=0.5, eager=True)
  got, _ = harness.run_scheme(tx, params, grads)
  pieces = fragment_pieces(params, 2)
  assert [sum(b - a for _, a, b in f) for f in pieces] == [8, 8]
  sizes = [x.size for x in jax.tree.leaves(params)]
  assert any(b - a < sizes[i] for f in pieces for i, a, b in f)  # Leaves are cut.
  flat_p = [np.asarray(x).reshape(-1) for x in jax.tree.leaves(params)]
  flat_g = [np.asarray(x).reshape(T, N, -1) for x in jax.tree.leaves(grads)]
  where, ps, gs, groups = [], [], [], [[] for _ in pieces]
  for f, fragment in enumerate(pieces):
    for i, a, b in fragment:
      groups[f].append(len(ps))
      where.append((i, a, b))
      ps.append(flat_p[i][a:b])
      gs.append(flat_g[i][..., a:b])
  want, big = streaming_reference(ps, gs, groups, **kw)
  magnitude = max(big, LR * max(np.abs(g).max() for g in gs) / (1 - MU), 1.0)
  gain = max(1.0, OUTER_LR / (1 - OUTER_MOM)) / (1 - MU)
  bound = T * (N + 18) * U * magnitude * gain
  flat_got = [np.float64(x).reshape(N, -1) for x in jax.tree.leaves(got)]
  for (i, a, b), w in zip(where, want, strict=True):
    err = np.max(np.abs(flat_got[i][:, a:b] - w))
    assert err <= bound, f"leaf {i}[{a}:{b}]: error {err:.3g} > bound {bound:.3g}"


def test_a_round_moves_only_its_fragments_error_feedback():
  """Fragment 1 arrives at step 3 (sent at 2); fragment 0 has not been sent."""
  params, grads = _data(seed=7, steps=3)
  tx = _tx(fragments=2, overlap=1, compressor=gradcomp.topk(0.5, axis_name=AXIS))
  _, state = harness.run_scheme(tx, params, grads)
  residual = [jax.tree.leaves(s.leaves) for s in state.compressor_state]
  assert all(np.all(r == 0) for r in residual[0])  # fragment 0: untouched
  assert any(np.any(r != 0) for r in residual[1])  # fragment 1: top-k left some


# --- The overlap, by construction ----------------------------------------------


def _one_step(tx):
  params = harness.shard(jax.tree.map(lambda p: jnp.zeros((N, *p.shape)), PARAMS_LIKE))
  state = harness.worker_state(tx, PARAMS_LIKE)

  def update(grads, state, params):
    one = gradcomp.drop_worker_axis((grads, state, params))
    return gradcomp.add_worker_axis(tx.update(*one))

  f = jax.shard_map(
    update,
    mesh=harness.mesh(),
    in_specs=jax.sharding.PartitionSpec(AXIS),
    out_specs=jax.sharding.PartitionSpec(AXIS),
  )
  return f, (params, state, params)


def test_no_collective_operand_depends_on_the_local_steps_in_flight():
  """With overlap the exchange reads the state alone: the pseudo-gradient sent
  ``overlap`` steps ago. Neither the arrival step's gradients nor its params
  (which carry the local steps taken since the send) reach a collective, so
  it may run under the step's forward and backward pass. Without overlap the
  round's operands are this step's params: the walk finds them."""
  topk = gradcomp.topk(0.5, axis_name=AXIS)
  for kwargs in ({}, {"compressor": topk}, {"eager": True, "alpha": 0.5}):
    f, args = _one_step(_tx(fragments=2, overlap=1, **kwargs))
    found = traced.collectives_depending_on(f, args, argnums=(0, 2))
    assert found and not any(depends for _, depends in found), found
  f, args = _one_step(_tx(fragments=2, overlap=0, outer=None))
  found = traced.collectives_depending_on(f, args, argnums=(0, 2))
  assert found and all(depends for _, depends in found), found


def _branch_bytes(jaxpr) -> list[int]:
  """Collective operand bytes of each branch of the first ``cond`` in ``jaxpr``."""

  def total(jaxpr):
    nbytes = 0
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in (
        "psum",
        "psum_invariant",
        "all_gather",
        "all_gather_invariant",
      ):
        nbytes += sum(v.aval.size * v.aval.dtype.itemsize for v in eqn.invars)
      for value in eqn.params.values():
        for sub in value if isinstance(value, tuple | list) else (value,):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            nbytes += total(sub)
    return nbytes

  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "cond":
      return [total(b.jaxpr) for b in eqn.params["branches"]]
    for value in eqn.params.values():
      sub = getattr(value, "jaxpr", value)
      if hasattr(sub, "eqns"):
        found = _branch_bytes(sub)
        if found:
          return found
  return []


def test_a_step_sends_one_fragment():
  """Peak bytes per step: the largest fragment's dense mean (9 of 16 floats)."""
  f, args = _one_step(_tx(fragments=2, overlap=1, outer=None))
  got = _branch_bytes(jax.make_jaxpr(f)(*args).jaxpr)
  # Branches: nothing due, fragment 0's and 1's sends, then their arrivals.
  assert got == [0, 0, 0, 9 * 4, 7 * 4], got
  f, args = _one_step(_tx(fragments=[list(range(5))], outer=None))
  assert _branch_bytes(jax.make_jaxpr(f)(*args).jaxpr) == [0, 16 * 4]
  # Split leaves: 8 of 16 floats each, exactly 1 / F.
  f, args = _one_step(_tx(fragments=2, split_leaves=True, overlap=1, outer=None))
  assert _branch_bytes(jax.make_jaxpr(f)(*args).jaxpr) == [0, 0, 0, 8 * 4, 8 * 4]


# --- Bad hyper-parameters ------------------------------------------------------


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"fragments": 3}, r"every must be a multiple of fragments.*every=4, fragments=3"),
    ({"fragments": 0}, r"fragments must be an integer in \[1, inf\), got 0"),
    ({"fragments": 2.0}, r"fragments must be an integer >= 1 or .*got 2\.0"),
    ({"fragments": 2, "overlap": 2}, r"overlap must be an integer in \[0, 1\].*got 2"),
    ({"overlap": -1}, r"overlap must be an integer in \[0, 3\].*got -1"),
    ({"overlap": 1.0}, r"overlap must be an integer in \[0, 3\].*got 1\.0"),
    ({"alpha": 1.5}, r"alpha must be a number in \[0, 1\], got 1\.5"),
    ({"alpha": -0.1}, r"alpha must be a number in \[0, 1\], got -0\.1"),
    ({"eager": 1}, r"eager must be True or False, got 1"),
    ({"split_leaves": 1}, r"split_leaves must be True or False, got 1"),
    (
      {"fragments": [[0, 1], [2, 3, 4]], "split_leaves": True},
      r"split_leaves=True needs fragments as an integer",
    ),
  ],
)
def test_bad_hyper_parameters_name_the_argument(kwargs, message):
  with pytest.raises(ValueError, match=message):
    _tx(**kwargs)
