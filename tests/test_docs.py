"""The README is a guide and docs/ the reference: every relative link and anchor between them
resolves, every `python -m prefixgate...` module they name exists, and the README stays short."""
from __future__ import annotations

import importlib.util
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300
LINK = re.compile(r"\]\(([^)\s]+)\)")
MODULE = re.compile(r"python -m (prefixgate(?:\.\w+)+)")


def prose_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((n, line))
    return out


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, links and code marks dropped,
    spaces to hyphens, punctuation other than - and _ removed."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.replace("`", "")).strip().lower()
    return "".join("-" if ch == " " else ch for ch in text
                   if ch in " -_" or unicodedata.category(ch)[0] in "LN")


def anchors(page: Path) -> set[str]:
    """Its headings' anchors (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    for _, line in prose_lines(page):
        heading = re.match(r"#{1,6}\s+(.*)$", line)
        if heading:
            base = slug(heading.group(1))
            seen[base] = seen.get(base, -1) + 1
    return {base if i == 0 else f"{base}-{i}" for base, n in seen.items() for i in range(n + 1)}


def broken_links(page: Path) -> list[str]:
    broken = []
    for n, line in prose_lines(page):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}:{n}: no file {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}:{n}: no anchor {target}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_and_anchors_resolve(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_module_run_with_python_m_exists(page):
    named = set(MODULE.findall(page.read_text(encoding="utf-8")))
    assert [m for m in sorted(named) if importlib.util.find_spec(m) is None] == []


def test_the_readme_is_a_guide():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= README_MAX_LINES


def test_the_checker_finds_a_broken_link_and_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# A title: `x`\n\n[ok](b.md#b-1) [no](c.md) [bad](b.md#zz)\n"
                                   "```\n[in code](nowhere.md)\n```\n")
    (tmp_path / "b.md").write_text("# B\n\n## B\n")
    assert anchors(tmp_path / "a.md") == {"a-title-x"}
    assert broken_links(tmp_path / "a.md") == ["a.md:3: no file c.md", "a.md:3: no anchor b.md#zz"]
