"""The README is a door and docs/ the manual: every relative link resolves, anchors included."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_README_LINES = 200
# [text](target) outside code; images ![..](..) match too, which is what we want.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "benchmarks").glob("**/README.md"))]


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", path.read_text())
    anchors = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t)]


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif not resolved.is_relative_to(root):
            broken.append(f"{target} (outside the repository)")
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
            broken.append(f"{target} (no heading #{anchor})")
    return broken


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert broken_links(path) == [], f"{path.relative_to(ROOT)} has broken links"


def test_readme_is_a_door():
    num_lines = len((ROOT / "README.md").read_text().splitlines())
    assert num_lines <= MAX_README_LINES, f"README.md has {num_lines} lines; move detail to docs/"


def test_checker_catches_broken_links(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    (tmp_path / "x.md").touch()
    (root / "other.md").write_text("# Other page\n\n## A section\n")
    page = root / "page.md"
    page.write_text("[ok](other.md#a-section) [gone](missing.md) [bad anchor](other.md#nope)\n"
                    "[up](../x.md) [web](https://example.com)\n```\n[in code](missing2.md)\n```\n")
    assert broken_links(page, root=root) == [
        "missing.md (no such file)", "other.md#nope (no heading #nope)",
        "../x.md (outside the repository)"]
