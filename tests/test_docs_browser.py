"""The documentation site as a reader sees it: built (``mkdocs build --strict``), served on
127.0.0.1 and every page opened in headless Chromium at 1280 px, in one browser. On each page:
no console error, no broken image, no failed request, no request to any host but the site's
own (an air-gapped cluster must see the same site), and no code block wider than its box. A
full-page screenshot of each page is written under the test's temporary directory (or under
``$FNCKPT_DOCS_SCREENSHOTS``).

It needs Debian's ``chromium`` (``/usr/bin/chromium``, or ``$FNCKPT_CHROMIUM``) and the
``playwright`` Python package (the ``browser`` extra; it never downloads a browser of its
own). Without them the test is skipped with the reason, unless ``FNCKPT_REQUIRE_BROWSER=1``
(CI's setting, ``.ci/run``), where it fails instead.

``python tests/test_docs_browser.py`` prints the same findings page by page without
asserting (how the figures in issue 35's note were measured)."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.parse
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WIDTH, HEIGHT = 1280, 900
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage"]

# every <pre><code> (highlighted blocks and the API reference's signatures) whose content is
# wider than its box: a reader would have to scroll it sideways
WIDE_CODE_JS = """() => [...document.querySelectorAll('pre > code')]
  .filter(c => c.offsetParent !== null && c.scrollWidth > c.clientWidth + 1)
  .map(c => ({text: c.innerText.split('\\n').reduce((a, b) => b.length > a.length ? b : a, ''),
              scroll: c.scrollWidth, client: c.clientWidth}))"""
BROKEN_IMAGES_JS = """() => [...document.images]
  .filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src)"""


def chromium() -> str | None:
  path = os.environ.get("FNCKPT_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
  return path if os.access(path, os.X_OK) else None


def missing() -> str | None:
  """Why the browser check cannot run here, or None."""
  if importlib.util.find_spec("playwright") is None:
    return "the playwright package is not installed (pip install -e '.[browser]')"
  if chromium() is None:
    return "no Chromium at /usr/bin/chromium (apt-get install chromium) nor $FNCKPT_CHROMIUM"
  return None


def build(site: Path) -> None:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "NO_MKDOCS_2_WARNING": "1"}
  r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "-f",
                      str(ROOT / "mkdocs.yml"), "-d", str(site)],
                     capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
  assert r.returncode == 0, r.stdout + r.stderr


def pages(site: Path) -> list[str]:
  """The site's pages as URL paths ('' is the home page), from its directory tree."""
  found = sorted(p.parent.relative_to(site).as_posix() for p in site.rglob("index.html"))
  return ["" if p == "." else p + "/" for p in found]


class _Quiet(http.server.SimpleHTTPRequestHandler):
  def log_message(self, *args):
    pass


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
  handler = functools.partial(_Quiet, directory=str(site))
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  return server, f"http://127.0.0.1:{server.server_address[1]}/"


def inspect(site: Path, shots: Path) -> dict[str, dict[str, list]]:
  """Open every page of the built ``site`` in one headless Chromium: {page: {finding kind:
  [findings]}}, and a screenshot of each page under ``shots``."""
  from playwright.sync_api import sync_playwright

  server, base = serve(site)
  origin = urllib.parse.urlsplit(base).netloc
  findings: dict[str, dict[str, list]] = {}
  current: dict[str, list] = {}

  def route(r):
    url = r.request.url
    if urllib.parse.urlsplit(url).scheme in ("http", "https", "ws", "wss") and \
        urllib.parse.urlsplit(url).netloc != origin:
      current["outside requests"].append(url)
      r.abort()  # nothing leaves the machine, whatever the page asks for
    else:
      r.continue_()

  profile = tempfile.mkdtemp(prefix="fnckpt-chromium-")
  try:
    with sync_playwright() as p:
      context = p.chromium.launch_persistent_context(  # a fresh, empty profile
        profile, executable_path=chromium(), headless=True, args=FLAGS,
        viewport={"width": WIDTH, "height": HEIGHT}, service_workers="block")
      context.route("**/*", route)
      page = context.pages[0] if context.pages else context.new_page()
      page.on("console", lambda m: m.type == "error" and current["console errors"].append(
        f"{m.text} ({m.location.get('url', '')})"))
      page.on("pageerror", lambda e: current["console errors"].append(f"uncaught: {e}"))
      page.on("requestfailed", lambda r: urllib.parse.urlsplit(r.url).netloc == origin and
              current["failed requests"].append(f"{r.url}: {r.failure}"))
      page.on("response", lambda r: r.status >= 400 and
              current["failed requests"].append(f"{r.url}: HTTP {r.status}"))
      for path in pages(site):
        current = findings[path or "/"] = {k: [] for k in (
          "console errors", "failed requests", "outside requests", "broken images",
          "wide code blocks")}
        page.goto(base + path, wait_until="load")
        page.wait_for_load_state("networkidle")
        current["broken images"] += page.evaluate(BROKEN_IMAGES_JS)
        current["wide code blocks"] += [
          f"{w['scroll']} px in a {w['client']} px box: {w['text'].strip()[:100]}"
          for w in page.evaluate(WIDE_CODE_JS)]
        name = (path.strip("/") or "index").replace("/", "_") + ".png"
        page.screenshot(path=str(shots / name), full_page=True)
      context.close()
  finally:
    server.shutdown()
    server.server_close()
    shutil.rmtree(profile, ignore_errors=True)
  return findings


@pytest.mark.slow
def test_every_page_in_chromium(tmp_path):
  why = missing()
  if why is not None:
    if os.environ.get("FNCKPT_REQUIRE_BROWSER") == "1":
      pytest.fail(f"FNCKPT_REQUIRE_BROWSER=1 but the browser check cannot run: {why}")
    pytest.skip(f"browser check not run: {why} (FNCKPT_REQUIRE_BROWSER=1 makes this a failure)")
  site = tmp_path / "site"
  build(site)
  shots = Path(os.environ.get("FNCKPT_DOCS_SCREENSHOTS") or tmp_path / "screenshots")
  shots.mkdir(parents=True, exist_ok=True)
  findings = inspect(site, shots)
  assert len(findings) >= 19, f"expected the site's 19+ pages, found {sorted(findings)}"
  bad = {f"{page} — {kind}": found for page, kinds in findings.items()
         for kind, found in kinds.items() if found}
  assert not bad, "\n".join(f"{where}:\n  " + "\n  ".join(found) for where, found in bad.items())
  assert sorted(p.name for p in shots.iterdir()) == sorted(
    (p.strip("/") or "index").replace("/", "_") + ".png" for p in pages(site))


if __name__ == "__main__":  # the measurement: findings page by page, and their counts
  why = missing()
  if why:
    sys.exit(why)
  with tempfile.TemporaryDirectory() as tmp:
    build(Path(tmp) / "site")
    shots = Path(os.environ.get("FNCKPT_DOCS_SCREENSHOTS") or Path(tmp) / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    result = inspect(Path(tmp) / "site", shots)
  totals: dict[str, int] = {}
  for page, kinds in result.items():
    for kind, found in kinds.items():
      totals[kind] = totals.get(kind, 0) + len(found)
      for f in found:
        print(f"{page}\t{kind}\t{f}")
  on = {k: sum(1 for r in result.values() if r[k]) for k in totals}
  print(f"{len(result)} pages;",
        "; ".join(f"{k}: {v} (on {on[k]} pages)" for k, v in totals.items()))
