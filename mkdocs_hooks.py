"""MkDocs hook: render fnckpt's docstrings, written for ``help()`` and Sphinx, as Markdown.

The docstrings hold doctests (``>>> ...`` lines and their output) in running text, where
Markdown would read ``>`` as a quote and ``x[-1]`` as a link, and Sphinx roles
(``:func:`fnckpt.wait```). This adds a Markdown preprocessor that, outside existing fences,
fences each doctest (from a ``>>>`` line to the next blank line) as a ``pycon`` block and
turns each role into inline code. The pages' own code is always fenced already."""

import re

from markdown import Extension
from markdown.preprocessors import Preprocessor

_FENCE = re.compile(r"^\s*(```|~~~)")
_PROMPT = re.compile(r"^(\s*)>>> ")
_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`~?([^`]+)`")


class _Doctests(Preprocessor):
  def run(self, lines):
    out, fence, i = [], False, 0
    while i < len(lines):
      line = lines[i]
      if _FENCE.match(line):
        fence = not fence
      m = None if fence else _PROMPT.match(line)
      if not m:
        out.append(line if fence else _ROLE.sub(r"`\1`", line))
        i += 1
        continue
      indent = m.group(1)
      block = []
      while i < len(lines) and lines[i].strip():
        block.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
        i += 1
      out += ["", indent + "```pycon", *(indent + b for b in block), indent + "```", ""]
    return out


class DoctestFences(Extension):
  def extendMarkdown(self, md):
    md.preprocessors.register(_Doctests(md), "fnckpt_doctests", 40)


def on_config(config):
  # the same list object mkdocstrings was given, so docstrings get it too
  config.markdown_extensions.append(DoctestFences())
  return config
