"""Sphinx configuration of gradcomp's documentation site.

Sphinx rather than MkDocs: autodoc + napoleon render the Google-style
docstrings (``Args:``, ``Returns:``, ``References:``) and their ``.. math::``
blocks as they are written, autosummary gives every public name a page, and
MyST lets the guides stay Markdown. Built with warnings as errors by ``make
docs`` and by ``tests/test_docs.py``; the examples run as doctests under pytest
(``--doctest-modules`` for docstrings, Sybil for the pages; ``conftest.py``).
"""

import hashlib
import os
import pathlib
import tempfile
import zlib

# The API pages import gradcomp; one CPU device is enough to render them.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "gradcomp"
author = "the gradcomp developers"
copyright = "2026, the gradcomp developers"

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
  "sphinx.ext.intersphinx",
  "sphinx.ext.mathjax",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path = ["_templates"]

myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

autosummary_generate = True
autosummary_imported_members = True
autodoc_default_options = {"members": False, "show-inheritance": False}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_custom_sections = [("References", "notes_style"), ("Examples", "examples")]

html_theme = "furo"
html_title = "gradcomp"
html_static_path = []


# Links to jax, optax and flax (Linen). The build is offline (CI reaches
# package registries only), so the projects' objects.inv cannot be
# downloaded: docs/intersphinx/NAME.txt lists each project's objects (derived
# from its documentation sources at a named commit by
# docs/intersphinx/make_inventories.py), compiled here into the inventory
# format Sphinx reads from a local file.
_INTERSPHINX = {
  "jax": "https://docs.jax.dev/en/latest/",
  "optax": "https://optax.readthedocs.io/en/latest/",
  "flax": "https://flax-linen.readthedocs.io/en/latest/",
}


def _inventory(name: str) -> str:
  """``docs/intersphinx/<name>.txt`` as an ``objects.inv`` file; its path."""
  text = (pathlib.Path(__file__).parent / "intersphinx" / f"{name}.txt").read_text()
  rows = [line.split() for line in text.splitlines() if line and line[0] != "#"]
  body = "".join(f"{n} {role} 1 {uri} -\n" for n, role, uri in rows).encode()
  header = (
    f"# Sphinx inventory version 2\n# Project: {name}\n# Version: latest\n"
    "# The remainder of this file is compressed using zlib.\n"
  ).encode()
  digest = hashlib.sha256(body).hexdigest()[:16]
  path = (
    pathlib.Path(tempfile.gettempdir()) / f"gradcomp-intersphinx-{name}-{digest}.inv"
  )
  if not path.exists():  # written whole, then renamed: parallel builds share it
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_bytes(header + zlib.compress(body))
    os.replace(partial, path)
  return str(path)


intersphinx_mapping = {
  name: (url, _inventory(name)) for name, url in _INTERSPHINX.items()
}
