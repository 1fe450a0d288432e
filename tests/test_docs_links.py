"""Links and file paths in README.md and docs/**/*.md resolve.

- A relative link ``[text](path#anchor)`` names a file that exists (relative to the page), and
  its anchor, in a Markdown page, is one GitHub gives a heading of that page.
- A repository path in the prose (``kvflow/...``, ``benchmarks/...``, ``scripts/...``,
  ``tests/...``, ``docs/...``) exists; ``path.py::name`` and ``module.attr`` forms name the file.
- A section named in quotes after its page (``README "Coming from vLLM"``,
  ``docs/benchmarks.md, "CPU side by side"``) is part of a heading of that page.

Oracle: the file system and GitHub's anchor rule (``tests/test_readme_contents.py``), with a
repeated heading's anchor suffixed ``-1``, ``-2``...; fenced code blocks are not scanned (a
``# comment`` there is no heading). The checkers are tried first on a hand-made page.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_readme_contents import _github_anchor

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
SECTION = re.compile(r"(README|[\w-]+\.md)\)?(?:'s)?,? (?:section )?\"([^\"]{3,80})\"")
REPO_PATH = re.compile(r"(?<![\w./-])((?:kvflow|benchmarks|scripts|tests|docs)/[\w./-]*\w)")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(1-based line number, line) of every line outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings (a link inside a heading counts as its
    text; the n-th repeat of an anchor gets ``-n``)."""
    counts: dict[str, int] = {}
    anchors = set()
    for _, line in _prose_lines(page.read_text()):
        heading = re.match(r"#{1,6} (.+?)\s*$", line)
        if heading is None:
            continue
        anchor = _github_anchor(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)))
        count = counts.get(anchor, 0)
        counts[anchor] = count + 1
        anchors.add(anchor if count == 0 else f"{anchor}-{count}")
    return anchors


def _broken_links(page: Path) -> list[str]:
    broken = []
    for number, line in _prose_lines(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}:{number}: {target} (no such file)")
            elif fragment and linked.suffix == ".md" and fragment not in _anchors(linked):
                broken.append(f"{page.name}:{number}: {target} (no such heading)")
    return broken


def _missing_paths(page: Path, root: Path = ROOT) -> list[str]:
    missing = []
    for number, line in _prose_lines(page.read_text()):
        for path in REPO_PATH.findall(line):
            path = path.split("::")[0]
            module = path.rsplit(".", 1)[0] + ".py"  # tests/request_state.holders
            if not (root / path).exists() and not (root / module).exists():
                missing.append(f"{page.name}:{number}: {path}")
    return missing


def _headings(page: Path) -> list[str]:
    return [re.sub(r"`", "", line.lstrip("#").strip()) for _, line in _prose_lines(page.read_text())
            if re.match(r"#{1,6} ", line)]


def _unknown_sections(page: Path, root: Path = ROOT) -> list[str]:
    """Quoted section names after a page name that no heading of that page holds (a quote may
    shorten a heading: ``"Responses API"`` for ``Responses API (`/v1/responses`)``)."""
    pages = {p.name: p for p in (root / "docs").rglob("*.md")} | {"README": root / "README.md",
                                                                   "README.md": root / "README.md"}
    unknown = []
    flat = re.sub(r"\s+", " ", "\n".join(line for _, line in _prose_lines(page.read_text())))
    for name, section in SECTION.findall(flat):
        if name not in pages:
            continue
        section = section.replace("`", "")
        if not any(section in heading for heading in _headings(pages[name])):
            unknown.append(f"{page.name}: {name} \"{section}\"")
    return unknown


def test_the_checkers_on_a_hand_made_page(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "kvflow").mkdir()
    (tmp_path / "kvflow" / "real.py").write_text("")
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## Some `code` here\n\n## Twice\n"
                                                "\n## Twice\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Top\n\n## A (b)\n\n"
        "[ok](#a-b) [ok](docs/other.md#some-code-here) [ok](docs/other.md#twice-1)\n"
        "[web](https://example.com/x#y) [top](#top)\n"
        "[gone](docs/missing.md) [bad](#nowhere) [bad](docs/other.md#twice-2)\n"
        "`kvflow/real.py` `kvflow/real.py::f` `kvflow/real.thing` `kvflow/gone.py`\n"
        "```bash\n# Fenced\nkvflow/inside_code.py [x](nowhere.md)\n```\n"
        "[fenced](#fenced)\n"
        'See README "A" and docs/other.md, "Some code" and other.md\'s "Thrice".\n')
    assert _anchors(tmp_path / "docs" / "other.md") == {"other", "some-code-here", "twice",
                                                        "twice-1"}
    assert _broken_links(page) == [
        "README.md:7: docs/missing.md (no such file)",
        "README.md:7: #nowhere (no such heading)",
        "README.md:7: docs/other.md#twice-2 (no such heading)",
        "README.md:13: #fenced (no such heading)",
    ]
    assert _unknown_sections(page, tmp_path) == ['README.md: other.md "Thrice"']
    assert _missing_paths(page, tmp_path) == ["README.md:7: docs/missing.md",
                                             "README.md:8: kvflow/gone.py"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert _broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_exists(page):
    assert _missing_paths(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_quoted_section_is_a_heading_of_its_page(page):
    assert _unknown_sections(page) == []
