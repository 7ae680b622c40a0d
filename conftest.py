"""Eight virtual CPU devices for the tests and every doctest, set before JAX starts.

Lives at the repository root so that the docstring examples (``pytest
--doctest-modules gradcomp``) and the documentation pages (``docs/**/*.md``,
collected by Sybil) run on the same eight devices as ``tests/``. Every
``python`` code block of a page runs, in order, in one namespace per page;
``>>>`` lines in it are checked as doctests.
"""

import doctest
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache for both pytest workers and every program a test
# starts (SIGKILL resumes, two-process runs, CLIs): they compile the same
# small programs again and again, and reading one back is cheaper than
# compiling it. Keyed by the program, JAX's version and the devices, so a
# stale entry is never used; a fresh clone (CI) starts it empty.
for _name, _value in {
  "JAX_COMPILATION_CACHE_DIR": str(Path(__file__).parent / ".jax_cache"),
  "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
  "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}.items():
  os.environ.setdefault(_name, _value)

# Tests compile hundreds of small programs and run each a few times: LLVM's
# optimisations cost more compile time than they save (12-17 % of the suite,
# measured on 2 cores). The HLO passes are unchanged, and LLVM keeps IEEE
# float semantics at every level (no fast-math), so results are too.
# XLA:CPU's MLIR fusion emitters cost more again: the elemental (LLVM IR)
# emitters compile the same fusions with 31 % less CPU time on the
# conformance suite (154.8 s -> 106.5 s, cold cache) and 35-45 % less on six
# codecs' 8-worker programs, with the same results (the conformance suite's
# bit-for-bit jit / eager / pmap checks, the docstring and page doctests).
os.environ["XLA_FLAGS"] = " ".join(
  [
    os.environ.get("XLA_FLAGS", ""),
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
  ]
).strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from sybil import Sybil  # noqa: E402
from sybil.parsers.myst import PythonCodeBlockParser, SkipParser  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

_OPTIONFLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

pytest_collect_file = Sybil(
  parsers=[PythonCodeBlockParser(doctest_optionflags=_OPTIONFLAGS), SkipParser()],
  patterns=["*.md"],
  path="docs",
  excludes=["_build/*"],
).pytest()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Puts each page's examples in one ``xdist_group``, and keeps groups on one worker.

  A page's code blocks share its namespace, so they must run on one worker,
  in order (first, before xdist's own hook reads the groups).

  pytest-xdist (3.8) groups tests by appending ``@<group>`` to each marked
  item's node id in the worker, by assigning ``item._nodeid``; pytest 9.2
  derives ``nodeid`` from a structured ``item._id`` instead, so the suffix is
  lost and every test is scheduled on its own (pytest-dev/pytest-xdist#1386):
  the module fixtures of grouped modules were built on both workers. This
  sets the suffixed id where xdist's assignment no longer does; it does
  nothing without ``--dist loadgroup``, on a pytest without ``_id`` (where
  xdist's own assignment works) or where the suffix is already there.
  """
  for item in items:
    if item.path.suffix == ".md":
      item.add_marker(pytest.mark.xdist_group(f"docs-{item.path.stem}"))
  if not getattr(config.option, "loadgroup", False):
    return
  try:
    from _pytest.nodeid import NodeId
  except ImportError:  # pytest < 9.2: xdist's own suffix takes effect
    return
  for item in items:
    groups = {
      str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
      for mark in item.iter_markers("xdist_group")
    }
    suffix = "@" + "_".join(sorted(groups))
    if groups and hasattr(item, "_id") and not item.nodeid.endswith(suffix):
      item._id = NodeId.parse(item.nodeid + suffix)
