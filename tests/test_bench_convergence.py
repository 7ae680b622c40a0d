"""The convergence suite end to end on a tiny budget (it is a benchmark, not a test
of accuracy): its numbers are those of the runs' own ``metrics.jsonl``, and a
dense run repeated with the same seed gives the same curve."""

import dataclasses
import json

import pytest

from bench import convergence, workloads
from train import logs

# One pytest-xdist worker runs the module, so its module fixture is built once.
pytestmark = pytest.mark.xdist_group("bench_convergence")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """Dense and Sketch-Fusion (plan "single": no profiling), 1 seed, 20 steps."""
  out = tmp_path_factory.mktemp("convergence")
  methods = [
    convergence.METHODS["dense"],
    dataclasses.replace(convergence.METHODS["sketch_fusion"], plan="single"),
  ]
  result = convergence.run(
    methods=methods,
    seeds=1,
    steps=20,
    eval_every=10,
    throughput_steps=0,
    out_dir=str(out),
  )
  return out, result


def test_json_final_accuracy_is_the_last_eval_row_of_the_run(tiny):
  out, _ = tiny
  saved = json.loads((out / "convergence.json").read_text())
  for label in ("dense", "sketch_fusion"):
    entry = saved["digits"]["methods"][label]
    (run,) = entry["runs"]
    rows = logs.read_metrics(f"{run['workdir']}/{logs.METRICS_FILE}")
    last = [r for r in rows if "eval_accuracy" in r][-1]
    assert last["step"] == 20
    assert entry["summary"]["final_accuracy"]["mean"] == last["eval_accuracy"]
    assert run["curve"]["step"] == [10, 20]
    assert 0 < run["curve"]["train_seconds"][0] < run["curve"]["train_seconds"][1]
    # Two clocks: wall time since the run started covers its training steps.
    assert run["curve"]["elapsed_seconds"][-1] > run["curve"]["train_seconds"][-1]
  target = saved["digits"]["target"]
  diff = 100 * (target["sketch_fusion"] - target["dense"])
  assert target["difference_pp"] == pytest.approx(diff)
  assert target["passed"] == (diff >= -convergence.TARGET_PP)
  assert (out / "convergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (
    "| sketch_fusion | sketch_topk | single (1) |"
    in (out / "convergence.md").read_text()
  )


def test_dense_is_deterministic_for_a_seed(tiny, tmp_path):
  _, result = tiny
  config = convergence.configure(
    convergence._digits_config,
    convergence.METHODS["dense"],
    seed=0,
    steps=20,
    eval_every=10,
  )
  again = convergence.run_one(config, tmp_path / "again")
  rows = [r for r in again["rows"] if "eval_accuracy" in r]
  (first,) = result["digits"]["methods"]["dense"]["runs"]
  assert [r["eval_accuracy"] for r in rows] == first["curve"]["eval_accuracy"]
  assert [r["eval_loss"] for r in rows] == first["curve"]["eval_loss"]


def test_time_is_steps_times_batch_over_the_logged_rate():
  rows = [
    {"step": 0, "wall_time": 0.0, "started": True},
    {"step": 10, "samples_per_sec": 1280.0},  # 10 steps of 128 in 1 s
    {"step": 10, "eval_accuracy": 0.5, "eval_loss": 1.0},
    {"step": 20, "samples_per_sec": None},  # the run's mean rate: 1.5 s
    {"step": 25, "eval_accuracy": 0.6, "eval_loss": 0.9},
    {"step": 30, "samples_per_sec": 640.0},  # 2 s
    {"step": 30, "eval_accuracy": 0.7, "eval_loss": 0.8},
  ]
  curve = convergence.eval_curve(rows, batch_size=128)
  assert curve["step"] == [10, 25, 30]
  assert curve["train_seconds"] == pytest.approx([1.0, 3.5, 4.5])
  # Rows without a rate are left out of throughput with their steps.
  assert convergence.throughput(rows, 128, skip=0) == pytest.approx(20 * 128 / 3)
  assert convergence.throughput(rows, 128, skip=20) == 640.0


def test_gpt_tiny_workload_reports_bits_per_byte(tmp_path):
  """``--workload gpt_tiny``: one smoke run; the table's final bpb is the run's
  last ``eval_bits_per_byte``, and signSGD's SGD-tuned lr is not applied."""
  workload = workloads.GPT_TINY.with_overrides(workloads.SMOKE)
  result = convergence.run(
    methods=[convergence.METHODS["signsgd"]],
    seeds=1,
    steps=4,
    eval_every=2,
    throughput_steps=0,
    out_dir=str(tmp_path),
    workload=workload,
  )
  saved = json.loads((tmp_path / "convergence.json").read_text())
  assert saved["workload"]["name"] == "gpt_tiny" and "digits" not in saved
  entry = saved["gpt_tiny"]["methods"]["signsgd"]
  (run,) = entry["runs"]
  rows = logs.read_metrics(f"{run['workdir']}/{logs.METRICS_FILE}")
  last = [r for r in rows if "eval_bits_per_byte" in r][-1]
  assert last["step"] == 4
  assert entry["summary"]["final_bpb"]["mean"] == pytest.approx(
    last["eval_bits_per_byte"]
  )
  assert 3.0 < entry["summary"]["final_bpb"]["mean"] < 9.0
  assert result["methods"]["signsgd"]["optimizer"] == {}  # AdamW's lr kept.
  table = (tmp_path / "convergence.md").read_text()
  assert "final bpb (bits/byte)" in table and "| signsgd | signsgd |" in table
  assert (tmp_path / "convergence.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
