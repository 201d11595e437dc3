"""How jaxcache installs: the wheel, its console script and the datasets extra."""

from __future__ import annotations

import email.parser
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest
from packaging.requirements import Requirement

from tests.test_readme import nnx_example

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Everything a wheel is built from. The build writes build/ and *.egg-info
# beside them, so it runs on a copy and the checkout stays as it was.
WHEEL_SOURCES = ("pyproject.toml", "README.md", "jaxcache")


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, **kwargs)
    assert out.returncode == 0, f"{' '.join(argv)} failed:\n{out.stdout}\n{out.stderr}"
    return out


def test_datasets_without_tensorflow_datasets_says_which_extra():
    script = """
        import sys

        sys.modules["tensorflow_datasets"] = None  # as if it were not installed
        import jaxcache
        import jaxcache._src.cli

        try:
            import jaxcache.datasets
        except ImportError as error:
            print(error)
        else:
            raise SystemExit("jaxcache.datasets imported without tensorflow_datasets")
    """
    # `python -c` in the checkout imports the checkout's jaxcache.
    out = _run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT)
    message = out.stdout.strip()
    assert "tensorflow-datasets" in message
    assert 'pip install "jaxcache[datasets]"' in message


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """A wheel of the checkout, built without isolation (nothing downloaded)."""
    work = tmp_path_factory.mktemp("wheel")
    source, dist = work / "src", work / "dist"
    source.mkdir()
    for name in WHEEL_SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy2(ROOT / name, source / name)
    _run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)],
        cwd=source,
    )
    (built,) = dist.glob("jaxcache-*.whl")
    return built


def test_wheel_holds_every_module_and_the_metadata(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (info,) = {name.split("/")[0] for name in names if ".dist-info/" in name}
        metadata = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    package = {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "jaxcache").rglob("*")
        if path.is_file() and (path.suffix == ".py" or path.name == "py.typed")
    }
    assert {"jaxcache/datasets/__init__.py", "jaxcache/py.typed"} <= package
    assert package - names == set(), "files of the package missing from the wheel"
    assert {name.split("/")[0] for name in names} == {"jaxcache", info}
    assert "jaxcache = jaxcache._src.cli:main" in entry_points

    requires = [Requirement(r) for r in metadata.get_all("Requires-Dist")]
    always = {r.name for r in requires if r.marker is None}

    def extra(name: str) -> set[str]:
        return {r.name for r in requires if r.marker and r.marker.evaluate({"extra": name})}

    assert {"jax", "jaxlib", "flax", "optax", "numpy", "numba", "orbax-checkpoint"} <= always
    assert not always & {"tensorflow-datasets", "importlib_resources", "tqdm"}
    assert {"tensorflow-datasets", "importlib_resources"} <= extra("datasets")
    assert "tqdm" in extra("examples")
    assert {"mypy", "build", "setuptools"} <= extra("test")


def test_wheel_installs_and_runs_the_readme_example(wheel, tmp_path):
    """The wheel in a fresh virtual environment that borrows the dependencies.

    The environment sees this one's site-packages through a ``.pth`` line, so
    nothing is downloaded. A line only adds the directory to ``sys.path``; the
    ``.pth`` files inside it (an editable install's finder among them) are not
    run, so ``import jaxcache`` can only find the wheel's copy.
    """
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = str(venv / "bin" / "python")
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    site = pathlib.Path(purelib.stdout.strip()).resolve()
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # Nothing may lead Python to the checkout.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    pip = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    _run([*pip, "--ignore-installed", str(wheel)], cwd=tmp_path, env=env)

    usage = _run([str(venv / "bin" / "jaxcache"), "--help"], cwd=tmp_path, env=env).stdout
    assert "replay" in usage

    (tmp_path / "readme_nnx.py").write_text(nnx_example())
    check = """
        import importlib.metadata, json, runpy, sys

        namespace = runpy.run_path("readme_nnx.py")
        print(json.dumps({
            "version": importlib.metadata.version("jaxcache"),
            "files": [m.__file__ for k, m in sys.modules.items() if k.split(".")[0] == "jaxcache"],
            "rows": list(namespace["rows"].shape),
            "steps": namespace["model"].embed.cache.stats.steps,
        }))
    """
    (tmp_path / "check.py").write_text(textwrap.dedent(check))
    out = _run([python, "check.py"], cwd=tmp_path, env=env)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert any(f.endswith("jaxcache/__init__.py") for f in result["files"])
    outside = [f for f in result["files"] if not pathlib.Path(f).resolve().is_relative_to(site)]
    assert not outside, f"jaxcache imported from outside the fresh environment: {outside}"
    assert result["version"] == wheel.name.split("-")[1]
    assert result["rows"] == [1_000_000, 16] and result["steps"] == 100
