"""``python -m train --config configs/default.py --workdir DIR`` (DESIGN §3).

Kept short, as flax's ``examples/imagenet/main.py``: flags, process setup,
then ``train_and_evaluate``. Override config fields on the command line, e.g.
``--config.compressor.name=topk --config.compressor.ratio=0.01``. A config
the program cannot run (an unknown name, a required field left unset, a
missing dataset) ends it with one line naming what to change; ``--debug``
shows the traceback instead.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from train import launch

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "Config file (configs/*.py).", lock_config=True
)
_WORKDIR = flags.DEFINE_string(
  "workdir", None, "Directory for checkpoints and logs; a run there resumes."
)
_CPU_DEVICES = flags.DEFINE_integer(
  "num_cpu_devices",
  launch.default_cpu_devices(),
  f"Virtual CPU devices when training on CPU (${launch.ENV_CPU_DEVICES}).",
)
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address", None, "host:port of process 0, for multi-host runs."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in all.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_DEBUG = flags.DEFINE_bool(
  "debug", False, "Show the traceback of a configuration or data error."
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:  # Orbax logs every save at INFO.
    logging.set_verbosity(logging.WARNING)
  if "islands" in _CONFIG.value:  # DESIGN §12: Ray actors, each its own JAX program.
    from train.islands import run

    return run.main(_CONFIG.value, _WORKDIR.value, _DEBUG.value)
  launch.configure_cpu_devices(_CPU_DEVICES.value)
  launch.initialize_distributed(
    _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value
  )
  from train import train  # After the setup above; it builds the mesh.

  try:
    train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except (ValueError, FileNotFoundError, train.NonFiniteError) as e:
    if _DEBUG.value:
      raise
    # What the user can fix, in their terms: no traceback (--debug shows it).
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main)
