"""The docs read as task pages: small, opened by who they are for, short paragraphs, links that resolve, and
every block of commands either run by a test or marked with why it is not (a GPU, a cluster, its time).

Pure text checks: each fails naming the page and the line. Break one (a 151-word paragraph, a link to a
heading that is gone, a block without its comment) and the test names it. "See tests/..." is no reason: a
block marked `not run verbatim by the tests: see tests/gpt/test_x.py::name` fails (tried), since a test that
runs something like it is not one that runs it as written.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *DOCS]
PAGE_BYTES = 20_000
ALL_DOCS_BYTES = 110_000
README_LINES = 130
# Above a block of commands: a test that runs it as written (and reads the page), or why none does.
RUN_BY = re.compile(r"<!-- (tests/\w+/test_\w+\.py) runs .*-->")
NOT_RUN = re.compile(
    r"<!-- not run verbatim by the tests: (needs a GPU|needs a cluster|needs two machines"
    r"|(about|over) \d+ min)[^>]*-->"
)
COMMANDS = {"sh", "bash", "shell", "console"}


def rel(path):
    return path.relative_to(REPO).as_posix()


def blocks(text):
    """(line number, language, previous non-blank line) of each fenced block, and the lines outside them."""
    found, outside, fence, previous = [], [], None, ""
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if fence is None:
                fence = line[3:].strip()
                found.append((number, fence, previous))
            else:
                fence = None
            continue
        if fence is None:
            outside.append((number, line))
            if line.strip():
                previous = line.strip()
    return found, outside


def slug(heading):
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    seen = {}
    for _, line in blocks(path.read_text())[1]:
        if line.startswith("#"):
            base = slug(line.lstrip("#"))
            count = seen.get(base, 0)
            seen[base] = count + 1
            yield base if count == 0 else f"{base}-{count}"


def test_the_docs_fit_in_110_kb_and_no_page_is_over_20_kb():
    sizes = {rel(page): len(page.read_bytes()) for page in DOCS}
    assert {page: size for page, size in sizes.items() if size > PAGE_BYTES} == {}
    assert sum(sizes.values()) <= ALL_DOCS_BYTES, sizes


def test_the_readme_is_a_landing_page_that_names_the_test_command():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_LINES
    # .ci/run calls the test command the README gives
    assert "make test" in text and "make test" in (REPO / ".ci" / "run").read_text()


@pytest.mark.parametrize("page", DOCS, ids=rel)
def test_a_page_opens_with_who_it_is_for_in_three_lines(page):
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# "), lines[0]
    opening = []
    for line in lines[2:]:
        if not line.strip():
            break
        opening.append(line)
    assert 1 <= len(opening) <= 3 and not opening[0].startswith(("#", "```", "|", "-")), opening


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_no_paragraph_over_150_words_and_no_bullet_over_6_lines(page):
    long = []
    chunk = []
    for number, line in [*blocks(page.read_text())[1], (0, "")]:
        item = re.match(r"\s*([-*]|\d+\.) ", line)
        ends = not line.strip() or line.startswith(("#", "|", "<!--")) or item
        if ends and chunk:
            words = sum(len(text.split()) for _, text in chunk)
            is_item = re.match(r"\s*([-*]|\d+\.) ", chunk[0][1])
            if (is_item and len(chunk) > 6) or (not is_item and words > 150):
                long.append(f"line {chunk[0][0]}: {len(chunk)} lines, {words} words")
            chunk = []
        if line.strip() and not line.startswith(("#", "|", "<!--")):
            chunk.append((number, line))
    assert long == []


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_block_has_a_language_and_is_run_or_says_why(page):
    """Every block has a language and every block of commands is run or says why."""
    text = page.read_text()
    wrong = []
    for number, language, previous in blocks(text)[0]:
        if not language:
            wrong.append(f"line {number}: a block without a language (commands: sh; output: text)")
            continue
        if language not in COMMANDS:
            continue
        run_by = RUN_BY.fullmatch(previous)
        if run_by:
            test = REPO / run_by.group(1)
            if not test.exists() or page.name not in test.read_text():
                wrong.append(f"line {number}: {run_by.group(1)} does not read {page.name}")
        elif not NOT_RUN.fullmatch(previous):
            wrong.append(f"line {number}: no comment above saying which test runs it, or why none does")
    assert wrong == []


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for number, line in blocks(page.read_text())[1]:
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"line {number}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in set(anchors(linked)):
                broken.append(f"line {number}: {target} (no such heading)")
    assert broken == []
