"""Every code block of README.md and docs/*.md runs as written (issue 34).

Each page is one test: its python blocks share a namespace, its bash blocks run in the same
fresh folder, its yaml blocks are read as recipes (tests/doc_snippets.py says how, and how a
block is marked as not run). The hosts' pages (docs/megatron-lm.md, docs/megatron-bridge.md)
are run against the real hosts by their own tests.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import energon_ordering

from doc_snippets import HOST_PAGES, REPO, SnippetError, parse_blocks, run_page, snippet_pages


@pytest.mark.parametrize("page", snippet_pages(), ids=lambda p: p.name)
def test_page_runs_as_written(page: Path, tmp_path: Path) -> None:
    run_page(page, tmp_path)


def test_pages_cover_readme_and_docs() -> None:
    names = {p.name for p in snippet_pages()}
    assert "README.md" in names
    assert {"index.md", "getting-started.md", "concepts.md"} <= names
    assert not names & HOST_PAGES


def test_every_page_runs_code() -> None:
    """The README and the guide run real blocks: a page whose blocks all went unrun would pass
    silently."""
    for name in ("README.md", "getting-started.md"):
        page = REPO / name if name == "README.md" else REPO / "docs" / name
        run = [b for b in parse_blocks(page) if b.skip_reason is None and b.language in ("python", "bash")]
        assert len(run) >= 2, name


def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    return page


@pytest.mark.parametrize("marker", ["<!-- snippet: skip -->", "<!-- snippet: skip ( ) -->"],
                         ids=["bare", "empty"])
def test_skip_without_reason_fails(tmp_path: Path, marker: str) -> None:
    page = _page(tmp_path, f"{marker}\n```bash\nexit 1\n```\n")
    with pytest.raises(SnippetError, match=r"page\.md:1: 'snippet: skip.*' has no reason"):
        parse_blocks(page)


def test_skip_with_reason_is_not_run(tmp_path: Path) -> None:
    page = _page(tmp_path, "<!-- snippet: skip (needs 8 GPUs) -->\n\n```bash\nexit 1\n```\n")
    (folder := tmp_path / "run").mkdir()
    assert run_page(page, folder) == []


@pytest.mark.parametrize(("language", "code", "match"), [
    ("python", "raise ValueError('as written')", r"page\.md:3: python block raised ValueError: as written"),
    ("bash", "echo out; false", r"page\.md:3: bash block exited 1"),
    ("yaml", "length_sort_mode: batches", r"page\.md:3: yaml block is not a valid recipe: .*batches"),
], ids=["python", "bash", "yaml"])
def test_a_failing_block_fails_the_page(tmp_path: Path, language: str, code: str, match: str) -> None:
    page = _page(tmp_path, f"Text.\n\n```{language}\n{code}\n```\n")
    (folder := tmp_path / "run").mkdir()
    with pytest.raises(SnippetError, match=match):
        run_page(page, folder)


def test_blocks_share_a_namespace_and_folder(tmp_path: Path) -> None:
    page = _page(tmp_path, (
        "<!-- snippet: file r.yaml -->\n```yaml\nlength_sort_pool_size: 8\n```\n"
        "```python\nx = open('r.yaml').read()\n```\n"
        "- a list item:\n\n  ```python\n  assert x.startswith('length_sort_pool_size')\n  ```\n"
        "```bash\ntest -f r.yaml && test -d tools && test -d recipes\n```\n"
        "```\nnot code\n```\n"
    ))
    (folder := tmp_path / "run").mkdir()
    assert [b.language for b in run_page(page, folder)] == ["yaml", "python", "python", "bash"]


@pytest.mark.parametrize(("text", "match"), [
    ("```console\n$ ls\n```\n", "block language 'console' is neither run"),
    ("<!-- snippet: run twice -->\n```bash\ntrue\n```\n", "unknown marker"),
    ("<!-- snippet: skip (why) -->\nA paragraph.\n```bash\ntrue\n```\n", "no block follows this marker"),
    ("```python\nx = 1\n", "not closed"),
], ids=["language", "unknown-marker", "stranded-marker", "unclosed"])
def test_malformed_pages_fail(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(SnippetError, match=match):
        parse_blocks(_page(tmp_path, text))


def test_api_page_documents_every_public_name() -> None:
    documented = set(re.findall(r"energon_ordering\.(\w+)$", (REPO / "docs" / "api.md").read_text(), re.M))
    assert set(energon_ordering.__all__) - {"__version__"} <= documented


def _tracked_modules(package: Path) -> list[Path]:
    """The package's modules in git (a module being written in the work tree is not yet due)."""
    try:
        out = subprocess.run(["git", "ls-files", "*.py"], cwd=package, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return sorted(package.rglob("*.py"))
    return sorted(package / line for line in out.splitlines())


def test_layout_page_lists_every_module() -> None:
    """docs/layout.md's tree names every module of the package (the README's fell behind)."""
    text = (REPO / "docs" / "layout.md").read_text()
    tree = text[text.index("```\nenergon_ordering/"):]
    words = set(re.findall(r"[\w.]+", tree[: tree.index("\n```", 4)]))
    package = REPO / "energon_ordering"
    missing = [str(p.relative_to(package)) for p in _tracked_modules(package)
               if p.stem not in ("__init__", "__main__") and p.stem not in words and p.name not in words]
    assert not missing, f"docs/layout.md does not list {missing}: add each to its folder's line of the tree"


def test_readme_links_resolve() -> None:
    """The README is not part of the Sphinx build, so its links to the docs are checked here."""
    text = (REPO / "README.md").read_text()
    links = [target.split("#")[0] for target in re.findall(r"\]\(([^)\s]+)\)", text)
             if "://" not in target]
    assert links
    assert [t for t in links if t and not (REPO / t).exists()] == []


def test_readme_has_one_test_command() -> None:
    """.ci/run runs the first README line matching '^pip install .*pytest': keep exactly one."""
    lines = [ln for ln in (REPO / "README.md").read_text().splitlines()
             if re.match(r"^pip install .*pytest", ln)]
    assert len(lines) == 1 and "-m slow" not in lines[0], lines


def test_readme_is_short() -> None:
    """The README says what, how to start and where to read on; the rest lives in docs/."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 200
