"""The documentation's relative links resolve: in README.md and every docs/**/*.md, each Markdown link or image whose
target is a path (not http(s), mailto or another scheme) names a file or directory inside the repository, and each
`#anchor` into a Markdown file (or into the page itself) names one of that file's headings, slugged as GitHub does.
Links inside fenced code blocks and inline code spans are not links."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the text may hold one level of brackets (an image inside a link).
_INLINE = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # [text] or ![alt]
    r"\(\s*(<[^>]*>|(?:[^()\s]|\([^()\s]*\))*)"  # (target, or <target>
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)"  # an optional "title")
)
_REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
_HTML = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files(root: Path = ROOT) -> list[Path]:
    files = [root / "README.md"] if (root / "README.md").is_file() else []
    return files + sorted((root / "docs").rglob("*.md"))


def _prose_lines(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans blanked unless `blank_code` is False."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        opening = _FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)[0] * len(opening.group(1))
            continue
        if fence is not None:
            if line.strip().startswith(fence) and set(line.strip()) <= {fence[0]}:
                fence = None
            continue
        lines.append((number, _CODE_SPAN.sub(lambda span: " " * len(span.group(0)), line) if blank_code else line))
    return lines


def link_targets(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image, reference definition and HTML a/img in the prose."""
    found = []
    for number, line in _prose_lines(text):
        for pattern in (_INLINE, _REFERENCE_DEFINITION, _HTML):
            for match in pattern.finditer(line):
                target = match.group(1).strip()
                if target.startswith("<") and target.endswith(">"):
                    target = target[1:-1].strip()
                found.append((number, target))
    return found


def github_slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: Markdown marks and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    slugs: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in _prose_lines(path.read_text(encoding="utf-8"), blank_code=False):
        heading = _HEADING.match(line)
        if heading:
            slug = github_slug(heading.group(2))
            suffix = counts.get(slug, 0)
            counts[slug] = suffix + 1
            slugs.add(slug if suffix == 0 else f"{slug}-{suffix}")
    return slugs


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with the page's relative links, one line each (empty when every link resolves)."""
    problems = []
    for number, target in link_targets(page.read_text(encoding="utf-8")):
        if not target or _SCHEME.match(target) or target.startswith("//"):
            continue  # http(s), mailto and other schemes: not checked here
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part.split("?", 1)[0])
        if path_part.startswith("/"):
            resolved = (root / path_part.lstrip("/")).resolve()
        elif path_part:
            resolved = (page.parent / path_part).resolve()
        else:
            resolved = page  # "#anchor": this page
        where = f"{page.relative_to(root)}:{number}: {target}"
        if not resolved.is_relative_to(root.resolve()):
            problems.append(f"{where} points outside the repository")
        elif not resolved.exists():
            problems.append(f"{where} does not exist")
        elif (
            anchor
            and resolved.suffix == ".md"
            and resolved.is_file()
            and unquote(anchor).lower() not in anchors(resolved)
        ):
            problems.append(f"{where} names no heading of {resolved.relative_to(root.resolve())}")
    return problems


def test_there_are_pages_to_check():
    pages = markdown_files()
    assert ROOT / "README.md" in pages
    assert any(page.parent != ROOT for page in pages), "docs/ holds no Markdown pages"


@pytest.mark.parametrize("page", markdown_files(), ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve(page):
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_checker_finds_broken_links_and_anchors(tmp_path):
    """A planted broken link, image and anchor are reported; good ones, external links and code are not."""
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "guide.md").write_text("# The guide\n\n## Step `one`: setup\n\n## Step `one`: setup\n")
    (tmp_path / "docs" / "sub" / "picture.png").write_bytes(b"")
    (tmp_path / "README.md").write_text(
        "# Title\n\n"
        "[ok](docs/guide.md) [ok dir](docs/sub/) [ok anchor](docs/guide.md#step-one-setup) "
        "[second heading](docs/guide.md#step-one-setup-1) [self](#title) ![ok image](docs/sub/picture.png)\n"
        "[web](https://example.com/missing) [mail](mailto:someone@example.com) `[code](missing-in-span.md)`\n"
        "```\n[fenced](missing-in-fence.md)\n```\n"
        "[gone](docs/missing.md) ![gone image](docs/sub/missing.png) [bad anchor](docs/guide.md#no-such-heading)\n"
        "[bad self](#nowhere) [outside](../elsewhere.md)\n\n"
        "[ref]: docs/also-missing.md\n"
    )
    problems = broken_links(tmp_path / "README.md", root=tmp_path)
    reported = sorted(problem.split(": ", 1)[1].split(" ", 1)[0] for problem in problems)
    assert reported == sorted(
        [
            "docs/missing.md",
            "docs/sub/missing.png",
            "docs/guide.md#no-such-heading",
            "#nowhere",
            "../elsewhere.md",
            "docs/also-missing.md",
        ]
    ), problems
    assert not broken_links(tmp_path / "docs" / "guide.md", root=tmp_path)


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("The guarantee", "the-guarantee"),
        ("`auto`: one tree merged from several drafters", "auto-one-tree-merged-from-several-drafters"),
        (
            "xeon-t0: the fast path, before and after the row split",
            "xeon-t0-the-fast-path-before-and-after-the-row-split",
        ),
        ("`rows` and `category_rows`", "rows-and-category_rows"),
    ],
)
def test_github_slugs(heading, slug):
    assert github_slug(heading) == slug
