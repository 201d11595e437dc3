"""The documentation: the Sphinx build with executed pages, and runnable docstrings."""

import ast
import html
import importlib
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def _public_modules() -> tuple[str, ...]:
    """``PUBLIC_MODULES`` of docs/conf.py, the modules the API reference documents.

    Read from the file rather than imported, so this test needs no Sphinx.
    """
    for node in ast.parse((DOCS / "conf.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "PUBLIC_MODULES"
            for target in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError("docs/conf.py no longer assigns PUBLIC_MODULES")


PUBLIC_MODULES = _public_modules()

# Public names whose docstring has no example yet (none: keep it that way).
EXAMPLES_TO_WRITE: set[str] = set()


def _documented_objects():
    """``(qualified name, object)`` of every public class and function."""
    for module_name in PUBLIC_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue
        for name in module.__all__:
            obj = getattr(module, name)
            # Submodules are documented through their own names, and plain
            # constants (POLICIES, COLLECTION) through a comment, not a docstring.
            if inspect.isclass(obj) or (callable(obj) and not inspect.ismodule(obj)):
                yield f"{module_name}.{name}", obj


def _own_docstring(obj) -> str:
    # A class's own docstring: inspect.getdoc would fall back to a base class's.
    doc = vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__
    return doc or ""


@pytest.mark.parametrize(
    ("name", "obj"),
    [
        pytest.param(
            name,
            obj,
            id=name,
            marks=[pytest.mark.xfail(reason="no example yet", strict=True)]
            if name in EXAMPLES_TO_WRITE
            else [],
        )
        for name, obj in _documented_objects()
    ],
)
def test_public_docstring_has_an_example(name, obj):
    doc = _own_docstring(obj)
    assert ">>>" in doc, f"{name}'s docstring needs an Examples section with a >>> example."


def _text(page: pathlib.Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


@pytest.mark.slow
def test_sphinx_build_executes_the_pages(tmp_path):
    out = tmp_path / "html"  # executed notebooks go next to it, in tmp_path
    # The pages' kernels share a compilation cache of their own: one kernel
    # runs at a time, so none reads an entry while another process writes
    # it (that read would print a warning, an error under -W).
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla")}
    result = subprocess.run(
        # -T prints the full traceback, including a failing cell's error.
        [sys.executable, "-m", "sphinx", "-T", "-W", "-b", "html", str(DOCS), str(out)],
        capture_output=True,
        text=True,
        env=env,
        # A guard against a hang, not a speed check: the build took 166 s
        # beside the other test worker on a slow day of a 2-core machine.
        timeout=900,
    )
    assert result.returncode == 0, re.sub(r"\x1b\[[0-9;]*m", "", result.stderr)

    # Outputs exist only if the cells ran; in the source the f-strings are
    # split by highlighting, so these patterns only match the outputs.
    started = _text(out / "getting_started.html")
    assert re.search(r"hit rate per batch: \d+\.\d% \(first 10 steps\)", started)
    assert re.search(r"rows \(5000, 8\): max abs difference \d\.\d\de[-+]\d\d", started)
    assert "CapacityError: the batch has 251 distinct ids" in started

    # Every plot was drawn, and the pages' checks printed their results.
    for page, plots in {"why_cache": 2, "getting_started": 1, "sizing": 1, "pipeline": 1}.items():
        images = re.findall(
            r'<img [^>]*src="_images/[^"]+\.png"', (out / f"{page}.html").read_text()
        )
        assert len(images) >= plots, f"{page}.html shows {len(images)} plots, expected {plots}"
    assert re.search(r"cache statistics == replay, over \d+ batches", _text(out / "sizing.html"))
    assert "evaluated every 5: the same losses" in _text(out / "pipeline.html")
    assert re.search(r"table: max abs difference \d\.\d\de[-+]\d\d", _text(out / "linen.html"))
    assert "CapacityError: the batch has 9 distinct ids" in _text(out / "faq.html")

    api = (out / "api.html").read_text()
    for name, _ in _documented_objects():
        assert f'id="{name}"' in api, f"{name} is missing from the API reference"
