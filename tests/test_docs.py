"""The README is a first page, and no link in it or in docs/ leads out of the repository or to nothing."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^(https?|mailto):", re.IGNORECASE)


def links(page: Path) -> list[str]:
    """Every Markdown link target on the page, code blocks left out."""
    return LINK.findall(FENCE.sub("", page.read_text()))


def test_readme_is_a_first_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(page):
    bad = []
    for target in links(page):
        if EXTERNAL.match(target) or target.startswith("#"):
            continue
        path = unquote(target.split("#", 1)[0])
        resolved = (page.parent / path).resolve()
        if path.startswith("/") or not resolved.is_relative_to(ROOT):
            bad.append(f"{target}: outside the repository")
        elif not resolved.exists():
            bad.append(f"{target}: no such file")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_reference_leaves_the_repository(page):
    """Not even in text or code: a clone has nothing beside the repository."""
    assert not re.search(r"\.\./(\.\./)*shared\b", page.read_text())
