"""What a run leaves for the user besides checkpoints (issue 5): TensorBoard
event files holding the scalars of ``metrics.jsonl``, ``train.plot``'s figure
and the ``config.profile_steps`` trace.

The event files are read back with nothing from the writer's code path: the
TFRecord framing parsed here, the ``Event`` proto decoded by protobuf.
"""

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboardX.proto import event_pb2
from test_train import ROOT, tiny_config

from train import logs, plot, train

# One pytest-xdist worker runs the module, so its module fixture is built once.
pytestmark = pytest.mark.xdist_group("train_outputs")


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def read_events(workdir):
  """Every ``Event`` of the workdir's event files, in file-name order."""
  events = []
  for path in sorted(Path(workdir).glob("events.out.tfevents.*")):
    data = path.read_bytes()
    offset = 0
    while offset < len(data):
      # TFRecord: uint64 length, uint32 crc of it, payload, uint32 crc of it.
      (length,) = struct.unpack_from("<Q", data, offset)
      payload = data[offset + 12 : offset + 12 + length]
      assert len(payload) == length, f"torn record in {path}"
      events.append(event_pb2.Event.FromString(payload))
      offset += 12 + length + 4
  return events


def scalars(events):
  """``{(tag, step): value}``; a tag logged twice at one step is an error."""
  out = {}
  for event in events:
    for value in event.summary.value:
      key = (value.tag, event.step)
      assert key not in out, f"{key} logged twice"
      out[key] = value.simple_value
  return out


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory):
  """A short tiny run (one compile) tracing two steps, shared by the tests."""
  workdir = tmp_path_factory.mktemp("outputs")
  config = tiny_config(
    num_train_steps=40,
    log_every_steps=10,
    eval_every_steps=20,
    checkpoint_every_steps=20,
    profile_steps=2,
  )
  train.train_and_evaluate(config, workdir)
  return workdir


def test_event_files_hold_the_jsonl_scalars(profiled_run):
  rows = logs.read_metrics(profiled_run / logs.METRICS_FILE)
  want = {
    (key, row["step"]): value
    for row in rows
    for key, value in row.items()
    if key not in ("step", "wall_time", "started") and value is not None
  }
  got = scalars(read_events(profiled_run))
  assert set(got) == set(want)
  # Every training-loss and eval row is there, not only the keys.
  assert [s for (k, s) in sorted(want) if k == "loss"] == [10, 20, 30, 40]
  assert [s for (k, s) in sorted(want) if k == "eval_accuracy"] == [20, 40]
  for key, value in want.items():
    assert got[key] == pytest.approx(value, rel=1e-6), key  # float32 in events


def test_resumed_writer_purges_and_keeps_both_event_files(tmp_path):
  first = logs.MetricWriter(tmp_path)
  for step in (1, 2, 3):
    first.write(step, loss=1.0 / step)
  first.close()
  resumed = logs.MetricWriter(tmp_path, resume_step=2)  # Killed after step 2.
  resumed.write(3, loss=0.25)
  resumed.close()

  files = sorted(tmp_path.glob("events.out.tfevents.*"))
  assert len(files) == 2, files  # Even when both opened within one second.
  events = read_events(tmp_path)
  # TensorBoard drops the first file's step 3 on the resumed file's START.
  (start,) = [e for e in events if e.session_log.status == e.session_log.START]
  assert start.step == 3
  losses = [
    (e.step, e.summary.value[0].simple_value) for e in events if e.summary.value
  ]
  assert losses[-1] == (3, 0.25)
  rows = logs.read_metrics(tmp_path / logs.METRICS_FILE)
  assert [(r["step"], r.get("loss")) for r in rows] == [
    (0, None),
    (1, 1.0),
    (2, 0.5),
    (2, None),
    (3, 0.25),
  ]
  assert [r.get("started", False) for r in rows] == [True, False, False, True, False]


def test_elapsed_seconds_skip_the_time_between_kill_and_resume():
  rows = [
    {"step": 0, "wall_time": 100.0, "started": True},
    {"step": 10, "wall_time": 110.0},
    {"step": 20, "wall_time": 120.0},
    # Killed at 130 after step 20's checkpoint; resumed at 500.
    {"step": 20, "wall_time": 500.0, "started": True},
    {"step": 30, "wall_time": 505.0},
  ]
  assert logs.elapsed_seconds(rows) == [0.0, 10.0, 20.0, 20.0, 25.0]
  # A file without start rows counts from its first row.
  assert logs.elapsed_seconds(rows[1:3]) == [0.0, 10.0]


def synthetic_run(workdir, losses, accuracies):
  workdir.mkdir()
  rows = [{"step": 0, "wall_time": 1000.0, "started": True}]
  for i, loss in enumerate(losses, 1):
    rows.append({"step": 10 * i, "wall_time": 1000.0 + i, "loss": loss})
  for i, acc in enumerate(accuracies, 1):
    rows.append({"step": 20 * i, "wall_time": 1000.5 + 2 * i, "eval_accuracy": acc})
  rows.append({"step": 40, "wall_time": 1005.0, "loss": None})  # Non-finite.
  text = "".join(json.dumps(r) + "\n" for r in rows)
  (workdir / logs.METRICS_FILE).write_text(text + '{"step": 5')  # Torn line.


def test_plot_draws_two_runs(tmp_path):
  synthetic_run(tmp_path / "topk", [2.0, 1.0, 0.5], [0.5, 0.8])
  synthetic_run(tmp_path / "none", [2.0, 0.8, 0.3], [0.6, 0.9])
  path = plot.plot([tmp_path / "topk", tmp_path / "none"])
  assert path == tmp_path / "topk" / plot.DEFAULT_FILE
  assert path.read_bytes().startswith(PNG_MAGIC)
  assert path.stat().st_size > 10_000  # Four panels with lines, not a blank.


def test_plot_missing_metrics_is_a_clear_error(tmp_path, capsys):
  synthetic_run(tmp_path / "good", [1.0], [0.5])
  missing = tmp_path / "typo" / logs.METRICS_FILE
  with pytest.raises(FileNotFoundError, match=str(missing)):
    plot.plot([tmp_path / "good", tmp_path / "typo"])
  with pytest.raises(SystemExit) as exit_info:
    plot.main([str(tmp_path / "typo")])
  assert exit_info.value.code == 2
  assert str(missing) in capsys.readouterr().err
  assert not (tmp_path / "good" / plot.DEFAULT_FILE).exists()


def test_plot_command_line_on_a_real_run(profiled_run, tmp_path):
  out = tmp_path / "curves.png"
  done = subprocess.run(
    [sys.executable, "-m", "train.plot", str(profiled_run), f"--out={out}"],
    cwd=ROOT,
    capture_output=True,
    text=True,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.strip() == str(out)
  assert out.read_bytes().startswith(PNG_MAGIC)


def test_profile_steps_write_a_trace(profiled_run):
  traces = [p for p in (profiled_run / "profile").rglob("*") if p.is_file()]
  assert any(p.name.endswith(".xplane.pb") for p in traces), traces
  assert all(p.stat().st_size > 0 for p in traces)
