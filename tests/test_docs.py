"""The documentation does not rot: the site builds with ``mkdocs build --strict`` (warnings
are errors: a broken link, a missing figure, a docstring mkdocstrings cannot render), and
every ```python block of README.md and docs/**/*.md runs.

The blocks of one page run in order in one fresh interpreter (8 virtual CPU devices, cwd a
temporary directory, ``/tmp/`` in a block rewritten to a temporary directory), so a page reads
as a tutorial: a block may use what an earlier block of the same page made. A block that
cannot run on one machine (several processes, an object store) is preceded by
``<!-- skip: REASON -->``; those are counted and reported, and must stay few."""

import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
SKIP = re.compile(r"<!--\s*skip:\s*(.*?)\s*-->\s*$")
MAX_SKIPPED = 4
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "NO_MKDOCS_2_WARNING": "1",
       "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
       # the blocks run in temp dirs: a relative PYTHONPATH (PYTHONPATH=.) made absolute
       "PYTHONPATH": os.pathsep.join(
           str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
           if p)}


def blocks(page: Path):
  """[(line, code, skip reason or None)] of the page's ```python blocks, in order."""
  text = page.read_text()
  found = []
  for m in FENCE.finditer(text):
    line = text.count("\n", 0, m.start()) + 1
    before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
    reason = SKIP.search(before)
    found.append((line, m.group(1), reason.group(1) if reason else None))
  return found


def name(page: Path) -> str:
  return str(page.relative_to(ROOT))


RUNNABLE = [p for p in PAGES if any(r is None for _, _, r in blocks(p))]
SKIPPED = [(name(p), line, r) for p in PAGES for line, _, r in blocks(p) if r is not None]

RUNNER = textwrap.dedent("""
  import sys, json
  blocks = json.load(open(sys.argv[1]))
  scope = {"__name__": "__main__"}
  for where, code in blocks:
    print(f"--- {where}", flush=True)
    exec(compile(code, where, "exec"), scope)
""")


def test_site_builds_strict(tmp_path):
  r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--clean",
                      "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                     capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
  assert r.returncode == 0, r.stdout + r.stderr
  assert (tmp_path / "site" / "api" / "index.html").exists()
  api = (tmp_path / "site" / "api" / "index.html").read_text()
  import fnckpt
  for public in fnckpt.__all__:  # every public name has its entry in the reference
    assert f'id="fnckpt.{public}"' in api, public


def test_readme_links_resolve():
  """README.md is outside the site (GitHub renders it): its relative links must name files."""
  text = (ROOT / "README.md").read_text()
  links = re.findall(r"\]\(([^)\s]+)\)", text)
  local = [link.split("#")[0] for link in links if not re.match(r"[a-z]+:", link)]
  assert local, "the README links into docs/"
  missing = [link for link in local if link and not (ROOT / link).is_file()]
  assert not missing, missing


def test_skipped_blocks_are_marked_and_few():
  report = "; ".join(f"{page}:{line} ({reason})" for page, line, reason in SKIPPED)
  warnings.warn(f"{len(SKIPPED)} python block(s) of the docs not run: {report}", UserWarning)
  assert len(SKIPPED) <= MAX_SKIPPED, report
  assert RUNNABLE, "no python blocks found"


@pytest.mark.parametrize("page", RUNNABLE, ids=name)
def test_page_code_runs(page, tmp_path):
  import json
  scratch = tmp_path / "tmp"
  scratch.mkdir()
  todo = [(f"{name(page)}:{line}", code.replace('"/tmp/', f'"{scratch}/'))
          for line, code, reason in blocks(page) if reason is None]
  (tmp_path / "blocks.json").write_text(json.dumps(todo))
  (tmp_path / "runner.py").write_text(RUNNER)
  work = tmp_path / "cwd"
  work.mkdir()
  r = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json")],
                     capture_output=True, text=True, env=ENV, cwd=work, timeout=300)
  assert r.returncode == 0, f"{name(page)}: a block failed\n{r.stdout}\n{r.stderr}"


# --- read as a new user would: short blocks, code that fits (issue 35) ------------------------

MAX_WORDS = 150  # a paragraph or list item longer than this is a wall of text
MAX_COLUMNS = 88  # a code line longer than this does not fit the page's code box at 1280 px
TASK_PAGES = [ROOT / "docs" / "getting-started.md", *sorted((ROOT / "docs" / "concepts").glob(
  "*.md")), *sorted((ROOT / "docs" / "guides").glob("*.md"))]
ANY_FENCE = re.compile(r"^(\s*)(```|~~~)[^\n]*\n(.*?)^\1\2[ \t]*$", re.S | re.M)


def long_blocks(page: Path) -> list[tuple[int, str]]:
  """[(words, first words)] of the page's paragraphs and list items over MAX_WORDS words (a
  list item's words are its own, without those of a list nested in it)."""
  import html.parser

  import markdown

  body = markdown.markdown(page.read_text(), extensions=[
    "admonition", "attr_list", "md_in_html", "tables", "pymdownx.superfences"])

  class Blocks(html.parser.HTMLParser):
    def __init__(self):
      super().__init__()
      self.open: list[str] = []  # the open p / li elements (a p inside a li is the li's)
      self.stack: list[list[str]] = []  # their text
      self.skip = 0  # inside <pre>: code is measured by columns, not words
      self.found: list[tuple[int, str]] = []

    def handle_starttag(self, tag, attrs):
      if tag == "pre":
        self.skip += 1
      elif tag == "li" or (tag == "p" and not (self.open and self.open[-1] == "li")):
        self.stack.append([])
        self.open.append(tag)

    def handle_endtag(self, tag):
      if tag == "pre":
        self.skip -= 1
      elif tag in ("p", "li") and self.open and self.open[-1] == tag:
        self.open.pop()
        words = " ".join(self.stack.pop()).split()
        if len(words) > MAX_WORDS:
          self.found.append((len(words), " ".join(words[:8])))

    def handle_data(self, data):
      if self.stack and not self.skip:
        self.stack[-1].append(data)

  parser = Blocks()
  parser.feed(body)
  return parser.found


def wide_code_lines(page: Path) -> list[tuple[int, int]]:
  """[(line number, columns)] of the page's fenced code lines over MAX_COLUMNS columns."""
  text = page.read_text()
  out = []
  for m in ANY_FENCE.finditer(text):
    first = text.count("\n", 0, m.start(3)) + 1
    for i, line in enumerate(m.group(3).split("\n")):
      if len(line) > MAX_COLUMNS:
        out.append((first + i, len(line)))
  return out


@pytest.mark.parametrize("page", TASK_PAGES, ids=name)
def test_no_wall_of_text(page):
  found = long_blocks(page)
  assert not found, (f"{name(page)}: paragraphs or list items over {MAX_WORDS} words "
                     f"(expected none): " + "; ".join(f"{n} words: {w}..." for n, w in found))


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_code_lines_fit(page):
  found = wide_code_lines(page)
  assert not found, (f"{name(page)}: code lines over {MAX_COLUMNS} columns (expected none): "
                     + ", ".join(f"line {line} ({cols} columns)" for line, cols in found))


# --- guides follow one template (issue 35) --------------------------------------------------
# A guide opens with what it is for (a paragraph right under its title), shows a runnable
# example within its first OPENING_LINES lines, and has an "Options" section (a table of the
# options of the function it is about).

GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
OPENING_LINES = 30
# Guides not on the template yet: skipped, and reported as such (none today). Take a page off
# this list once it follows it.
NOT_ON_TEMPLATE_YET: dict[str, str] = {}
FENCE_OPEN = re.compile(r"^\s*(```|~~~)")
NOT_PROSE = re.compile(r"^\s*(#|```|~~~|[-*+] |\d+\. |\||<|>|!\[|\s*$)")


def template_problems(text: str) -> list[str]:
  """What keeps a guide's markdown ``text`` off the template (empty: it follows it)."""
  lines = text.split("\n")
  problems = []
  if not lines[0].startswith("# "):
    problems.append("the first line is not the page's '# ' title")
  first = next((line for line in lines[1:] if line.strip()), "")
  if NOT_PROSE.match(first):
    problems.append(f"it opens with {first.strip()[:40]!r}, not a paragraph saying what "
                    "the guide is for")
  fences = [i for i, line in enumerate(lines, 1) if FENCE_OPEN.match(line)]
  if not fences or fences[0] > OPENING_LINES:
    problems.append(f"no code block starts within its first {OPENING_LINES} lines")
  # headings outside code blocks (a '# comment' inside a block is not one)
  prose = re.sub(r"^(\s*)(```|~~~).*?^\1\2[ \t]*$", "", text, flags=re.S | re.M)
  if not re.search(r"^## .*options", prose, re.I | re.M):
    problems.append("no '## ...Options...' section")
  return problems


@pytest.mark.parametrize("page", [
  pytest.param(p, marks=pytest.mark.skip(reason=f"not on the guide template yet: "
                                               f"{NOT_ON_TEMPLATE_YET[p.name]}"))
  if p.name in NOT_ON_TEMPLATE_YET else p for p in GUIDES], ids=name)
def test_guide_follows_the_template(page):
  problems = template_problems(page.read_text())
  assert not problems, f"{name(page)} does not follow the guide template: " + "; ".join(
    problems)


def test_guide_template_allow_list_names_guides():
  assert set(NOT_ON_TEMPLATE_YET) <= {p.name for p in GUIDES}, NOT_ON_TEMPLATE_YET


@pytest.mark.parametrize("text, expected", [
  ("# T\n\nWhat it is for.\n\n```python\nx = 1\n```\n\n## Options\n", []),
  ("# T\n\n## Usage\n\n```python\nx = 1\n```\n\n## Options\n", ["not a paragraph"]),
  ("# T\n\n- a list first\n\n```python\nx = 1\n```\n\n## Options\n", ["not a paragraph"]),
  ("# T\n\nFor.\n" + "\nmore prose\n" * 15 + "```python\nx = 1\n```\n\n## Options\n",
   ["first 30 lines"]),
  ("# T\n\nFor.\n\n```python\n## Options\n```\n\n## Usage\n", ["Options"]),
  ("Title\n\nFor.\n\n```python\nx = 1\n```\n\n## Options and defaults\n", ["title"]),
])
def test_guide_template_check_catches_bad_pages(text, expected):
  problems = template_problems(text)
  assert len(problems) == len(expected), problems
  for problem, words in zip(problems, expected):
    assert words in problem, problems
