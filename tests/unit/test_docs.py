"""The project's docs stand on their own: every pointer into docs/ lands on a section that exists,
and nothing points at files outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_ALL_SOURCES = [*sorted((REPO / "src").rglob("*.py")), *sorted((REPO / "tests").rglob("*.py")),
                *sorted((REPO / "bench").rglob("*.py")),
                *sorted((REPO / "examples").rglob("*.py")),
                REPO / "README.md", REPO / "bench" / "README.md",
                *sorted((REPO / "docs").rglob("*.md"))]
# Not what lies in hidden folders (bench/.venv-pytagi, the wheel's venv, holds torch's sources).
SOURCES = [p for p in _ALL_SOURCES
           if not any(part.startswith(".") for part in p.relative_to(REPO).parts)]
# Cited as "docs/tagi.md, <Section name>" where a section name ends at ")", ".", ";" or ":".
TAGI_CITATION = re.compile(r"docs/tagi\.md, ([^).;:`]+)")
# "docs/design.md, contract 5", "docs/design.md contracts 1, 2", "docs/design.md, 4 and 5".
DESIGN_CITATION = re.compile(r"docs/design\.md,? (?:contracts? )?(\d+(?:(?:, | and )\d+)*)")


def _text(path: Path) -> str:
    """The file with line breaks, indentation and comment marks folded into single spaces, so a
    citation wrapped over two lines reads as one."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text(encoding="utf-8"))


def _headings(doc: str, level: str) -> list[str]:
    return re.findall(rf"^{level} (.+)$", (REPO / "docs" / doc).read_text(), re.MULTILINE)


def test_tagi_citations_name_existing_sections():
    sections = _headings("tagi.md", "##") + _headings("tagi.md", "###")
    cited = [(path.relative_to(REPO), m.group(1).strip()) for path in SOURCES
             for m in TAGI_CITATION.finditer(_text(path)) if not m.group(1).startswith("<")]
    assert len(cited) > 10, "the citation pattern no longer matches how the code cites"
    broken = [(str(path), name) for path, name in cited
              if not any(name.startswith(section) for section in sections)]
    assert not broken, f"citations of docs/tagi.md naming no section: {broken}"


def test_design_citations_name_existing_contracts():
    contracts = {int(n) for n in re.findall(r"^### Contract (\d+):",
                                            (REPO / "docs" / "design.md").read_text(),
                                            re.MULTILINE)}
    assert contracts == set(range(1, 17))
    cited = [(str(path.relative_to(REPO)), int(n)) for path in SOURCES
             for m in DESIGN_CITATION.finditer(_text(path))
             for n in re.findall(r"\d+", m.group(1))]
    assert cited and not [c for c in cited if c[1] not in contracts], cited


def test_nothing_points_outside_the_repository():
    """The docs once lived outside the repository; no pointer to them may come back."""
    outside = re.compile(r"\.\./shared|TAGI_MATH|DESIGN\.md|DESIGN contract|§\d")
    hits = [f"{path.relative_to(REPO)}:{n}" for path in SOURCES
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if outside.search(line) and path != Path(__file__)]
    assert not hits, hits


def test_markdown_links_to_repository_files_resolve():
    link = re.compile(r"\]\(((?!https?:|#)[^)#\s]+)")
    missing = [f"{doc.relative_to(REPO)} -> {target}"
               for doc in (REPO / "README.md", REPO / "bench" / "README.md",
                           *(REPO / "docs").rglob("*.md"))
               for target in link.findall(doc.read_text(encoding="utf-8"))
               if not (doc.parent / target).exists()]
    assert not missing, missing
