"""README "Your framework": every code block runs as it is (8 CPU devices, conftest)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks() -> dict[str, str]:
  """{heading: code} for the ```python blocks under '## Your framework'."""
  text = README.read_text()
  section = text.split("\n## Your framework\n", 1)[1].split("\n## ", 1)[0]
  blocks = {}
  for part in section.split("\n### ")[1:]:
    heading = part.splitlines()[0].strip()
    code = re.findall(r"```python\n(.*?)```", part, re.S)
    assert len(code) == 1, f"{heading}: one python block expected, found {len(code)}"
    blocks[heading] = code[0]
  return blocks


BLOCKS = _blocks()


def test_every_framework_has_its_section():
  assert set(BLOCKS) == {"Flax NNX", "Flax linen `TrainState`", "Equinox", "Optax", "Grain"}


@pytest.mark.parametrize("heading", sorted(BLOCKS))
def test_readme_block_runs(heading, capsys):
  exec(compile(BLOCKS[heading], f"README.md ({heading})", "exec"), {"__name__": "readme"})
  out = capsys.readouterr().out
  if heading == "Equinox":  # the whole model is refused, naming the function leaves
    assert "Unsupported leaf at .activation: " in out
    assert "eqx.partition(model, eqx.is_array)[0]" in out
