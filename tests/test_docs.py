"""Every markdown file of the repository renders as written: its code fences are closed, and
each relative link reaches a file that exists (and a heading of it, for a `#anchor`).

An unclosed fence turns the rest of the file into code, so every section after it is lost
to a reader (docs/client.md's Verify section once swallowed Load and everything below); a
link to a moved or renamed file or heading is found here instead of by a reader. Links to
other sites are not followed (nothing outside this machine is reachable from the tests).
"""

from __future__ import annotations

import re
import subprocess
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: An opening or closing fence: three or more backticks or tildes, indented at most 3 spaces
#: (CommonMark); what follows an opening fence is its info string (the language).
FENCE = re.compile(r"^ {0,3}(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
#: [text](target) and ![alt](target), the target up to a space (a title may follow) or ")".
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\((?P<target><[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\)")
#: Inline code, left out before links are looked for: `[a](b)` inside it is not a link.
INLINE_CODE = re.compile(r"(`+).+?\1")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(?P<text>.+?)\s*#*\s*$")
#: Targets that are not files of this repository.
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)


def markdown_files() -> list[Path]:
    """Every tracked markdown file (what a clone has; not .venv's or a build's)."""
    listed = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / name for name in listed.stdout.split()]


def prose_lines(text: str) -> tuple[list[tuple[int, str]], list[str]]:
    """(the lines outside code fences with their numbers, problems with the fences). A fence
    closes only with the same character, at least as long, and no info string (CommonMark)."""
    prose, problems = [], []
    opened: tuple[int, str] | None = None  # (line number, fence)
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if opened is None:
            if match and not (match["fence"][0] == "`" and "`" in match["info"]):
                opened = (number, match["fence"])
            else:
                prose.append((number, line))
        elif match and match["fence"][0] == opened[1][0] and len(match["fence"]) >= len(opened[1]):
            if not match["info"].strip():
                opened = None
            elif not problems:  # code to a renderer, but surely a fence left open before it
                problems.append(
                    f"line {number}: {line.strip()!r} opens a fence inside the one opened on line "
                    f"{opened[0]}: close that one first"
                )
    if opened is not None:
        problems.append(f"line {opened[0]}: code fence {opened[1]!r} is never closed")
    return prose, problems


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to -."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (a repeated heading's gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text())[0]:
        match = HEADING.match(line)
        if match:
            base = slug(match["text"])
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_problems(path: Path) -> list[str]:
    problems = []
    for number, line in prose_lines(path.read_text())[0]:
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            target = match["target"].strip("<>")
            if EXTERNAL.match(target):
                continue
            name, _, anchor = target.partition("#")
            linked = (path.parent / name).resolve() if name else path
            if not linked.exists():
                problems.append(f"line {number}: {target} -> no such file {linked}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                problems.append(f"line {number}: {target} -> {linked.name} has no heading #{anchor}")
    return problems


@pytest.mark.parametrize("path", markdown_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_code_fences_are_closed(path: Path) -> None:
    problems = prose_lines(path.read_text())[1]
    assert not problems, f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_heading(path: Path) -> None:
    problems = link_problems(path)
    assert not problems, f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_checks_see_what_they_are_for(tmp_path: Path) -> None:
    """Each check finds the fault it is for, and passes what is right."""
    (tmp_path / "other.md").write_text("# Other file\n\n## A `code` heading, with (punctuation)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n```bash\necho [not](a-link.md)\n```\n\n"
        "[ok](other.md#a-code-heading-with-punctuation) [ok](#page) `[not](checked.md)`\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere)\n\n```python\nopen = 1\n"
    )
    _, fences = prose_lines(page.read_text())
    assert fences == ["line 10: code fence '```' is never closed"], fences
    _, fences = prose_lines("```bash\nverify\n\n## Load\n\n```bash\nload\n```\n")
    assert fences == ["line 6: '```bash' opens a fence inside the one opened on line 1: close that one first"]
    assert [problem.split(" -> ")[0] for problem in link_problems(page)] == [
        "line 8: missing.md",
        "line 8: other.md#nowhere",
    ], link_problems(page)
