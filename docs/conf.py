"""Sphinx configuration of the jaxcache documentation.

Build with ``python -m sphinx -W -b html docs docs/_build/html``. Pages written
as MyST notebooks are executed on every build, so a page whose code stops
working (or whose checks fail) fails the build.

The API reference is generated from ``__all__`` of the public modules: a name
added to ``__all__`` appears in ``api.md`` without editing the page, and a
public module that is not importable yet is left out.
"""

from __future__ import annotations

import importlib
import inspect
import sys

from flax import linen
from sphinx.pycode import ModuleAnalyzer
from sphinx.util.inspect import stringify_signature

import jaxcache

project = "jaxcache"
author = "The jaxcache authors"
copyright = "The jaxcache authors"
release = jaxcache.__version__
version = release

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

exclude_patterns = ["_build", "jupyter_execute", "**.ipynb_checkpoints"]

# -- MyST and notebook execution ---------------------------------------------
myst_heading_anchors = 3
# "force" rather than "cache": a cache keyed on the page's code would keep
# serving old outputs after the library changes, and the checks on the pages
# are there to catch exactly that.
nb_execution_mode = "force"
nb_execution_timeout = 300
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True
# A warning printed by a page's code is a problem to fix, not an output to show.
nb_output_stderr = "warn"

# -- autodoc and napoleon ----------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Defaults as written in the source (``wrt=nnx.Param``), not their repr.
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Docstrings name what an attribute holds ("int32 [U] slot of ..."); the raw
# annotations would add private paths such as jax.jaxlib._jax.Array.
napoleon_attr_annotations = False
# Returns sections read "``(state, lookup)``: what they are"; keep them one sentence.
napoleon_use_rtype = False

# -- HTML --------------------------------------------------------------------
html_theme = "alabaster"
html_title = f"jaxcache {release}"
html_theme_options = {
    "description": "Host-offloaded embedding tables for JAX and Flax",
    "fixed_sidebar": True,
    "page_width": "1100px",
    "sidebar_width": "240px",
}
html_sidebars = {"**": ["about.html", "navigation.html", "searchbox.html"]}

# -- API reference generated from __all__ ------------------------------------
# tests/test_docs.py reads this tuple from the file, so it stays a literal.
PUBLIC_MODULES = (
    "jaxcache",
    "jaxcache.nnx",
    "jaxcache.linen",
    "jaxcache.device",
    "jaxcache.host",
    "jaxcache.optimizers",
    "jaxcache.pipeline",
    "jaxcache.checkpoint",
    "jaxcache.stats",
    "jaxcache.planning",
    "jaxcache.sizing",
    "jaxcache.testing",
    "jaxcache.synthetic",
    "jaxcache.models",
    "jaxcache.datasets",
)
API_DOCNAME = "api"
API_MARKER = "<!-- generated: public API -->"


def _import_public(name: str):
    """The module ``name``, or ``None`` when it does not exist (yet)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise  # the module exists but one of its imports is broken
        return None


def _directive(obj: object) -> str | None:
    """The autodoc directive that documents ``obj`` (``None`` for a module)."""
    if inspect.ismodule(obj):
        return None  # public submodules get their own section
    if inspect.isclass(obj):
        return "autoexception" if issubclass(obj, BaseException) else "autoclass"
    if callable(obj):
        return "autofunction"
    return "autodata"


def _defined_in(public: str, attr: str, obj: object) -> str:
    """The module that defines ``obj``, exported as ``public.attr``.

    Classes and functions know it; a constant does not, so it is the package
    module (other than ``public``) that holds the same object under the name.
    """
    module_name = getattr(obj, "__module__", None)
    if isinstance(module_name, str) and (inspect.isclass(obj) or callable(obj)):
        return module_name
    package = public.split(".", 1)[0]
    for name, module in sorted(sys.modules.items()):
        if name != public and name.startswith(package + ".") and getattr(module, attr, None) is obj:
            return name
    return public


def _group_title(module_name: str) -> tuple[str, str]:
    """Heading and summary of the private module that defines a group of names."""
    short = module_name.rsplit(".", 1)[-1].replace("_", " ")
    doc = inspect.getdoc(sys.modules[module_name]) or ""
    return short[:1].upper() + short[1:], doc.split("\n\n", 1)[0].replace("\n", " ")


def public_api_markdown() -> str:
    """MyST source documenting every name in ``__all__`` of ``PUBLIC_MODULES``.

    Names are grouped by the module that defines them, in the order the
    public module imports them.
    """
    sections = []
    for name in PUBLIC_MODULES:
        module = _import_public(name)
        if module is None:
            continue
        exported = set(module.__all__)
        groups: dict[str, list[str]] = {}
        # vars() keeps import order, which follows the concepts of the package.
        for attr, obj in vars(module).items():
            if attr in exported and _directive(obj) is not None:
                groups.setdefault(_defined_in(name, attr, obj), []).append(attr)

        # autodoc writes reStructuredText, so its directives go in eval-rst blocks.
        lines = [f"## `{name}`", "", "```{eval-rst}", f".. automodule:: {name}", "```", ""]
        for defined_in, attrs in groups.items():
            if len(groups) > 1:
                title, summary = _group_title(defined_in)
                lines += [f"### {title}", "", summary, ""]
            for attr in attrs:
                obj = getattr(module, attr)
                directive = _directive(obj)
                lines += ["```{eval-rst}", f".. {directive}:: {name}.{attr}"]
                if inspect.isclass(obj):
                    lines += ["   :members:"]
                    if obj.__bases__ != (object,):
                        lines += ["   :show-inheritance:"]
                lines += ["```", ""]
        sections.append("\n".join(lines))
    return "\n".join(sections)


def _insert_public_api(app, docname: str, source: list[str]) -> None:
    if docname == API_DOCNAME:
        if API_MARKER not in source[0]:
            raise RuntimeError(f"{docname}.md lost the line {API_MARKER!r}; put it back.")
        source[0] = source[0].replace(API_MARKER, public_api_markdown())


def _reread_api(app, env, added, changed, removed) -> list[str]:
    # The page's text does not change when __all__ does: always rebuild it.
    return [API_DOCNAME]


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
    # NamedTuple fields are documented in the class's "Attributes" section.
    if what == "class" and (getattr(obj, "__doc__", None) or "").startswith(
        "Alias for field number"
    ):
        return True
    return None


def _document_constant(app, what, name, obj, options, lines) -> None:
    # A constant has no docstring of its own (autodoc would show its type's);
    # use the "#:" comment above its assignment in the defining module.
    if what != "data":
        return
    public, attr = name.rsplit(".", 1)
    defined_in = _defined_in(public, attr, obj)
    comment = ModuleAnalyzer.for_module(defined_in).find_attr_docs().get(("", attr), [])
    lines[:] = list(comment)


def _class_signature(app, what, name, obj, options, signature, return_annotation):
    """The constructor signature users call, for Flax modules and variables.

    NNX metaclasses hide ``__init__`` behind their ``__call__(*args,
    **kwargs)``; Linen modules add a ``parent`` field that Flax sets itself.
    """
    if what != "class" or signature is None:
        return None
    if getattr(obj, "_is_protocol", False):
        return "", return_annotation  # a protocol is implemented, never constructed
    if signature.startswith("(*args"):
        init = inspect.signature(obj.__init__)
        params = list(init.parameters.values())[1:]
    elif issubclass(obj, linen.Module):
        init = inspect.signature(obj)
        params = [p for p in init.parameters.values() if p.name != "parent"]
    else:
        return None
    return stringify_signature(
        init.replace(parameters=params), show_return_annotation=False, unqualified_typehints=True
    ), return_annotation


def setup(app) -> dict[str, object]:
    app.connect("source-read", _insert_public_api)
    app.connect("env-get-outdated", _reread_api)
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)
    app.connect("autodoc-process-docstring", _document_constant)
    app.connect("autodoc-process-signature", _class_signature)
    return {"parallel_read_safe": True}
