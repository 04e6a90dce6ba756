"""The documentation: README.md is a front page, docs/ builds into a site with no warning, no link is broken.

MkDocs (`mkdocs build --strict`, with mkdocs.yml's `validation` set to warn) fails on a link to a
page that does not exist, an anchor that no heading of the target page makes, and a page of docs/
that is not in the nav. It does not build README.md and the other Markdown files outside docs/
(infra/README.md, notebooks/), which GitHub shows: their links are checked here, anchors against
GitHub's heading slugs.

Without MkDocs installed (it comes with the dev extra) the site build is skipped, except under CI,
where it must run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README_MAX_LINES = 300

# [text](target) and ![alt](target), not inside `code`; the target ends at whitespace or ')'.
_LINK = re.compile(r"!?\[(?:[^\]`]|`[^`]*`)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _mkdocs_installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("mkdocs", "material"))


def _prose_lines(text: str, blank_code: bool = True):
    """(line number, line) outside fenced code blocks, with inline code spans blanked (so that a link
    written as code is not taken for one)."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced and not blank_code:
            yield number, line
        elif not fenced:
            yield number, re.sub(r"`[^`]*`", lambda m: "`" + " " * (len(m[0]) - 2) + "`", line)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation but - and _ removed,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub makes for the headings of a Markdown file (duplicates get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8"), blank_code=False):
        if match := _HEADING.match(line):
            slug = github_slug(match[2])
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """'file:line: target (why)' for every relative link in a Markdown file (or in `text`, read as if
    it were that file) whose file or anchor does not exist."""
    text = path.read_text(encoding="utf-8") if text is None else text
    problems = []
    for number, line in _prose_lines(text):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{number}: {target}"
            if not resolved.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                problems.append(f"{where} (no heading makes the anchor #{anchor} in {resolved.name})")
    return problems


def _markdown_outside_docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "infra").glob("*.md")), *sorted((ROOT / "notebooks").glob("*.md"))]


def _nav_pages(nav) -> list[str]:
    """The .md files named anywhere in mkdocs.yml's nav."""
    if isinstance(nav, str):
        return [nav] if nav.endswith(".md") else []
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES - 1}): it is the front page; move the details "
        "into a page in docs/ and link it")


def test_every_docs_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == sorted(nav), "a page is in mkdocs.yml's nav twice"
    assert not set(pages) - set(nav), f"docs pages missing from mkdocs.yml's nav: {sorted(set(pages) - set(nav))}"
    assert not set(nav) - set(pages), f"mkdocs.yml's nav names missing pages: {sorted(set(nav) - set(pages))}"


def test_links_outside_the_site_resolve():
    """README.md, infra/ and notebooks/ Markdown (and the notebook's Markdown cells): every relative
    link reaches a file, and every #anchor a heading of it."""
    problems = [p for path in _markdown_outside_docs() for p in broken_links(path)]
    notebook = ROOT / "notebooks" / "quickstart.ipynb"
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    for cell in cells:
        if cell["cell_type"] == "markdown":
            problems += broken_links(notebook, "".join(cell["source"]))
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_link_checker_catches_broken_files_and_anchors(tmp_path):
    """The checker above is not vacuous: a missing file, a missing anchor in another file and on the
    same page are reported; existing ones (headings with code and punctuation) are not."""
    (tmp_path / "page.md").write_text("# Page\n\n## Coming from `model.fit`, Horovod or Orbit\n\n## Same\n\n## Same\n")
    doc = tmp_path / "doc.md"
    text = ("# Doc\n\n[a](page.md#coming-from-modelfit-horovod-or-orbit) [b](page.md#same-1) [c](#doc)\n"
            "[d](nope.md) [e](page.md#nope) [f](#nope) [g](https://example.com/x.md#y)\n"
            "```\n[h](also-nope.md)\n```\n")
    doc.write_text(text)
    problems = broken_links(doc)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "nope.md (no such file)",
        "page.md#nope (no heading makes the anchor #nope in page.md)",
        "#nope (no heading makes the anchor #nope in doc.md)",
    ], problems


@pytest.mark.slow
def test_site_builds_without_warnings(tmp_path):
    """`mkdocs build --strict`: the first warning (broken link or anchor, page outside the nav) fails."""
    if not _mkdocs_installed():
        if os.environ.get("CI"):
            pytest.fail("mkdocs and mkdocs-material are not installed; CI installs the dev extra (pip install -e '.[dev]')")
        pytest.skip("mkdocs is not installed (pip install -e '.[dev]')")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    warnings = [line for line in output.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert result.returncode == 0 and not warnings, (
        "mkdocs build --strict failed: " + (warnings[0] if warnings else output[-2000:]))
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "configuration" / "index.html").exists()
