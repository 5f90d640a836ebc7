"""The README's quickstart runs as written and trains."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_quickstart_runs_and_learns(capsys):
    code = re.search(r"## Quickstart\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    loss = float(np.asarray(namespace["js"].asarray(namespace["loss"])))
    assert np.isfinite(loss) and loss < 1.0, loss  # log(10) = 2.3 at the start
    assert len(code.strip().splitlines()) <= 30


def test_readme_nonfinite_section_skips_the_bad_step(capsys):
    section = re.search(r"## Non-finite steps\n.*?```python\n(.*?)```", README.read_text(), re.S)
    exec(compile(section.group(1), str(README), "exec"), {})
    assert capsys.readouterr().out.split() == ["1", "True", "dot_general"]
