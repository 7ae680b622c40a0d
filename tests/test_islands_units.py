"""Islands' pure parts, without Ray (DESIGN §12): plan, settings, quorum, payloads,
hashes, the compressor cut at its wire, and one replica's round against a
float64 transcription of DiLoCo's outer step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from configs import islands as islands_config
from train.islands import hashing, payload, plan, quorum, replica, settings, wire

# One worker runs the module: its tests share the module's compiled replica (``rep``),
# built once.
pytestmark = pytest.mark.xdist_group("islands_units")

# -- failure plan ---------------------------------------------------------------


def test_plan_parses_the_design_example():
  faults = plan.parse(
    "kill:island=1,round=3;delay:island=2,round=5,seconds=4;"
    "forge:island=0,round=6,kind=nan",
    islands=3,
  )
  assert faults == (
    plan.Fault("kill", 1, 3),
    plan.Fault("delay", 2, 5, seconds=4.0),
    plan.Fault("forge", 0, 6, forge="nan"),
  )
  assert plan.at_round(faults, 5) == {2: faults[1]}
  assert plan.parse(None) == () == plan.parse("")


@pytest.mark.parametrize(
  "text, words",
  [
    ("explode:island=1,round=3", "must start with a kind"),
    ("kill island=1", "must start with a kind"),
    ("kill:island=1", "lacks round"),
    ("kill:island=1,round=3,seconds=2", "kill takes island, round"),
    ("kill:island=-1,round=3", "must be >= 0"),
    ("kill:island=x,round=3", "must be an integer"),
    ("delay:island=1,round=3,seconds=0", "finite number > 0"),
    ("delay:island=1,round=3,seconds=inf", "finite number > 0"),
    ("forge:island=1,round=3,kind=zeros", "must be one of nan"),
    ("kill:island=3,round=3", r"must be in \[0, 3\)"),
    ("kill:island=1,round=3;drop:island=1,round=3", "two faults on island 1"),
    ("kill:island=1,island=2,round=3", "island given twice"),
  ],
)
def test_plan_rejects_bad_entries(text, words):
  with pytest.raises(ValueError, match=words):
    plan.parse(text, islands=3)


def test_spread_kills_round_robin_in_time():
  text = plan.spread_kills(4, islands=3, first=2, every=5.5)
  faults = plan.parse(text, 3)
  assert [(f.island, f.after, f.round) for f in faults] == [
    (0, 2.0, -1),
    (1, 7.5, -1),
    (2, 13.0, -1),
    (0, 18.5, -1),
  ]
  assert not faults[1].due(100, 7.4) and faults[1].due(0, 7.5)
  assert plan.Fault("kill", 0, 3).due(4, 0.0) and not plan.Fault("kill", 0, 3).due(
    2, 1e9
  )
  with pytest.raises(ValueError, match="every > 0"):
    plan.spread_kills(2, 3, 0, 0)
  with pytest.raises(ValueError, match="gives both round and after"):
    plan.parse("kill:island=0,round=1,after=2")
  with pytest.raises(ValueError, match="must be a finite number of seconds"):
    plan.parse("kill:island=0,after=-2")


# -- settings ---------------------------------------------------------------------


def test_settings_read_the_config_and_name_bad_fields():
  s = settings.read(islands_config.islands())
  assert (s.count, s.devices_per_island, s.min_quorum, s.address) == (3, 2, 2, None)
  for field, value, words in [
    ("count", 0, "count must be an integer >= 1"),
    ("min_quorum", 4, r"min_quorum must be in \[1, 3\]"),
    ("grace_seconds", -1.0, "grace_seconds must be a finite number >= 0"),
    ("round_timeout_seconds", 0.0, "must be a finite number > 0"),
    ("max_restarts", -2, "max_restarts must be an integer >= -1"),
    (
      "inject",
      "kill:island=7,round=1",
      r"island=7 in a kill fault must be in \[0, 3\)",
    ),
  ]:
    with pytest.raises(ValueError, match=words):
      settings.read(islands_config.islands(**{field: value}))


# -- quorum -------------------------------------------------------------------------


def test_quorum_waits_for_min_quorum_and_the_grace_window():
  q = quorum.Quorum(min_quorum=2, grace_seconds=1.0)
  expected = {0, 1, 2}
  assert not q.closed({}, 10.0, expected)
  assert not q.closed({0: 10.0}, 12.0, expected)  # one payload: below the quorum
  assert not q.closed({0: 10.0, 1: 10.2}, 10.5, expected)  # within the grace window
  assert q.closed({0: 10.0, 1: 10.2}, 11.0, expected)  # grace over, quorum met
  assert q.closed({0: 10.0, 1: 10.1, 2: 10.2}, 10.2, expected)  # all in: no wait
  assert not q.closed({0: 10.0}, 99.0, {0})  # the only one working: below quorum
  assert quorum.Quorum(1, 1.0).closed({0: 10.0}, 10.0, {0})
  assert q.wait_seconds({}, 5.0, 5.0, 30.0) == 30.0
  assert q.wait_seconds({0: 10.0}, 10.25, 9.0, 30.0) == pytest.approx(0.75)
  with pytest.raises(ValueError, match="min_quorum must be >= 1"):
    quorum.Quorum(0, 1.0)


# -- payloads -------------------------------------------------------------------------


def _payload(round_=3, run="run-a"):
  arrays = (np.array([0.5, -1.0], np.float32), np.array([3, 1], np.int32))
  return payload.Payload(run, round_, 1, arrays)


@pytest.mark.parametrize(
  "kind, reason",
  [
    ("nan", "array 0 is not finite"),
    ("shape", r"array 0 has shape \(1,\), expected \(2,\)"),
    ("dtype", "array 0 has dtype float64, expected float32"),
    ("round", "round 2, expected 3"),
    ("run", "run 'run-a-forged', expected 'run-a'"),
  ],
)
def test_forged_payloads_are_rejected_with_the_reason(kind, reason):
  good = _payload()
  spec = payload.spec_of(good.arrays)
  assert payload.check(good, spec, "run-a", 3) is None
  got = payload.check(payload.forged(good, kind), spec, "run-a", 3)
  assert got is not None and __import__("re").fullmatch(reason, got), got


def test_other_bad_payloads():
  good = _payload()
  spec = payload.spec_of(good.arrays)
  assert payload.check(None, spec, "run-a", 3) == "not a payload: NoneType"
  short = dataclasses.replace(good, arrays=good.arrays[:1])
  assert payload.check(short, spec, "run-a", 3) == "1 arrays, expected 2"
  inf = dataclasses.replace(
    good, arrays=(np.array([np.inf, 0], np.float32), good.arrays[1])
  )
  assert payload.check(inf, spec, "run-a", 3) == "array 0 is not finite"
  assert good.nbytes == 16


# -- hashing ---------------------------------------------------------------------------


def test_hash_sees_every_bit_the_round_and_the_structure():
  a = {"w": np.arange(4, dtype=np.float32), "b": np.zeros(2, np.float32)}
  h = hashing.state_hash(2, a, (np.zeros(1),))
  assert h == hashing.state_hash(2, {k: v.copy() for k, v in a.items()}, (np.zeros(1),))
  flipped = a["w"].copy()
  flipped.view(np.uint32)[1] ^= 1  # one ulp
  assert h != hashing.state_hash(2, {**a, "w": flipped}, (np.zeros(1),))
  assert h != hashing.state_hash(3, a, (np.zeros(1),))
  assert h != hashing.state_hash(2, a, (np.zeros(1, np.float32),))  # dtype
  assert h != hashing.state_hash(2, {**a, "w": a["w"].reshape(2, 2)}, (np.zeros(1),))


# -- the wire ---------------------------------------------------------------------------


@pytest.mark.parametrize(
  "name, kwargs",
  [("topk", {"ratio": 0.25}), ("qsgd", {"levels": 4}), ("fp8", {}), ("none", {})],
)
def test_inbox_mean_is_the_mean_of_the_senders_own_decodings(name, kwargs):
  """What a mesh would give: (1/Q) sum of each island's own decoded payload.

  Each sender's ``own`` comes from its own encode (Outbox); the receivers'
  mean comes only from the wire arrays (Inbox), with an empty fourth slot.
  Float32 sums of 3 terms: a few ulps of the largest term.
  """
  w = wire.build_from(default.compressor(name, **kwargs))
  like = {"a": jnp.zeros((4, 6)), "b": jnp.zeros(5)}
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  grads = [
    jax.tree.map(lambda x, k=k: jax.random.normal(k, x.shape), like) for k in keys
  ]
  states = [w.init(like, i) for i in range(3)]
  sent = [jax.jit(w.encode)(g, s) for g, s in zip(grads, states, strict=True)]
  arrays = [[np.asarray(a) for a in out[2]] for out in sent]
  slots = 4
  stacked = [
    np.stack(
      [arrays[i][j] if i < 3 else np.zeros_like(arrays[0][j]) for i in range(slots)]
    )
    for j in range(len(arrays[0]))
  ]
  weights = np.array([1 / 3, 1 / 3, 1 / 3, 0.0], np.float32)
  arity = w.arity(like, states[0])
  mean = jax.jit(w.decode_mean, static_argnums=(4,))(
    stacked, weights, like, states[0], arity
  )
  for key in like:
    own = np.stack([np.asarray(out[0][key], np.float64) for out in sent])
    ref = own.mean(axis=0)
    scale = np.abs(own).max() + 1e-30
    np.testing.assert_allclose(np.asarray(mean[key]), ref, rtol=0, atol=4e-7 * scale)
  if name == "topk":  # values and int32 indices: k = 6 of 24 and 1 of 5
    assert [a.shape for a in arrays[0]] == [(6,), (6,), (1,), (1,)]
    assert [a.dtype.name for a in arrays[0]] == ["float32", "int32", "float32", "int32"]


def test_islands_name_the_codecs_they_can_send():
  with pytest.raises(ValueError, match="islands cannot send compressor 'powersgd'"):
    wire.build_from(default.compressor("powersgd"))


# -- one replica -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rep():
  config = islands_config.get_config()
  config.compressor = default.compressor("topk", ratio=0.1)
  return replica.Replica(config, 0, "run-u", jax.devices()[:2])


def _np(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def test_a_payload_not_applied_keeps_its_mass(rep):
  """Late, dropped or rejected: Delta = residual + carry, to float32 rounding.

  Delta is recomputed from the same batches and inner state (an independent
  call of the inner steps); top-k's residual is e minus the sent
  coordinates, and the carry takes the sent ones back, so the sum is Delta
  up to the rounding of one subtraction (1 ulp of |Delta|).
  """
  anchor = _np(rep.params)
  inner = jax.tree.map(jnp.copy, rep.inner_state)
  xs, ys = rep.batches(rep.round)
  local, _, _ = rep._inner_steps(rep.params, inner, xs, ys)
  delta = jax.tree.map(lambda a, x: a - np.asarray(x, np.float64), anchor, local)
  r = rep.round
  sent, _ = rep.train_round(r)
  before = rep.hash()
  out = rep.apply(r, [payload.forged(sent, "nan")])  # its own payload, rejected
  assert out["applied"] == [] and out["carried"] and out["rejected"][0][0] == 0
  assert all(
    np.array_equal(a, b)
    for a, b in zip(
      jax.tree.leaves(_np(rep.params)), jax.tree.leaves(anchor), strict=True
    )
  )
  assert rep.hash() != before  # the round count moved, the params did not
  unsent = _np(rep.unsent())
  for u, d in zip(jax.tree.leaves(unsent), jax.tree.leaves(delta), strict=True):
    np.testing.assert_allclose(u, d, rtol=0, atol=1.2e-7 * (np.abs(d).max() + 1e-30))


def test_outer_step_matches_a_float64_diloco_transcription(rep):
  """Two islands' top-k payloads, decoded and averaged in float64, then
  Nesterov SGD (optax's: u = -lr (g + mu (mu m + g)), m' = mu m + g).

  Float32 against float64: a handful of ulps of the largest magnitudes
  (scatter, two adds of 1/2-weighted terms, the Nesterov expression).
  """
  r = rep.round
  mine, _ = rep.train_round(r)
  other = dataclasses.replace(
    mine,
    island=1,
    arrays=tuple(
      a if a.dtype.kind == "i" else (a * -0.5 + 0.25).astype(a.dtype)
      for a in mine.arrays
    ),
  )
  anchor = _np(rep.params)
  momentum = _np(rep.outer_state)
  out = rep.apply(r, [other, mine])
  assert out["applied"] == [0, 1] and not out["carried"]
  leaves, treedef = jax.tree.flatten(anchor)
  means = []
  for j, leaf in enumerate(leaves):
    total = np.zeros(leaf.size)
    for p in (mine, other):
      values, idx = p.arrays[2 * j], p.arrays[2 * j + 1]
      np.add.at(total, idx, values.astype(np.float64) / 2)
    means.append(total.reshape(leaf.shape))
  lr, mu = rep.config.scheme.outer_learning_rate, rep.config.scheme.outer_momentum
  trace = [mu * m + g for m, g in zip(jax.tree.leaves(momentum), means, strict=True)]
  want = [a - lr * (g + mu * t) for a, g, t in zip(leaves, means, trace, strict=True)]
  got = jax.tree.leaves(_np(rep.params))
  for g, w, a in zip(got, want, leaves, strict=True):
    np.testing.assert_allclose(
      g, w, rtol=0, atol=8 * np.finfo(np.float32).eps * (np.abs(a).max() + 1)
    )
  del treedef


def test_snapshot_load_round_trip_and_a_bad_hash(rep):
  snap = rep.snapshot()
  other = replica.Replica(rep.config, 2, "run-u", jax.devices()[2:4])
  assert other.load(snap) == snap.hash == rep.hash()
  bad = dataclasses.replace(snap, hash="0" * 64)
  with pytest.raises(ValueError, match="hashes to .* the peer's to 000000000000"):
    other.load(bad)
