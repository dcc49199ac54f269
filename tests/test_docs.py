"""The documentation runs: every ```python block of README and the docs pages, every example, the site build.

Code blocks of one page run in order in one namespace, so a page reads like one script. A block
is skipped when the line just before its opening fence is ``<!-- skip -->`` (use sparingly, e.g.
for code that needs a download).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLES = ROOT / "examples"
SKIP_MARKER = "<!-- skip -->"
OPENING_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")

PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
EXAMPLE_SCRIPTS = sorted(EXAMPLES.glob("*.py"))


def _closes(line: str, fence: str) -> bool:
    """A closing fence: only the opening fence's character, at least as many times."""
    stripped = line.strip()
    return len(stripped) >= len(fence) and set(stripped) == {fence[0]}


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number of the first code line, dedented code) of each python block to run."""
    lines = text.splitlines()
    blocks = []
    index = 0
    while index < len(lines):
        match = OPENING_FENCE.match(lines[index])
        if match is None:
            index += 1
            continue
        indent, fence = match["indent"], match["fence"]
        info = match["info"].strip().split()
        language = info[0].lstrip("{.").rstrip("}") if info else ""
        skipped = index > 0 and lines[index - 1].strip() == SKIP_MARKER
        start = index + 1
        end = start
        while end < len(lines) and not _closes(lines[end], fence):
            end += 1
        if end == len(lines):
            raise AssertionError(f"unclosed code fence opened on line {index + 1}")
        if language in ("python", "py") and not skipped:
            body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[start:end]]
            blocks.append((start + 1, "\n".join(body) + "\n"))
        index = end + 1
    return blocks


def test_the_block_parser_finds_indented_blocks_and_honours_skip():
    page = "\n".join(
        [
            "```python",
            "a = 1",
            "```",
            "<!-- skip -->",
            "```python",
            "raise RuntimeError('skipped')",
            "```",
            "=== \"Tab\"",
            "",
            "    ```python",
            "    b = a + 1",
            "    ```",
            "```bash",
            "echo not python",
            "```",
        ]
    )
    assert python_blocks(page) == [(2, "a = 1\n"), (11, "b = a + 1\n")]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_docs_page_code_runs(page: Path):
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    if not blocks:
        pytest.skip("no python code blocks on this page")
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for line, code in blocks:
        # pad with newlines so tracebacks point at the line in the .md file
        try:
            exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)
        except Exception as error:  # name the page's line in the one-line summary CI keeps
            frames = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if frame.filename == str(page)]
            where = f"{page.relative_to(ROOT)}:{frames[-1] if frames else line}"
            raise AssertionError(f"{where}: {type(error).__name__}: {error}") from error


@pytest.mark.parametrize("script", EXAMPLE_SCRIPTS, ids=[p.name for p in EXAMPLE_SCRIPTS])
def test_example_runs(script: Path):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, str(script)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"{script.name} failed:\n{result.stdout}\n{result.stderr}"
    assert result.stdout.strip(), f"{script.name} printed nothing"


def test_there_are_examples_and_pages():
    assert EXAMPLE_SCRIPTS, "examples/*.py is empty"
    assert (DOCS / "index.md") in PAGES


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def test_mkdocs_build_strict(tmp_path: Path):
    tools = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
    missing = [name for name in tools if not _installed(name)]
    if missing:
        pytest.skip(f"docs tooling not installed ({', '.join(missing)}); pip install -e '.[docs]'")
    site = tmp_path / "site"
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)]
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    assert (site / "index.html").exists()
    assert (site / "reference" / "api" / "index.html").exists()
