"""The docs site as a reader gets it: ``mkdocs build --strict`` of docs/ fails on a warning, no
built page shows markup that was meant to be rendered (Sphinx roles, reST directives,
mkdocstrings ``:::`` lines, unrendered double backticks), every page is reachable from the nav,
and the API page documents the public API and nothing internal."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
MKDOCS = [sys.executable, "-m", "mkdocs"]


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` as the test command runs it (not ``-q``: it lowers the log
    level below WARNING, so a warning is neither shown nor counted)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([*MKDOCS, "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=240, env=env,
                          cwd=str(config.parent))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = build(REPO / "mkdocs.yml", out)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    return out


class _Text(HTMLParser):
    """The text a reader sees, line by line, without code blocks (``<pre>``: examples may show
    anything) and scripts."""

    SKIP = {"pre", "script", "style"}

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.SKIP:
            self.depth += 1
        elif tag in {"p", "li", "div", "br", "tr", "h1", "h2", "h3", "h4", "h5", "h6"}:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP and self.depth:
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if not self.depth:
            self.parts.append(data)


def page_text(html: str) -> str:
    p = _Text()
    p.feed(html)
    return "".join(p.parts)


RAW_MARKUP = {
    "Sphinx role": re.compile(
        r":(?:py:)?(?:class|meth|func|attr|mod|exc|data|obj|const|ref|doc|term):`?"),
    "reST directive": re.compile(r"^\s*\.\. [\w-]+::", re.M),
    "mkdocstrings line": re.compile(r"^\s*:::\s*\S", re.M),
    "double backticks": re.compile(r"``"),
}


def raw_markup(text: str) -> list[str]:
    found = []
    for what, pattern in RAW_MARKUP.items():
        for m in pattern.finditer(text):
            line = text[text.rfind("\n", 0, m.start()) + 1:text.find("\n", m.end())].strip()
            found.append(f"{what}: {line[:120]!r}")
    return found


def test_no_page_shows_raw_markup(site: Path) -> None:
    pages = sorted(site.rglob("*.html"))
    assert len(pages) >= len(list(DOCS.glob("*.md")))
    bad = {str(p.relative_to(site)): raw for p in pages
           if (raw := raw_markup(page_text(p.read_text(encoding="utf-8"))))}
    assert bad == {}


def test_raw_markup_is_found() -> None:
    """The checker above sees each kind it looks for, as the built HTML would hold it."""
    for html in ("<p>Returns a <code>:class:</code><code>Foo</code>.</p>",
                 "<p>See :meth:<code>save</code>.</p>",
                 "<p>.. note::</p><p>text</p>",
                 "<p>::: ckptfs.open</p>",
                 "<p>the ``step`` argument</p>"):
        assert raw_markup(page_text(html)), html
    assert raw_markup(page_text("<pre><code>.. note::\n``x``</code></pre><p>ok</p>")) == []


def nav_pages(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav] if nav.endswith(".md") else []
    if isinstance(nav, list):
        return [p for item in nav for p in nav_pages(item)]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in nav_pages(v)]
    return []


def test_every_page_is_in_the_nav() -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    in_nav = nav_pages(config["nav"])
    assert sorted(set(in_nav)) == sorted(in_nav), "a page is in the nav twice"
    assert [p for p in in_nav if not (DOCS / p).is_file()] == []
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(pages) - set(in_nav)) == []


def test_every_nav_page_is_built(site: Path) -> None:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    for page in nav_pages(config["nav"]):
        name = page.removesuffix(".md")
        built = site / "index.html" if name == "index" else site / name / "index.html"
        assert built.is_file(), page


PUBLIC = ("ckptfs.tiered", "ckptfs.TieredStore", "ckptfs.ReplicationStatus", "ckptfs.open",
          "ckptfs.CheckpointStore", "ckptfs.CheckpointManager")
INTERNAL = ("after_sharded_commit", "after_prune", "walk", "restore_source", "read_tiers",
            "use_step")


def test_api_page_is_the_public_api(site: Path) -> None:
    html = (site / "api" / "index.html").read_text(encoding="utf-8")
    ids = set(re.findall(r'id="(ckptfs[\w.]*)"', html))
    assert [name for name in PUBLIC if name not in ids] == []
    assert sorted(i for i in ids if i.rsplit(".", 1)[-1] in INTERNAL) == []
    text = page_text(html)
    assert [n for n in INTERNAL if "_" in n and n in text] == []


def copy_docs(dest: Path) -> Path:
    """A copy of docs/ and mkdocs.yml to break; the package is linked in for the API page."""
    shutil.copytree(DOCS, dest / "docs")
    shutil.copy(REPO / "mkdocs.yml", dest / "mkdocs.yml")
    (dest / "ckptfs").symlink_to(REPO / "ckptfs", target_is_directory=True)
    return dest / "mkdocs.yml"


def test_a_warning_fails_the_build(tmp_path: Path) -> None:
    """The strict build can fail: a nav entry to a missing page, and a link to one, each make
    it exit non-zero (with ``-q`` neither did)."""
    config = copy_docs(tmp_path / "nav")
    text = config.read_text()
    assert "  - Home: index.md\n" in text
    config.write_text(text.replace("  - Home: index.md\n",
                                   "  - Home: index.md\n  - Gone: no-such-page.md\n"))
    r = build(config, tmp_path / "site-nav")
    assert r.returncode != 0 and "no-such-page.md" in r.stdout + r.stderr

    config = copy_docs(tmp_path / "link")
    index = config.parent / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    r = build(config, tmp_path / "site-link")
    assert r.returncode != 0 and "no-such-page.md" in r.stdout + r.stderr
