"""Sphinx configuration of gradcomp's documentation site.

Sphinx rather than MkDocs: autodoc + napoleon render the Google-style
docstrings (``Args:``, ``Returns:``, ``References:``) and their ``.. math::``
blocks as they are written, autosummary gives every public name a page, and
MyST lets the guides stay Markdown. Built with warnings as errors by ``make
docs`` and by ``tests/test_docs.py``; the examples run as doctests under pytest
(``--doctest-modules`` for docstrings, Sybil for the pages; ``conftest.py``).
"""

import os

# The API pages import gradcomp; one CPU device is enough to render them.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "gradcomp"
author = "the gradcomp developers"
copyright = "2026, the gradcomp developers"

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.autosummary",
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
