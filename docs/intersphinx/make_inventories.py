"""The object lists behind the docs' links to jax, optax and flax (intersphinx).

The documentation builds offline (CI reaches package registries only), so
Sphinx cannot download the projects' ``objects.inv``. This script derives
each project's list from its documentation *sources*, at a named commit:
every ``.. autosummary::`` entry with a ``:toctree:`` (one generated page per
name, anchored by the full name) and every ``.. autoclass::`` /
``.. autofunction::`` of the pages read. A name is kept only if the installed
package has it, and its role (class or function) is read from that object.
``docs/conf.py`` compiles the resulting ``NAME.txt`` files (``name role
uri``, the uri relative to the project's docs root, ``$`` for the name) into
inventories at build time.

Run from the repository root with local clones of the three projects::

  .venv/bin/python -P docs/intersphinx/make_inventories.py OPTAX_REPO JAX_REPO FLAX_REPO

Pages read: optax ``docs/api/*.rst``; jax ``docs/jax.rst``, ``jax.lax``,
``jax.tree``, ``jax.numpy``, ``jax.random``, ``jax.nn`` and
``jax.sharding``'s classes; flax ``docs/api_reference/flax.linen/*.rst``
(Linen's site, flax-linen.readthedocs.io).
"""

import importlib
import inspect
import pathlib
import re
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def show(repo, path):
  return subprocess.run(
    ["git", "-C", repo, "show", f"HEAD:{path}"],
    capture_output=True,
    text=True,
    check=True,
  ).stdout


def ls(repo, path):
  out = subprocess.run(
    ["git", "-C", repo, "ls-tree", "--name-only", "HEAD", path],
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  return out.split()


def resolve(fullname):
  parts = fullname.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except Exception:
      continue
    try:
      for p in parts[i:]:
        obj = getattr(obj, p)
    except AttributeError:
      return None
    return obj
  return None


def role(obj):
  if inspect.isclass(obj) or type(obj).__module__ == "typing":
    return "py:class"
  if callable(obj):
    return "py:function"
  return "py:data"


def autosummary(text, toctree_dir):
  """(fullname, uri) of every autosummary entry with a :toctree: in text."""
  out, module = [], None
  lines = text.split("\n")
  i = 0
  while i < len(lines):
    line = lines[i]
    m = re.match(r"\.\. (?:currentmodule|automodule):: (\S+)", line.strip())
    if m:
      module = m.group(1)
    if line.strip().startswith(".. autosummary::"):
      j, toctree = i + 1, None
      while j < len(lines) and (
        lines[j].strip().startswith(":") or not lines[j].strip()
      ):
        t = re.match(r"\s*:toctree:\s*(\S+)", lines[j])
        if t:
          toctree = t.group(1).rstrip("/")
        j += 1
        if (
          j < len(lines)
          and lines[j].strip()
          and not lines[j].strip().startswith(":")
          and not lines[j - 1].strip()
        ):
          break
      while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
        name = lines[j].strip()
        if name and not name.startswith(":") and not name.startswith(".."):
          full = f"{module}.{name}" if module else name
          if toctree:
            out.append((full, f"{toctree_dir}{toctree}/{full}.html#$"))
        j += 1
      i = j
      continue
    i += 1
  return out


def write(name, entries, header):
  seen, rows = set(), []
  for full, uri in entries:
    if full in seen:
      continue
    obj = resolve(full) if full.split(".")[0] == name else None
    if obj is None:
      continue
    seen.add(full)
    rows.append(f"{full} {role(obj)} {uri}")
    # A class is also named where it is defined (optax._src.base.
    # GradientTransformation): type hints in signatures refer to it there.
    defined = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
    if inspect.isclass(obj) and defined != full and defined not in seen:
      if defined.split(".")[0] in (name, "jaxlib") and "<" not in defined:
        seen.add(defined)
        rows.append(f"{defined} py:class {uri.replace('#$', '#' + full)}")
  with open(HERE / f"{name}.txt", "w") as f:
    f.write(header)
    f.write("\n".join(sorted(rows)) + "\n")
  print(name, len(rows))


def commit(repo: str) -> str:
  """The commit of ``repo`` the lists are read at."""
  return subprocess.run(
    ["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
  ).stdout.strip()


def main(optax_repo: str, jax_repo: str, flax_repo: str) -> None:
  entries = []
  for path in ls(optax_repo, "docs/api/"):
    if path.endswith(".rst"):
      entries += autosummary(show(optax_repo, path), "api/")
  write(
    "optax",
    entries,
    "# optax: https://optax.readthedocs.io/en/latest/ "
    f"(docs/api/*.rst at google-deepmind/optax@{commit(optax_repo)})\n",
  )

  entries = []
  for page in ("jax", "jax.lax", "jax.tree", "jax.numpy", "jax.random", "jax.nn"):
    entries += autosummary(show(jax_repo, f"docs/{page}.rst"), "")
  text = show(jax_repo, "docs/jax.sharding.rst")
  for cls in re.findall(r"\.\. autoclass:: (\S+)", text):
    entries.append((f"jax.sharding.{cls}", "jax.sharding.html#$"))
  write(
    "jax",
    entries,
    "# jax: https://docs.jax.dev/en/latest/ "
    f"(docs/*.rst at jax-ml/jax@{commit(jax_repo)})\n",
  )

  entries = []
  base = "docs/api_reference/flax.linen/"
  for path in ls(flax_repo, base):
    page = path[len("docs/") : -len(".rst")] + ".html"
    module = None
    for line in show(flax_repo, path).split("\n"):
      m = re.match(r"\.\. (?:currentmodule|automodule):: (\S+)", line.strip())
      if m:
        module = m.group(1)
      m = re.match(r"\.\. auto(class|function):: (\S+)", line.strip())
      if m and module:
        entries.append((f"{module}.{m.group(2)}", page + "#$"))
  write(
    "flax",
    entries,
    "# flax (Linen): https://flax-linen.readthedocs.io/en/latest/ "
    f"(docs/api_reference/flax.linen/*.rst at google/flax@{commit(flax_repo)})\n",
  )


if __name__ == "__main__":
  main(*sys.argv[1:4])
