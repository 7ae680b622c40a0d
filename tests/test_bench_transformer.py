"""The transformer suite end to end on a tiny budget (a benchmark, not a test of
bits per byte), and its time to target on a hand-made curve."""

import json

import numpy as np
import pytest

from bench import __main__ as bench_main
from bench import transformer, workloads

# One worker runs this module and ``test_bench_study.py`` in turn: their
# tiny gpt_tiny runs (dense, and top-k after 2 dense steps, at 3e-3) compile
# the same programs, which the second reads from the compilation cache.
pytestmark = pytest.mark.xdist_group("gpt_tiny_smoke")

STEPS, EVERY = 4, 2
TINY = workloads.SMOKE  # One narrow layer: the same paths, a short compile.


def test_time_to_target_interpolates_the_first_crossing():
  steps = [10, 20, 30, 40]
  bpb = [4.0, 3.0, 2.0, 2.5]  # Crosses 2.5 between steps 20 and 30, then rises.
  clock = np.concatenate([[0.0], np.cumsum(np.full(40, 0.5))])  # 0.5 s per step.
  assert transformer.time_to_target(steps, bpb, clock, 2.5) == (25.0, 12.5)
  # Reached at an eval exactly: that eval's step.
  assert transformer.time_to_target(steps, bpb, clock, 3.0) == (20.0, 10.0)
  # At the first eval already: no earlier point to interpolate from.
  assert transformer.time_to_target(steps, bpb, clock, 5.0) == (10.0, 5.0)
  assert transformer.time_to_target(steps, bpb, clock, 1.9) is None
  # A run stopped after two evals (NaN afterwards) never reaches 2.5.
  stopped = [4.0, 3.0, np.nan, np.nan]
  assert transformer.time_to_target(steps, stopped, clock, 2.5) is None
  # The clock is interpolated between whole steps.
  uneven = np.arange(41, dtype=float) ** 2
  step, seconds = transformer.time_to_target([10, 20], [3.0, 2.0], uneven, 2.75)
  assert step == 12.5 and seconds == pytest.approx((144 + 169) / 2)


#: Top-k after a dense warm-up of half the tiny run: priced by phase.
WARM_TOPK = transformer.Method(
  "topk_warm",
  {"name": "none"},
  "topk",
  {"ratio": transformer.TOPK_RATIO, "warmup_steps": STEPS // 2},
  "single",
)


def test_tiny_run_writes_every_method_and_topk_sends_less(tmp_path, monkeypatch):
  methods = [transformer.METHODS["dense"], transformer.METHODS["topk"], WARM_TOPK]
  result = transformer.run(
    methods=methods,
    seeds=1,
    steps=STEPS,
    eval_every=EVERY,
    out_dir=str(tmp_path),
    overrides=TINY,
  )
  saved = json.loads((tmp_path / "transformer.json").read_text())
  assert saved["suite"] == "transformer" and saved["steps"] == STEPS
  assert saved["overrides"] == TINY
  assert set(saved["results"]) == {"dense", "topk", "topk_warm"}
  assert 3.0 < saved["unigram_bits_per_byte"] < 8.0
  dense = saved["results"]["dense"]["summary"]
  assert saved["target_rule"].startswith("dense's mean final bpb")
  final = dense["final_bpb"]["mean"]
  assert saved["target_bpb"] == pytest.approx(final + transformer.TARGET_MARGIN)
  assert dense["reach"]["reached"] == 1  # Dense reaches its own level + margin.
  for entry in saved["results"].values():
    s, (run,) = entry["summary"], entry["runs"]
    assert s["step"] == [EVERY, STEPS]
    assert np.isfinite(s["final_bpb"]["mean"]) and s["tokens_per_sec"]["mean"] > 0
    assert len(run["clock"]) == STEPS + 1 and s["sim_end"] > 0
    assert s["program_clock_max_rel_diff"] < 1e-9
  topk = saved["results"]["topk"]["summary"]
  assert topk["wire_bytes_per_step"] < dense["wire_bytes_per_step"]
  assert topk["bytes_ratio_to_dense"] < 0.05
  assert dense["bytes_ratio_to_dense"] == 1.0
  # Half the steps dense, half top-k's: the mean of the two, to the 16 bytes
  # a step's own metrics add to either (counted once by each).
  warm = saved["results"]["topk_warm"]["summary"]
  half = (dense["wire_bytes_per_step"] + topk["wire_bytes_per_step"]) / 2
  assert abs(warm["wire_bytes_per_step"] - half) <= 16
  assert set(warm["sim_inputs"]["phase_wire"]) == {"dense", "compressed"}
  table = (tmp_path / "transformer.md").read_text()
  for label in ("dense", "topk"):
    assert f"| {label} |" in table
  assert "Unigram baseline" in table
  assert (tmp_path / "transformer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert result["target_bpb"] == saved["target_bpb"]

  # --reuse reads the finished runs back instead of training them again.
  def no_training(config, workdir):
    raise AssertionError(f"trained {workdir} again")

  monkeypatch.setattr(transformer.schemes, "_train", no_training)
  again = transformer.run(
    methods=methods,
    seeds=1,
    steps=STEPS,
    eval_every=EVERY,
    out_dir=str(tmp_path),
    overrides=TINY,
    reuse=True,
  )
  for label in ("dense", "topk"):
    (run,) = again["results"][label]["runs"]
    assert run["reused"] and run["curve"] == saved["results"][label]["runs"][0]["curve"]


def _phase_clock(method, steps, inputs, cluster):
  config = transformer.configure(method, seed=0, steps=steps, eval_every=steps)
  return transformer.reprice(inputs, config, cluster, steps)


@pytest.mark.parametrize(
  "method, dense_steps",
  [
    (WARM_TOPK, STEPS // 2),
    (
      transformer.Method(
        "compressed_adam",
        {"name": "none"},
        "topk",
        {"ratio": 0.01},
        "single",
        optimizer={"name": "compressed_adam", "freeze_step": 3},
      ),
      3,
    ),
  ],
)
def test_phases_are_re_priced_dense_then_compressed(method, dense_steps):
  """A warm-up's or a freeze's steps cost a dense step's time, the rest the
  codec's: each step of the re-priced clock equals the matching step of a
  run that sent that phase's wire every step (``simulate_rounds`` alone)."""
  import gradcomp

  steps, d = 8, 445_952
  dense, compressed = {"all-reduce": 4 * d}, {"all-gather": 35_672}
  inputs = {
    "flops_per_step": 2e9,
    "round_wire": compressed,
    "phase_wire": {"dense": dense, "compressed": compressed},
  }
  cluster = gradcomp.sim.Cluster(16, bandwidth_gbps=10.0)
  seconds = _phase_clock(method, steps, inputs, cluster)
  clock = np.diff(seconds)
  each = {
    kind: np.diff(
      gradcomp.sim.simulate_rounds(cluster, 2e9, lambda s: True, wire, steps)
    )
    for kind, wire in (("dense", dense), ("compressed", compressed))
  }
  # A difference of two running sums: one rounding of each, at most the
  # clock's final value times float64's epsilon, twice.
  tol = 2 * np.finfo(np.float64).eps * seconds[-1]
  np.testing.assert_allclose(
    clock[:dense_steps], each["dense"][:dense_steps], rtol=0, atol=tol
  )
  np.testing.assert_allclose(
    clock[dense_steps:], each["compressed"][dense_steps:], rtol=0, atol=tol
  )
  assert each["dense"][0] > 2 * each["compressed"][0]  # The phases differ.


@pytest.mark.parametrize("warmup_bits", [None, 4])
def test_onebit_phases_are_re_priced_on_the_cluster_s_workers(warmup_bits):
  """1-bit Adam's compressed rounds are the 1-bit all-reduce's on 16 workers
  (chunks of d / 16), not the 8-worker run's logged ones; so are the rounds
  of an int4 warm-up (``warmup_bits``: int_quantize's reduce-scatter)."""
  import gradcomp
  from gradcomp.compressors import intq, scatter

  steps, d = 6, 445_952

  def int4(n):  # Chunks of ceil(d / n) values to their owners, one back.
    row = intq.row_bytes(-(-d // n), 4, 512)
    return {"all-to-all": n * row, "all-gather": row}

  warm = "dense" if warmup_bits is None else "warmup"
  warm8 = {"all-reduce": 4 * d} if warmup_bits is None else int4(8)
  warm16 = {"all-reduce": 4 * d} if warmup_bits is None else int4(16)
  logged = {warm: warm8, "onebit": scatter.onebit_wire(d, 8)}
  inputs = {"flops_per_step": 2e9, "round_wire": logged["onebit"], "phase_wire": logged}
  cluster = gradcomp.sim.Cluster(16, bandwidth_gbps=10.0)
  method = transformer.ADAPTIVE["onebit_adam"]
  config = transformer.configure(method, seed=0, steps=steps, eval_every=steps)
  config.optimizer.freeze_step = 2
  config.optimizer.warmup_bits = warmup_bits
  seconds = transformer.reprice(inputs, config, cluster, steps)
  wire16 = scatter.onebit_wire(d, 16)
  assert wire16 != logged["onebit"]

  def every_step(wire):
    rounds = gradcomp.sim.simulate_rounds(cluster, 2e9, lambda s: True, wire, steps)
    return np.diff(rounds)

  tol = 2 * np.finfo(np.float64).eps * seconds[-1]  # As above.
  clock = np.diff(seconds)
  np.testing.assert_allclose(clock[2:], every_step(wire16)[2:], rtol=0, atol=tol)
  np.testing.assert_allclose(clock[:2], every_step(warm16)[:2], rtol=0, atol=tol)


def test_powersgd_is_per_leaf_and_sends_vectors_dense():
  """The suite's PowerSGD: each 2-D leaf its own factors (plan single, which
  LayerFusion runs in its per-leaf form), 1-D leaves dense: a rank-1 leaf
  comes back exact, which the seed's one matrix per group
  (``per_leaf=False``) does not give."""
  import gradcomp
  from train import optimizer

  m = transformer.METHODS["powersgd"]
  config = transformer.configure(m, seed=0, steps=600, eval_every=100)
  assert config.fusion.plan == "single"
  inner = optimizer.compressor(config.compressor, None)
  rng = np.random.default_rng(0)
  w = np.outer(rng.normal(size=32), rng.normal(size=24)).astype(np.float32)
  g = {"v": rng.normal(size=32).astype(np.float32), "w": w}
  tx = gradcomp.layerfusion(inner, config.fusion.plan)
  out, _ = tx.update(g, tx.init(g))
  np.testing.assert_array_equal(out["v"], g["v"])  # Dense: sent as it is.
  np.testing.assert_allclose(out["w"], w, rtol=1e-5, atol=1e-6)  # Rank 1 <= 4.
  # The seed's form: one matrix of the group's 800 values (its vectors="dense"
  # would send that 1-D buffer dense), rank 4 of a matrix that is not low-rank.
  seed = gradcomp.layerfusion(gradcomp.powersgd(rank=4), "single", per_leaf=False)
  out, _ = seed.update(g, seed.init(g))
  assert not np.allclose(out["w"], w, rtol=1e-2)


def test_a_scatter_form_is_re_priced_on_the_cluster_s_workers():
  """The gather form's logged wire stands for any n; the scatter form's
  all-gather carries one chunk, ``ceil(d / n)`` values: traced again, it
  halves from 8 to 16 workers, up to the chunking's rounding: at most
  n - 1 padding codes and one partial bucket's 4-byte norm per chunk, 5 n
  bytes at n = 16."""
  logged = {"round_wire": {"all-reduce": 16, "all-gather": 449_436}}
  config = transformer.configure(
    transformer.METHODS["qsgd"], seed=0, steps=600, eval_every=100, overrides={}
  )
  assert transformer._round_wire(logged, config, 16) == logged["round_wire"]
  config = transformer.configure(
    transformer.METHODS["qsgd_scatter"], seed=0, steps=600, eval_every=100, overrides={}
  )
  at = {n: transformer._round_wire(logged, config, n) for n in (8, 16)}
  assert at[8]["all-reduce"] == 16 and set(at[8]) == {
    "all-reduce",
    "all-gather",
    "all-to-all",
  }
  assert abs(at[16]["all-gather"] - at[8]["all-gather"] / 2) <= 5 * 16
  assert abs(at[16]["all-to-all"] - at[8]["all-to-all"]) <= 5 * 16


def test_cli_rejects_unknown_methods():
  with pytest.raises(SystemExit, match="known: dense, topk"):
    bench_main.main(["transformer", "--methods", "dense,bogus"])
  with pytest.raises(SystemExit, match="--seeds must be >= 1"):
    bench_main.main(["transformer", "--seeds", "0"])


def test_steps_must_exceed_the_warm_up(tmp_path):
  with pytest.raises(ValueError, match="must exceed the AdamW warm-up"):
    transformer.run(
      methods=[transformer.METHODS["dense"]], seeds=1, steps=10, out_dir=str(tmp_path)
    )
  assert not list(tmp_path.iterdir())  # Nothing trained.


def test_streaming_tables_from_a_run_result():
  """The streaming suite's summary on a hand-made result of two 64-step runs.

  DiLoCo (every 32: 2 rounds) was priced before peaks were logged: its peak is
  derived from the mean, and must be every step's own 20 bytes plus its round.
  (The program's fragment pricing is tested in test_train_streaming.py.)
  """
  from bench import streaming

  steps, d, own = 64, 1000, 20
  fragment = [
    {"all-gather": 600},
    {"all-gather": 500},
    {"all-gather": 400},
    {"all-gather": 300},
  ]
  stats = lambda x: {"mean": x, "std": None}
  result = {
    "steps": steps,
    "eval_every": 32,
    "seeds": 1,
    "overrides": {},
    "results": {
      "diloco": {
        "summary": {
          "final_bpb": stats(2.0),
          "wire_bytes_per_step": own + 4 * d * 2 / steps,
          "sim_inputs": {"flops_per_step": 1e9, "round_wire": {"all-reduce": 4 * d}},
        }
      },
      "streaming_f4_fp4": {
        "summary": {
          "final_bpb": stats(2.02),
          "wire_bytes_per_step": own + 1800 * 2 / steps,
          "sim_inputs": {
            "flops_per_step": 1e9,
            "round_wire": fragment[0],
            "peak_bytes_per_step": own + 600,
            "fragments": 4,
            "overlap": 1,
            "fragment_wire": fragment,
          },
        }
      },
    },
  }
  out = streaming.summarize(result)
  diloco, fp4 = out["rows"]["diloco"], out["rows"]["streaming_f4_fp4"]
  assert diloco["peak_bytes_per_step"] == pytest.approx(own + 4 * d)
  assert fp4["peak_over_diloco"] == pytest.approx((own + 600) / (own + 4 * d))
  assert fp4["bpb_over_diloco"] == pytest.approx(0.01)
  assert fp4["fragment_bytes"] == [600, 500, 400, 300] and out["params"] == d
  assert out["wan_scale"] == pytest.approx(streaming.GPT2_SMALL_PARAMS / d)
  for table in (out["wan"], out["wan_gpt2_small"]):
    for label in table:
      # More bandwidth never makes a run slower (same datacentres, latency).
      for dcs, _, ms in streaming.WAN:
        seconds = [table[label][streaming._key(dcs, g, ms)] for g in (1.0, 10.0, 100.0)]
        assert seconds == sorted(seconds, reverse=True)
  # Scaled 124,440x, DiLoCo's 4 GB rounds on 1 Gbps links outlast the
  # compute they would hide under; the fragments' are 4-13x smaller.
  slow = streaming._key(16, 1.0, 10.0)
  assert (
    out["wan_gpt2_small"]["streaming_f4_fp4"][slow]
    < out["wan_gpt2_small"]["diloco"][slow]
  )
  text = streaming.format_tables(result, out)
  assert "| streaming_f4_fp4 | 2.020 | +1.0% |" in text and "extrapolation" in text


def test_a_finished_run_is_read_back_whatever_its_eval_only_fields(tmp_path):
  """``eval_each_worker`` changes what an eval scores, not the trajectory: a
  run saved without it is the run of a config that sets it; a config that
  differs in a trained field is not."""
  from train import logs, train

  config = transformer.base_config()
  saved = json.loads(config.to_json_best_effort())
  (tmp_path / train.CONFIG_FILE).write_text(json.dumps(saved))
  (tmp_path / train.SIM_FILE).write_text("{}")
  rows = [{"step": 600, "wall_time": 1.0, "eval_loss": 2.0}]
  (tmp_path / logs.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert transformer.finished_run(config, tmp_path, 600) is not None
  config.eval_each_worker = False
  assert transformer.finished_run(config, tmp_path, 600) is not None
  config.optimizer.learning_rate *= 2
  assert transformer.finished_run(config, tmp_path, 600) is None
