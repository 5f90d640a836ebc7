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


def test_readme_fp8_recipes_train_and_agree(capsys):
    """The three recipes on the trained MLP: each FP8 loss within FP8 accuracy of the
    float32 one, and delayed scaling trained it (the first loss is about 0.4)."""
    section = re.search(r"## FP8 recipes\n.*?```python\n(.*?)```", README.read_text(), re.S)
    namespace: dict = {}
    exec(compile(section.group(1), str(README), "exec"), namespace)
    trained, current, block, exact = (float(v) for v in capsys.readouterr().out.split())
    assert exact < 0.1, exact
    for fp8 in (trained, current, block):
        assert abs(fp8 - exact) < 0.1 * exact, (fp8, exact)  # E4M3: 2^-4 relative per operand
    history = namespace["fp8_state"]["000:dot_general"]
    assert float(history.lhs[0]) == float(np.max(np.abs(np.asarray(namespace["x"]))))
