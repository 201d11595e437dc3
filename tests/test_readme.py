"""The README's code runs as written."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has a Python example"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    assert namespace["rows"].shape == (1_000_000, 16)
    stats = namespace["model"].embed.cache.stats
    assert stats.steps == 100 and stats.total.rows_to_device > 0
    assert "hit_rate" in capsys.readouterr().out
