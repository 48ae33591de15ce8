"""Sphinx configuration: MyST Markdown pages, the click group's reference, autodoc of the public API.

Build with ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (warnings are errors;
``nitpicky`` makes every unresolved cross-reference one).
"""

from __future__ import annotations

import sys
from pathlib import Path

# The package from this checkout, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import energon_ordering  # noqa: E402

project = "energon-ordering"
author = "energon-ordering contributors"
release = version = energon_ordering.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx_click",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]
html_theme = "furo"
html_title = f"energon-ordering {release}"

# MyST: heading anchors so that [text](page.md#a-heading) is checked at build time.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

# Google-style docstrings (STYLE.md); the public API is documented as energon_ordering.<Name>.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}

# nitpicky: a reference to a public name (energon_ordering.__all__, documented in api.md) must
# resolve. The package's docstrings also cite internal modules and helpers, the libraries it
# builds on and the standard library, which these pages do not document (and no intersphinx: the
# build runs offline): those references are not checked. Page links ([text](page.md#anchor))
# are always checked by MyST.
_PUBLIC = "|".join(name for name in energon_ordering.__all__ if not name.startswith("_"))
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", rf"(?!(energon_ordering\.)?({_PUBLIC})$).*")]


def _property_summary_is_not_a_type(app, what, name, obj, options, lines) -> None:
    """Keeps a property's first line whole under napoleon.

    Google style reads ``Type: description`` on an attribute's first line; the package's
    properties start with a sentence that may hold a colon ("True if a sample pool ramps: ...").
    Runs before napoleon (priority 400) and turns such a colon into a dash.
    """
    if what not in ("property", "attribute") or not lines:
        return
    head, colon, rest = lines[0].partition(": ")
    if colon and " " in head.strip() and "`" not in head:
        lines[0] = f"{head} - {rest}"


def setup(app):  # noqa: D103
    app.connect("autodoc-process-docstring", _property_summary_is_not_a_type, priority=400)
