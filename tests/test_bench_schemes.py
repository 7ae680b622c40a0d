"""The schemes suite end to end on a tiny budget (a benchmark, not a test of
accuracy): its bytes per step and simulated seconds against closed forms."""

import json
import math

import pytest

from bench import __main__ as bench_main
from bench import schemes, workloads
from train import logs

# One pytest-xdist worker runs the module, so its module fixture is built once.
pytestmark = pytest.mark.xdist_group("bench_schemes")

STEPS, EVERY = 24, 12
# The default config's MLP on digits: 64 inputs -> 128 -> 10 classes.
PARAMS = 64 * 128 + 128 + 128 * 10 + 10
# Forward FLOPs of one sample: a multiply-add is 2, a bias add 1.
FORWARD = 2 * 64 * 128 + 128 + 2 * 128 * 10 + 10
PER_WORKER_BATCH = 128 // 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  out = tmp_path_factory.mktemp("schemes")
  result = schemes.run(
    methods=[schemes.METHODS["sync"], schemes.METHODS["local_sgd_8"]],
    seeds=1,
    steps=STEPS,
    eval_every=EVERY,
    out_dir=str(out),
  )
  return out, result


def test_json_holds_each_method_and_its_last_eval(tiny):
  out, _ = tiny
  saved = json.loads((out / "schemes.json").read_text())
  assert set(saved["results"]) == {"sync", "local_sgd_8"}
  assert set(saved["clusters"]) == {"a", "b", "program"}
  for entry in saved["results"].values():
    s, (run,) = entry["summary"], entry["runs"]
    assert s["step"] == [EVERY, STEPS]
    assert set(s["sim"]) == {"a", "b", "program"}
    rows = logs.read_metrics(f"{run['workdir']}/{logs.METRICS_FILE}")
    last = [r for r in rows if "eval_accuracy" in r][-1]
    assert last["step"] == STEPS
    assert s["final_accuracy"]["mean"] == last["eval_accuracy"]
    # The post-hoc clock of the program's cluster is the run's own column.
    assert s["program_clock_max_rel_diff"] < 1e-9
  (target,) = saved["targets"]
  assert target["passed"] == (target["difference_pp"] >= -schemes.LOCAL_SGD_PP)
  assert (out / "schemes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (
    "| local_sgd_8 | local_sgd (every=8) | none |" in (out / "schemes.md").read_text()
  )


def test_local_sgd_8_sends_an_eighth_of_the_dense_round(tiny):
  _, result = tiny
  sync = result["results"]["sync"]["summary"]
  local = result["results"]["local_sgd_8"]["summary"]
  dense = 4 * PARAMS  # One fp32 all-reduce of the params.
  # Every step all-reduces its logged means (loss, accuracy, |g|^2; a scheme's
  # also |u|^2) and the int32 non-finite agreement.
  assert sync["wire_bytes_per_step"] == dense + 4 * 3 + 4
  assert local["round_wire"] == {"all-reduce": dense}
  rounds = STEPS // 8
  assert local["rounds"] == rounds
  assert local["wire_bytes_per_step"] == dense * rounds / STEPS + 4 * 4 + 4
  assert local["wire_bytes_per_step"] == pytest.approx(
    sync["wire_bytes_per_step"] / 8, rel=0.01
  )


def test_simulated_time_on_the_edge_cluster_is_the_closed_form(tiny):
  _, result = tiny
  b = schemes.clusters()["b"]
  sync = result["results"]["sync"]["summary"]
  local = result["results"]["local_sgd_8"]["summary"]
  flops = 3 * FORWARD * PER_WORKER_BATCH
  assert sync["flops_per_step"] == flops
  slowest = flops / (b.flops_per_second * min(b.speeds))
  n, alpha, per_byte = b.workers, b.latency_us * 1e-6, 8 / (b.bandwidth_gbps * 1e9)

  def ring_all_reduce(nbytes):
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * per_byte

  # Synchronous: the slowest worker's compute, then the all-reduce, every step.
  step = slowest + ring_all_reduce(sync["wire_bytes_per_step"])
  assert sync["sim"]["b"]["seconds"] == pytest.approx([EVERY * step, STEPS * step])
  # Local SGD: the slowest worker's compute every step, one all-reduce per round.
  end = STEPS * slowest + (STEPS // 8) * ring_all_reduce(4 * PARAMS)
  assert local["sim"]["b"]["end"] == pytest.approx(end)


def test_cli_rejects_unknown_methods(capsys):
  with pytest.raises(SystemExit, match="known: sync, local_sgd_2"):
    bench_main.main(["schemes", "--methods", "sync,bogus"])
  with pytest.raises(SystemExit, match="--seeds must be >= 1"):
    bench_main.main(["schemes", "--seeds", "0"])


def test_gpt_tiny_workload_reports_bits_per_byte(tmp_path):
  """``--workload gpt_tiny``: one smoke run of local SGD; bits per byte of the
  average model and the workers' mean, no fixed-accuracy times."""
  workload = workloads.GPT_TINY.with_overrides(workloads.SMOKE)
  schemes.run(
    methods=[schemes.METHODS["local_sgd_2"]],
    seeds=1,
    steps=4,
    eval_every=2,
    out_dir=str(tmp_path),
    workload=workload,
  )
  saved = json.loads((tmp_path / "schemes.json").read_text())
  assert saved["config"].startswith("configs/gpt_tiny.py")
  assert saved["reach"] == [] and saved["targets"] == []
  s, (run,) = (saved["results"]["local_sgd_2"][k] for k in ("summary", "runs"))
  rows = logs.read_metrics(f"{run['workdir']}/{logs.METRICS_FILE}")
  last = [r for r in rows if "eval_bits_per_byte" in r][-1]
  assert s["final_bpb"]["mean"] == pytest.approx(last["eval_bits_per_byte"])
  mean_worker = last["eval_worker_loss_mean"] / math.log(2)
  assert s["final_worker_bpb_mean"]["mean"] == pytest.approx(mean_worker)
  assert s["sim"]["a"]["reach"] == {} and s["program_clock_max_rel_diff"] < 1e-9
  table = (tmp_path / "schemes.md").read_text()
  assert "final bpb (average, bits/byte) | workers' mean |" in table
  assert "| local_sgd_2 | local_sgd (every=2) | none |" in table
