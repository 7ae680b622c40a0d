"""Process setup that must happen before JAX starts its backends.

Both ``jax_num_cpu_devices`` and ``jax.distributed.initialize`` only take
effect before the first JAX computation (STYLE "Avoid": settings applied after
the backends start are ignored or refused), so ``python -m train`` calls these
first thing in ``main``.
"""

from __future__ import annotations

import os

import jax
from absl import logging

ENV_CPU_DEVICES = "GRADCOMP_NUM_CPU_DEVICES"
DEFAULT_CPU_DEVICES = 8


def default_cpu_devices() -> int:
  """``$GRADCOMP_NUM_CPU_DEVICES``, else 8."""
  return int(os.environ.get(ENV_CPU_DEVICES, DEFAULT_CPU_DEVICES))


def configure_cpu_devices(count: int) -> None:
  """Gives the CPU backend ``count`` virtual devices, if it has not started.

  The setting only shapes the CPU platform: where a GPU or TPU is the default
  backend, the mesh is built over the real devices and this is inert. When
  JAX is already running (e.g. under pytest, whose ``conftest.py`` set the
  devices), the existing devices are kept.

  Args:
    count: number of CPU devices, >= 1.
  """
  if count < 1:
    raise ValueError(f"num_cpu_devices must be >= 1, got {count}")
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError:  # Backends already initialised with another count.
    logging.warning(
      "JAX is already initialised; keeping its %d CPU devices instead of %d",
      jax.config.jax_num_cpu_devices,
      count,
    )


def persistent_cache_hazard() -> str | None:
  """Why a multi-process run should not use JAX's persistent compilation cache, if it does.

  With the cache on, a two-process GoSGD run on CPU (gloo) deadlocked at its
  first step in 2 of 2 runs, and in 0 of 2 without it (BUILD_NOTES, Known
  gaps): only rank 0 writes the cache and every rank reads it, so ranks can
  run executables that did not come from one compilation.
  """
  directory = jax.config.jax_compilation_cache_dir
  if not (jax.config.jax_enable_compilation_cache and directory):
    return None
  return (
    f"JAX's persistent compilation cache is on ({directory}) in a multi-process "
    "run: a two-process GoSGD run deadlocked with it at its first step; set "
    "JAX_ENABLE_COMPILATION_CACHE=false if a run hangs in a collective"
  )


def initialize_distributed(
  coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> None:
  """``jax.distributed.initialize`` for a multi-host run, else nothing.

  A run is multi-host when a coordinator address is given (flag or
  ``$JAX_COORDINATOR_ADDRESS``); the process count and id come from their
  flags, or JAX's own environment detection (SLURM, Cloud TPU) when unset.
  Every process runs the same program on its own devices; on CPU they
  exchange through gloo (``tests/test_multihost.py`` runs two on one host).
  """
  address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not address:
    return
  # CPU processes exchange through gloo unless told otherwise
  # ($JAX_CPU_COLLECTIVES_IMPLEMENTATION); older jaxlibs default to none.
  if jax.config.jax_cpu_collectives_implementation in (None, "none"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=address, num_processes=num_processes, process_id=process_id
  )
  if hazard := persistent_cache_hazard():
    logging.warning(hazard)
  logging.info(
    "process %d of %d (coordinator %s)",
    jax.process_index(),
    jax.process_count(),
    address,
  )
