"""The documentation holds together: every relative link in the README and docs/ reaches a file
of the repository, and every ``#anchor`` a heading of its page (GitHub's slugs)."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    out, in_code = set(), False
    for line in page.read_text().splitlines():
        in_code ^= line.startswith("```")
        if not in_code and (m := re.match(r"^#{1,6} (.+)", line)):
            out.add(_slug(m.group(1)))
    return out


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return [t for t in _LINK.findall(text) if not t.startswith(("http://", "https://", "mailto:"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_and_anchor_resolves(page: Path):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or not dest.is_relative_to(REPO):
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, broken


def test_the_readme_opens_with_the_two_commands_and_links_every_page():
    readme = (REPO / "README.md").read_text()
    assert readme.split("```bash\n", 1)[1].startswith("make demo") and "\nmake test " in readme.split("```")[1]
    linked = {t.partition("#")[0] for t in _links(REPO / "README.md")}
    assert {f"docs/{p.name}" for p in PAGES[1:]} <= linked
