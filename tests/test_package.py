"""The library stands alone: the wheel holds only ``gradcomp``, and importing it
loads none of the program's or the benchmarks' world.

Three layers, three packages (pyproject.toml): ``gradcomp`` the library (the
only package the wheel installs), ``train`` + ``configs`` the program, and
``bench`` the evidence, which run from a checkout. ``lint-imports`` checks the
static imports; these tests check what a user gets: the built wheel's files,
the modules an import really loads (a lazy import inside a function, or a
dependency's own imports, escape the static check), and the README's example
run from the installed wheel outside the checkout.

Each check is a function that the tests also run on a case that must fail
(a wheel that ships ``train/``, an import of ``bench.plots``), so a check that
cannot fail is caught.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

# One worker runs the module: its tests share the module's wheel build (``wheel``),
# built once.
pytestmark = pytest.mark.xdist_group("package")

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: What ``import gradcomp.<anything>`` must never load (DESIGN §13): the
#: program's and the benchmarks' dependencies, and the program itself.
FORBIDDEN = (
  "orbax",
  "ml_collections",
  "matplotlib",
  "tensorboardX",
  "psutil",
  "ray",
  "sklearn",
  "train",
  "bench",
  "configs",
)
#: ``gradcomp.edgegossip`` is the one door to scikit-learn (the extra of that
#: name); scikit-learn's joblib (loky) loads psutil itself when it is installed.
EDGEGOSSIP_ALLOWS = ("sklearn", "psutil")

# Imports every submodule of a package (``__main__``s excluded: they run a
# command), then prints, as JSON, the forbidden top-level modules now loaded.
_IMPORT_ALL = """
import importlib, json, pkgutil, sys
package, skip, forbidden = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
names = []
def visit(name):  # pkgutil.walk_packages would import the skipped packages
  if name.endswith(".__main__") or (skip and name.startswith(skip)):
    return
  module = importlib.import_module(name)
  names.append(name)
  for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
    visit(f"{name}.{info.name}")
visit(package)
loaded = sorted({m.split(".")[0] for m in sys.modules} & set(forbidden))
print(json.dumps({"modules": len(names), "loaded": loaded}))
"""


def loaded_by_import(package: str, *, skip: str = "") -> tuple[int, list[str]]:
  """(modules imported, forbidden top-level modules loaded) for ``package``.

  Runs in a fresh interpreter, so nothing this test process imported counts.
  """
  done = subprocess.run(
    [sys.executable, "-c", _IMPORT_ALL, package, skip, ",".join(FORBIDDEN)],
    cwd=ROOT,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(done.stdout.strip().splitlines()[-1])
  return result["modules"], result["loaded"]


def test_importing_the_library_loads_none_of_the_program():
  count, loaded = loaded_by_import("gradcomp", skip="gradcomp.edgegossip")
  assert count > 50, count  # the walk reached the subpackages
  assert loaded == []


def test_edgegossip_loads_scikit_learn_and_nothing_else():
  _, loaded = loaded_by_import("gradcomp.edgegossip")
  assert set(loaded) <= set(EDGEGOSSIP_ALLOWS), loaded


def test_the_import_check_can_fail():
  # The plots of the benchmarks draw with matplotlib, and bench imports gradcomp.
  _, loaded = loaded_by_import("bench.plots")
  assert "matplotlib" in loaded and "bench" in loaded


def top_level_names(wheel: pathlib.Path) -> set[str]:
  """The first path component of every file in a wheel."""
  with zipfile.ZipFile(wheel) as archive:
    return {name.split("/")[0] for name in archive.namelist()}


def library_only(names: set[str]) -> bool:
  """True when a wheel's top-level names are ``gradcomp`` and its metadata."""
  return all(
    n == "gradcomp" or re.fullmatch(r"gradcomp-[^/]+\.dist-info", n) for n in names
  )


def test_the_wheel_check_can_fail(tmp_path):
  wheel = tmp_path / "gradcomp-0.1.0-py3-none-any.whl"
  with zipfile.ZipFile(wheel, "w") as archive:
    for name in (
      "gradcomp/__init__.py",
      "train/__init__.py",
      "gradcomp-0.1.0.dist-info/METADATA",
    ):
      archive.writestr(name, "")
  assert not library_only(top_level_names(wheel))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
  """The project's wheel, built from a copy of the checkout's files.

  A copy of every file git knows (tracked or new, not ignored), so the build
  sees train/, configs/ and bench/ beside gradcomp/ as a user's checkout has
  them, and leaves no build/ or egg-info in the repository. No build
  isolation: the tests run offline, with setuptools from the dev extra.
  """
  tree = tmp_path_factory.mktemp("checkout")
  files = subprocess.run(
    ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.split("\0")
  for name in filter(None, files):
    source = ROOT / name
    if source.is_file():
      (tree / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(source, tree / name)
  out = tmp_path_factory.mktemp("dist")
  done = subprocess.run(
    [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    + ["--quiet", "--wheel-dir", str(out), str(tree)],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  (built,) = out.glob("gradcomp-*.whl")
  return built


def test_the_wheel_holds_only_the_library(wheel):
  names = top_level_names(wheel)
  assert library_only(names), sorted(names)
  with zipfile.ZipFile(wheel) as archive:
    metadata = archive.read(
      next(n for n in archive.namelist() if n.endswith("METADATA"))
    )
  requires = [
    line.split(":", 1)[1].strip()
    for line in metadata.decode().splitlines()
    if line.startswith("Requires-Dist:") and "extra ==" not in line
  ]
  # The library's own dependencies, and nothing of the program's.
  assert {re.split(r"[<>=!~ ;\[]", r)[0].lower() for r in requires} == {
    "jax",
    "jaxlib",
    "optax",
    "chex",
    "numpy",
    "flax",
  }


def readme_example() -> str:
  text = (ROOT / "README.md").read_text()
  example = text[text.index("## Example") :]
  return re.search(r"```python\n(.*?)```", example, re.DOTALL).group(1)


def test_the_readme_example_runs_from_the_installed_wheel(wheel, tmp_path):
  """``pip install <wheel>``, then the README's example, as written, elsewhere.

  The wheel goes into its own folder; the interpreter starts without site
  (``-S``: the checkout's editable install is a .pth there) and finds the
  library there and its dependencies in this environment's site-packages,
  from a working directory outside the checkout, where ``import train`` fails.
  """
  site = tmp_path / "site"
  done = subprocess.run(
    [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    + ["--target", str(site), str(wheel)],
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  script = tmp_path / "example.py"
  script.write_text(
    readme_example()
    + f"\nassert gradcomp.__file__.startswith({str(site)!r}), gradcomp.__file__\n"
    + "try:\n  import train\nexcept ModuleNotFoundError:\n  print('no train')\n"
  )
  env = {
    "PATH": os.environ.get("PATH", ""),
    "JAX_PLATFORMS": "cpu",
    "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]]),
  }
  run = subprocess.run(
    [sys.executable, "-S", str(script)],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  assert run.stdout.strip().endswith("no train")


def test_the_program_is_not_importable_outside_the_checkout(tmp_path):
  # This environment's own interpreter, with its site (the editable install).
  done = subprocess.run(
    [sys.executable, "-c", "import gradcomp\nimport train"],
    cwd=tmp_path,
    env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ""},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode != 0
  assert "No module named 'train'" in done.stderr
