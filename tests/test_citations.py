"""Comments and docstrings may cite only documents a maintainer can open: files in this
repository. `docs/<page>.md#anchor` citations must name an existing page and anchor."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = {".venv", ".git", "build", "dist", "node_modules", ".mypy_cache", ".ruff_cache"}

# A document outside the checkout: the shared notes (`REFERENCE §3`, `../shared/...`) or any
# absolute path to them.
OUTSIDE = re.compile(
    r"REFERENCE\s*§|REFERENCE\.md|\.\./shared\b|/work/shared\b|\bshared/[A-Z]+\.md"
)
DOC_CITATION = re.compile(r"\bdocs/([\w.-]+\.md)#([\w-]+)")


def python_files() -> list[Path]:
    return sorted(
        path
        for path in ROOT.rglob("*.py")
        if not SKIP.intersection(path.relative_to(ROOT).parts) and "_pb2" not in path.name
    )


def anchors(page: Path) -> set[str]:
    """GitHub-style heading slugs plus explicit `<a id="...">` anchors."""
    text = page.read_text(encoding="utf-8")
    found = set(re.findall(r'<a id="([\w-]+)"', text))
    for heading in re.findall(r"^#+\s+(.+)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\s-]", "", heading.strip().lower())
        found.add(re.sub(r"\s", "-", slug))
    return found


def test_no_python_file_cites_a_document_outside_the_repository():
    this = Path(__file__).resolve()
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in python_files()
        if path != this
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert offenders == [], "cite docs/reference.md#... instead:\n" + "\n".join(offenders)


def test_every_docs_citation_names_an_existing_page_and_anchor():
    cited = 0
    broken = []
    for path in python_files():
        for page, anchor in DOC_CITATION.findall(path.read_text(encoding="utf-8")):
            cited += 1
            target = ROOT / "docs" / page
            if not target.is_file() or anchor not in anchors(target):
                broken.append(f"{path.relative_to(ROOT)}: docs/{page}#{anchor}")
    assert cited >= 18, "the reference citations disappeared"
    assert broken == []


def test_the_patterns_catch_what_they_are_for():
    assert OUTSIDE.search("ratio = 0.5 (REFERENCE §4)")
    assert OUTSIDE.search("see ../shared/REFERENCE.md")
    assert not OUTSIDE.search("see docs/reference.md#rotation")
    assert anchors(ROOT / "docs" / "reference.md") >= {"ca-api", "status-codes", "metrics", "sds"}
