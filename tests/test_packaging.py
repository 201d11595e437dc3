"""How jaxcache installs: the datasets extra."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
