"""The documentation holds together: every relative markdown link of README.md and docs/ names a file that
exists, and every docs/ page is reachable from README.md by following such links (docs/README.md indexes them)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
"""An inline markdown link `[text](target "title")`; its target is group 1."""
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
"""Fenced and inline code, where brackets are code (`x[i](y)`), not links."""


def relative_links(page: Path) -> list[tuple[str, Path]]:
    """(target as written, the file it names) for each link of `page` to a path (not a URL, not an anchor)."""
    links = []
    for target in LINK.findall(CODE.sub("", page.read_text())):
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        links.append((target, (page.parent / target.split("#")[0]).resolve()))
    return links


def pages(root: Path) -> list[Path]:
    return [root / "README.md"] + sorted((root / "docs").rglob("*.md"))


def broken_links(root: Path) -> list[str]:
    return [f"{page.relative_to(root)}: ({target})" for page in pages(root)
            for target, path in relative_links(page) if not path.exists()]


def reachable(root: Path) -> set[Path]:
    """The markdown pages reached from README.md by following relative links."""
    seen, todo = set(), [(root / "README.md").resolve()]
    while todo:
        page = todo.pop()
        if page in seen or not page.is_file():
            continue
        seen.add(page)
        todo.extend(path for _, path in relative_links(page) if path.suffix == ".md")
    return seen


def unreachable(root: Path) -> list[str]:
    found = reachable(root)
    return [str(page.relative_to(root)) for page in pages(root) if page.resolve() not in found]


def test_every_relative_link_names_an_existing_file():
    assert not broken_links(ROOT), broken_links(ROOT)


def test_every_docs_page_is_reachable_from_the_readme():
    assert len(pages(ROOT)) > 10 and not unreachable(ROOT), unreachable(ROOT)


def test_the_checks_find_what_they_guard(tmp_path):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "README.md").write_text("See [the index](docs/README.md) and [a site](https://example.org).\n")
    (tmp_path / "docs" / "README.md").write_text("[a](a.md#part) [gone](sub/gone.md) `[code](b.md)`\n"
                                                 "```\nx[i](c.md)\n```\n[top](../README.md) [here](#index)\n")
    (tmp_path / "docs" / "a.md").write_text("[deeper](sub/c.md)\n")
    (tmp_path / "docs" / "sub" / "c.md").write_text("back [up](../a.md)\n")
    (tmp_path / "docs" / "b.md").write_text("linked only from code\n")
    assert broken_links(tmp_path) == ["docs/README.md: (sub/gone.md)"]
    assert unreachable(tmp_path) == ["docs/b.md"]
