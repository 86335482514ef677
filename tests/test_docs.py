"""Every markdown file of the repository renders as written: its code fences are closed, and
each relative link reaches a file that exists (and a heading of it, for a `#anchor`); every
path of the repository it names (`speakerd/model/audio.py`, tests/test_readme.py, `Makefile`)
is a file or folder a clone has, and a glob (`measurements/h100-*.jsonl`) matches one. The
README's Documentation table lists every page of docs/.

An unclosed fence turns the rest of the file into code, so every section after it is lost
to a reader (docs/client.md's Verify section once swallowed Load and everything below); a
link to a moved or renamed file or heading, or a path to one, is found here instead of by a
reader. Links to other sites are not followed (nothing outside this machine is reachable
from the tests).
"""

from __future__ import annotations

import posixpath
import re
import subprocess
import unicodedata
from functools import cache
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
#: A doc names a path of this repository by starting it with one of these folders
#: (`speakerd/model/audio.py`, `deploy/k8s/`), or names one of these files alone (`Makefile`);
#: every other top-level entry git tracks counts too (repository_entries). Nothing else is
#: checked, as nothing else is a path of the repository: a path on the user's machine or in
#: the image (`/path/to/model.bin`, `~/.cache/speakerd`, `/opt/speakerd`) starts with `/` or `~`; a
#: file the reader or a command makes (`meeting.wav`, `served.npz`, `.venv/bin/python`,
#: `.cache/pyannote/segmentation-3.0`, `.whl/`) lies outside these; a module
#: (`speakerd.pyannote`) has no `/`; a file named inside a folder the sentence names
#: (`sincnet.py` of `speakerd/model/segmentation/`) is left to the reader.
REPO_FOLDERS = ("speakerd", "docs", "tests", "scripts", "deploy", "measurements", ".ci")
REPO_FILES = ("Makefile", "Dockerfile", "pyproject.toml", "README.md", ".dockerignore", ".gitignore")
#: A name the reader fills in, not a file: `tests/test_x.py`, `measurements/<gpu>-...`,
#: `deploy/NAME`, `speakerd/...`.
PLACEHOLDER = re.compile(r"<[^>]*>|(?:^|[/_.-])(?:x|X|N|NAME|FILE|DIR)(?=[/_.-]|$)|\.\.\.")


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


@cache
def repository_entries() -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """(every file and folder of a clone, relative to the root; the top-level folders; the
    top-level files). A clone's files are git's, tracked or about to be (not ignored ones:
    a build's, an environment's), that are here."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    present = [name for name in listed if (ROOT / name).exists()]
    entries = {"/".join(name.split("/")[:end]) for name in present for end in range(1, name.count("/") + 2)}
    folders = {name.split("/")[0] for name in present if "/" in name} | set(REPO_FOLDERS)
    files = {name for name in present if "/" not in name} | set(REPO_FILES)
    return frozenset(entries), frozenset(folders), frozenset(files)


def named_paths(line: str, folder: str) -> list[tuple[str, list[str]]]:
    """The repository paths a prose line of a markdown file in `folder` (relative to the root)
    names, in order, each as (written, [its path from the root, from `folder`]): each word of
    its inline code, and each word of its text outside code (not one inside a URL or a longer
    path), that starts with a repository folder and `/` (`../` before it too), or a word of
    its inline code that is a top-level file. A `:line` or `::test` after a path is left out,
    and so is a placeholder."""
    _, folders, files = repository_entries()
    words = [
        (code.start() + word.start(), word[0])
        for code in INLINE_CODE.finditer(line)
        for word in re.finditer(r"[^\s=`]+", code[0])
    ]
    text = INLINE_CODE.sub(lambda code: " " * len(code[0]), line)
    names = "|".join(re.escape(name) for name in sorted(folders))
    bare = rf"(?<![\w/.~`-])(?:\.\.?/)*(?:{names})/[\w./*?-]*"
    words += [(word.start(), word[0]) for word in re.finditer(bare, text)]
    found = []
    for _, word in sorted(words):
        written = re.sub(r"(?:::|:\d).*$", "", word.strip("'\"()[]{},;")).rstrip(".:,;")
        inside = re.sub(r"^(?:\.\.?/)+", "", written)
        named = (inside.split("/")[0] in folders and "/" in inside) or inside in files
        if named and not PLACEHOLDER.search(written):
            found.append(
                (written, [posixpath.normpath(posixpath.join(base, written)) for base in ("", folder)])
            )
    return found


def path_exists(path: str) -> bool:
    """Whether a clone has `path` (relative to the root), or a file or folder `path`'s glob
    matches (`*` and `?` within one folder)."""
    entries = repository_entries()[0]
    if not re.search(r"[*?]", path):
        return path in entries
    pattern = "".join({"*": "[^/]*", "?": "[^/]"}.get(char, re.escape(char)) for char in path)
    return any(re.fullmatch(pattern, entry) for entry in entries)


def path_problems(text: str, folder: str) -> list[str]:
    """Where the markdown `text`, of a file in `folder` (relative to the root), names a path of
    the repository that a clone lacks, from the root or from `folder`."""
    problems = []
    for number, line in prose_lines(text)[0]:
        for written, resolved in named_paths(line, folder):
            if not any(path_exists(path) for path in resolved):
                what = "matches no file" if re.search(r"[*?]", written) else "no such file or folder"
                problems.append(f"line {number}: {written} -> {what} in the repository")
    return problems


def readme_docs(readme: str) -> set[str]:
    """The files the README's Documentation table links, relative to the root."""
    start = readme.index("\n## Documentation\n")
    end = readme.find("\n## ", start + 1)
    table = readme[start : end if end >= 0 else None]
    return {
        posixpath.normpath(match["target"].strip("<>").partition("#")[0]) for match in LINK.finditer(table)
    }


@pytest.mark.parametrize("path", markdown_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_code_fences_are_closed(path: Path) -> None:
    problems = prose_lines(path.read_text())[1]
    assert not problems, f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_heading(path: Path) -> None:
    problems = link_problems(path)
    assert not problems, f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", markdown_files(), ids=lambda path: str(path.relative_to(ROOT)))
def test_named_repository_paths_exist(path: Path) -> None:
    problems = path_problems(path.read_text(), str(path.parent.relative_to(ROOT)))
    assert not problems, f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_readme_lists_every_doc() -> None:
    """A page of docs/ that the README's Documentation table leaves out is found only by
    whoever lists the folder."""
    pages = {str(path.relative_to(ROOT)) for path in markdown_files() if path.parent == ROOT / "docs"}
    missing = sorted(pages - readme_docs((ROOT / "README.md").read_text()))
    assert not missing, "README.md's Documentation table leaves out:\n" + "\n".join(missing)


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


def test_the_path_check_sees_what_it_is_for() -> None:
    """Repository paths are checked wherever a doc names them; what is not the repository's
    is not."""
    page = (
        "# Page\n\n```bash\nls speakerd/gone.py\n```\n\n"
        "`speakerd/model/audio.py`, `measurements/h100-*.jsonl`, `Makefile`, `bash .ci/run`,\n"
        "tests/conftest.py. `/path/to/model.bin`, `meeting.wav`, `.venv/bin/python`,\n"
        "`speakerd.pyannote`, `pip install speakerd`, `tests/test_x.py`, `speakerd/...`,\n"
        "`measurements/<gpu>-<commit>.jsonl`, https://example.com/tests/gone, `deploy/k8s/`\n"
        "`speakerd/model/gone.py:12`, (tests/gone.py), `measurements/h900-*.jsonl`, `Makefile.old`\n"
        "`../tests/serving.py` [link](../tests/test_docs.py) `../tests/gone.py` `cd ../other-checkout`\n"
    )
    assert path_problems(page, "docs") == [
        "line 11: speakerd/model/gone.py -> no such file or folder in the repository",
        "line 11: tests/gone.py -> no such file or folder in the repository",
        "line 11: measurements/h900-*.jsonl -> matches no file in the repository",
        "line 12: ../tests/gone.py -> no such file or folder in the repository",
    ], path_problems(page, "docs")
    readme = "# R\n\n## Documentation\n\n| a | [a](docs/a.md#x), [b](<docs/b.md>) |\n\n## Next\n[c](c.md)\n"
    assert readme_docs(readme) == {"docs/a.md", "docs/b.md"}, readme_docs(readme)
