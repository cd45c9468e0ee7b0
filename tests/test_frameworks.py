"""docs/guides/frameworks.md ("Your framework"): every code block runs as it is (8 CPU devices,
conftest), and each framework has its section."""

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "frameworks.md"


def _blocks() -> dict[str, str]:
  """{framework: code}: the page's opening block is Flax NNX's (the guide's first example);
  each '### ' heading (under '## Other frameworks') has one ```python block."""
  text = PAGE.read_text()
  opening = re.findall(r"```python\n(.*?)```", text.split("\n## ")[0], re.S)
  assert len(opening) == 1, f"one python block before the first section, found {len(opening)}"
  blocks = {"Flax NNX": opening[0]}
  for part in text.split("\n### ")[1:]:
    heading = part.splitlines()[0].strip()
    code = re.findall(r"```python\n(.*?)```", part.split("\n## ")[0], re.S)
    assert len(code) == 1, f"{heading}: one python block expected, found {len(code)}"
    blocks[heading] = code[0]
  return blocks


BLOCKS = _blocks()


def test_every_framework_has_its_section():
  assert set(BLOCKS) == {"Flax NNX", "Flax linen `TrainState`", "Equinox", "Optax", "Grain"}


@pytest.mark.parametrize("heading", sorted(BLOCKS))
def test_docs_block_runs(heading, capsys):
  exec(compile(BLOCKS[heading], f"docs/guides/frameworks.md ({heading})", "exec"), {"__name__": "docs"})
  out = capsys.readouterr().out
  if heading == "Equinox":  # the whole model is refused, naming the function leaves
    assert "Unsupported leaf at .activation: " in out
    assert "eqx.partition(model, eqx.is_array)[0]" in out
