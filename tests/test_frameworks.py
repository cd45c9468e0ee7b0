"""docs/guides/frameworks.md ("Your framework"): every code block runs as it is (8 CPU devices,
conftest), and each framework has its section."""

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "frameworks.md"


def _blocks() -> dict[str, str]:
  """{heading: code} for the ```python block under each '## ' heading of the page."""
  text = PAGE.read_text()
  blocks = {}
  for part in text.split("\n## ")[1:]:
    heading = part.splitlines()[0].strip()
    code = re.findall(r"```python\n(.*?)```", part, re.S)
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
