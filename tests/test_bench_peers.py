"""The compress suite's naive-JAX peers (bench/peers.py, issue 18).

Each peer must do the work it is compared for: top-k keeps the k largest
magnitudes (gradcomp's own top-k on one worker, exactly), random-k at most k
entries of its input, signs and fp16 their closed forms, and error feedback
conserves mass (the outputs and the last residual add up to the inputs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradcomp
from bench import peers


def _tensors(seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((40, 25), (300,))]


def _run(label, error_feedback, steps=1):
  peer = peers.lift(label, error_feedback)
  xs = _tensors()
  state = peer.init(xs)
  update = jax.jit(peer.update)
  outs = []
  for t in range(steps):
    step_in = [x * (t + 1) for x in xs]
    out, state = update(step_in, state)
    outs.append(out)
  return xs, outs, state


def test_topk_matches_gradcomp_on_one_worker():
  xs, (outs,), _ = _run("topk", False)
  tx = gradcomp.topk(ratio=0.01, error_feedback=False)
  want, _ = tx.update(xs, tx.init(xs))
  for got, w in zip(outs, want, strict=True):
    np.testing.assert_array_equal(got, w)


def test_randomk_keeps_at_most_k_entries_of_its_input():
  xs, (outs,), _ = _run("randomk", False)
  for x, out in zip(xs, outs, strict=True):
    kept = np.flatnonzero(np.asarray(out))
    assert 0 < kept.size <= max(1, int(np.ceil(0.01 * x.size)))
    np.testing.assert_array_equal(
      np.asarray(out).ravel()[kept], np.asarray(x).ravel()[kept]
    )


@pytest.mark.parametrize(
  ("label", "closed_form"),
  [
    ("signsgd", lambda x: np.where(x >= 0, 1.0, -1.0)),
    ("ef_signsgd", lambda x: np.mean(np.abs(x)) * np.where(x >= 0, 1.0, -1.0)),
    ("fp16", lambda x: x.astype(np.float16).astype(np.float32)),
  ],
)
def test_elementwise_peers_closed_form(label, closed_form):
  xs, (outs,), _ = _run(label, False)
  for x, out in zip(xs, outs, strict=True):
    np.testing.assert_allclose(out, closed_form(np.asarray(x)), rtol=1e-6)


@pytest.mark.parametrize("label", ["randomk", "topk", "powersgd"])
def test_error_feedback_conserves_mass(label):
  """sum_t out_t + r_T = sum_t g_t: float32 sums of 3 steps, values ~N(0, 9)."""
  steps = 3
  xs, outs, (_, residuals, _) = _run(label, True, steps)
  for i, x in enumerate(xs):
    sent = sum(np.asarray(o[i], np.float64) for o in outs)
    total = sum((t + 1) * np.asarray(x, np.float64) for t in range(steps))
    bound = 4 * steps * np.finfo(np.float32).eps * np.abs(total).max() * steps
    np.testing.assert_allclose(sent + np.asarray(residuals[i]), total, atol=bound)


def test_dgc_peer_sends_at_most_k_and_clears_what_it_sent():
  xs, outs, state = _run("dgc", False)
  (u, v) = state[2][0]
  out = np.asarray(outs[0][0])
  sent = out != 0
  assert 0 < sent.sum() <= peers._keep(xs[0], 0.01)
  # Momentum-factor masking: u and v are zero where a value was sent, and
  # what was sent is the velocity (u = v = x on the first step).
  assert np.all(np.asarray(u)[sent] == 0) and np.all(np.asarray(v)[sent] == 0)
  np.testing.assert_array_equal(out[sent], np.asarray(xs[0])[sent])


def _timed(ms):
  return {"median_ms": ms, "compile_ms": 1.0}


def test_table_ratio_takes_the_best_peer_doing_the_same_work():
  from bench import compress

  row = {
    "label": "randomk",
    "layerwise": _timed(40.0),
    "fused": _timed(20.0),
    # Plain peers are faster but skip error feedback: not the same work.
    "peers": {
      "plain": {"per_tensor": _timed(1.0), "one_buffer": _timed(1.0)},
      "ef": {"per_tensor": _timed(50.0), "one_buffer": _timed(80.0)},
    },
    "torch_peers": {
      "plain": {"per_tensor": _timed(1.0), "one_buffer": _timed(1.0)},
      "ef": {"per_tensor": _timed(25.0), "one_buffer": {"error": "x"}},
    },
  }
  result = {
    "model": "m",
    "num_tensors": 2,
    "num_params": 10,
    "repeats": 1,
    "copy_bandwidth_gbps": 1.0,
    "machine": {"backend": "cpu", "device_kind": "cpu", "cpu_count": 2},
    "rows": [{**row, "floor_ms": 1.0, "paper_v100_ms": None}],
  }
  result["machine"]["jax_version"] = "x"
  line = [x for x in compress.format_table(result).splitlines() if "| randomk |" in x]
  # The peer table's row: best gradcomp 20 over best same-work peer 25.
  assert line[-1].endswith("| 25.0 / error | 0.80 |"), line[-1]


def test_fused_layout_alone_times_only_the_one_buffer_variants(tmp_path):
  from bench import compress

  result = compress.run(
    model="resnet20",
    repeats=1,
    only="randomk",
    out_dir=str(tmp_path),
    layouts=("fused",),
  )
  (row,) = result["rows"]
  assert "layerwise" not in row and row["fused"]["median_ms"] > 0
  for kind in ("plain", "ef"):
    assert set(row["peers"][kind]) == {"one_buffer"}
  table = compress.format_table(result).splitlines()
  peer_line = [x for x in table if x.startswith("| randomk | — / ")]
  assert peer_line and "| — / " in peer_line[0].split("| randomk |")[1]
  with pytest.raises(ValueError, match="layouts"):
    compress.run(model="resnet20", only="randomk", layouts=("fused", "rows"))


def test_interleaved_rounds_rotate_and_prepare_before_timing():
  """Every round prepares all inputs first, then times each contender once,
  starting one later each round; each call gets its own round's input."""
  from bench import timing

  log = []

  def contender(name):
    def prepare():
      log.append(("prepare", name))
      return name, len(log)

    def call(inputs):
      assert inputs[0] == name
      log.append(("call", name))

    return prepare, call

  times = timing.interleaved([contender(n) for n in "abc"], repeats=3)
  assert [len(t) for t in times] == [3, 3, 3]
  assert all(ms >= 0 for t in times for ms in t)
  rounds = [log[i : i + 6] for i in range(0, 18, 6)]
  for r, events in enumerate(rounds):
    assert [e for e, _ in events] == ["prepare"] * 3 + ["call"] * 3
    calls = "".join(n for _, n in events[3:])
    assert calls == ("abc" * 2)[r : r + 3]
