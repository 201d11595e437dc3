"""The README's code runs as written."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of Markdown ``text``, in order."""
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def nnx_example() -> str:
    """The README's Flax NNX example: the first Python block of its NNX section."""
    sections = re.split(r"^## ", README.read_text(), flags=re.M)
    nnx = [s for s in sections if s.splitlines()[0].rstrip().endswith("NNX model")]
    assert len(nnx) == 1, "the README has one section on a Flax NNX model"
    blocks = python_blocks(nnx[0])
    assert blocks, "the README's NNX section has a Python example"
    return blocks[0]


def test_readme_python_example_runs(capsys):
    blocks = python_blocks(README.read_text())
    assert blocks, "the README has a Python example"
    assert blocks[0] == nnx_example()
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    assert namespace["rows"].shape == (1_000_000, 16)
    stats = namespace["model"].embed.cache.stats
    assert stats.steps == 100 and stats.total.rows_to_device > 0
    assert "hit_rate" in capsys.readouterr().out
