"""Runs the code blocks of README.md and docs/*.md as written (tests/test_docs_snippets.py).

A page's blocks run in order, in one fresh folder that holds links to the checkout's ``tools/``
and ``recipes/`` (so a block reads as if run from the checkout's root):

- ``python``: executed in-process, every block of a page in one module namespace;
- ``bash``: ``bash -euo pipefail -c BLOCK`` in the folder (the checkout first on PYTHONPATH);
- ``yaml``: a recipe, read with ``OrderingConfig.from_yaml``;
- no language, or ``text``: a diagram or output, not run; MyST directives (```` ```{toctree} ````)
  are not code either.

An HTML comment on the line before a block (blank lines may stand between) changes that:

- ``<!-- snippet: skip (reason) -->``: not run; the reason is required (installs, torchrun, a GPU);
- ``<!-- snippet: file NAME -->``: the block is written to NAME in the folder, for a later block.

Any other language, a marker without a reason, an unknown marker and a marker that no block
follows fail the page, as does a block that fails as written.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

#: Pages whose blocks run against the real hosts (the host engineer's tests), not here.
HOST_PAGES = frozenset({"megatron-lm.md", "megatron-bridge.md"})

#: Languages that are run, and those that are shown only.
RUN_LANGUAGES = frozenset({"python", "bash", "yaml"})
SHOWN_LANGUAGES = frozenset({"", "text"})

#: A bash block may take this long (seconds) before it fails the page.
BASH_TIMEOUT_S = 300

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_MARKER = re.compile(r"^\s*<!--\s*snippet:(?P<body>.*?)-->\s*$")
_SKIP = re.compile(r"^skip\s*\((?P<reason>.*)\)$")
_FILE = re.compile(r"^file\s+(?P<name>[\w./-]+)$")


class SnippetError(Exception):
    """A page's block failed as written, or its markers are malformed."""


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page.

    Attributes:
        page: The page's path.
        line: 1-based line of the opening fence.
        language: The info string's first word ("" for none).
        code: The block's text, dedented by the fence's indentation.
        skip_reason: Why it is not run (``<!-- snippet: skip (reason) -->``), else None.
        file_name: Where it is written instead of run (``<!-- snippet: file NAME -->``), else None.
    """

    page: Path
    line: int
    language: str
    code: str
    skip_reason: str | None = None
    file_name: str | None = None

    @property
    def where(self) -> str:
        """``page:line`` for messages."""
        return f"{self.page.name}:{self.line}"


def snippet_pages() -> list[Path]:
    """README.md and every docs/*.md page except the hosts' pages, in a stable order."""
    docs = sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in HOST_PAGES)
    return [REPO / "README.md", *docs]


def _parse_marker(body: str, where: str) -> tuple[str | None, str | None]:
    """(skip reason, file name) of a marker's text."""
    body = body.strip()
    skip = _SKIP.match(body)
    if skip:
        reason = skip.group("reason").strip()
        if not reason:
            raise SnippetError(f"{where}: 'snippet: skip ()' has no reason; write "
                               "'<!-- snippet: skip (why it is not run) -->'.")
        return reason, None
    if body == "skip":
        raise SnippetError(f"{where}: 'snippet: skip' has no reason; write "
                           "'<!-- snippet: skip (why it is not run) -->'.")
    file = _FILE.match(body)
    if file:
        return None, file.group("name")
    raise SnippetError(f"{where}: unknown marker 'snippet: {body}'; use 'skip (reason)' or "
                       "'file NAME'.")


def parse_blocks(page: Path, text: str | None = None) -> list[Block]:
    """The fenced code blocks of ``page`` (its text, or ``text``), with their markers.

    Raises:
        SnippetError: A marker is malformed or no block follows it, a block is not closed, or a
            block's language is neither run nor shown.
    """
    lines = (page.read_text(encoding="utf-8") if text is None else text).splitlines()
    blocks: list[Block] = []
    marker: tuple[int, str | None, str | None] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        found = _MARKER.match(line)
        if found:
            if marker is not None:
                raise SnippetError(f"{page.name}:{marker[0]}: no block follows this marker.")
            marker = (i + 1, *_parse_marker(found.group("body"), f"{page.name}:{i + 1}"))
            i += 1
            continue
        fence = _FENCE.match(line)
        if not fence:
            if line.strip() and marker is not None:
                raise SnippetError(f"{page.name}:{marker[0]}: no block follows this marker "
                                   f"(line {i + 1} comes first).")
            i += 1
            continue
        indent, mark = fence.group("indent"), fence.group("fence")
        info = fence.group("info").strip()
        end = i + 1
        while end < len(lines) and not (
            lines[end].strip().startswith(mark) and not lines[end].strip().strip(mark[0])
        ):
            end += 1
        if end == len(lines):
            raise SnippetError(f"{page.name}:{i + 1}: the block opened here is not closed.")
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:end]]
        language = "" if info.startswith("{") else (info.split() or [""])[0].lower()
        directive = info.startswith("{")
        if not directive and language not in RUN_LANGUAGES | SHOWN_LANGUAGES:
            raise SnippetError(f"{page.name}:{i + 1}: block language {language!r} is neither run "
                               f"({', '.join(sorted(RUN_LANGUAGES))}) nor shown (text, none).")
        if not directive:
            skip_reason, file_name = (marker[1], marker[2]) if marker else (None, None)
            blocks.append(Block(page, i + 1, language, "\n".join(body) + "\n", skip_reason, file_name))
        elif marker is not None:
            raise SnippetError(f"{page.name}:{marker[0]}: a marker before a directive.")
        marker = None
        i = end + 1
    if marker is not None:
        raise SnippetError(f"{page.name}:{marker[0]}: no block follows this marker.")
    return blocks


def _bash_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["MPLBACKEND"] = "Agg"
    return env


def _run_bash(block: Block, folder: Path) -> None:
    try:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=folder,
                              env=_bash_env(), capture_output=True, text=True,
                              timeout=BASH_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        raise SnippetError(f"{block.where}: bash block still running after {BASH_TIMEOUT_S} s.") from e
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
        raise SnippetError(f"{block.where}: bash block exited {done.returncode}:\n{block.code}\n"
                           f"--- output (last lines) ---\n{tail}")


def _run_python(block: Block, module: types.ModuleType) -> None:
    code = compile(block.code, f"{block.page.name}:{block.line}", "exec")
    try:
        exec(code, module.__dict__)  # noqa: S102 - the page's own code, run as written
    except Exception as e:
        raise SnippetError(f"{block.where}: python block raised {type(e).__name__}: {e}") from e


def _run_yaml(block: Block, folder: Path) -> None:
    from energon_ordering import OrderingConfig

    path = folder / f"_recipe_line{block.line}.yaml"
    path.write_text(block.code, encoding="utf-8")
    try:
        OrderingConfig.from_yaml(path)
    except Exception as e:
        raise SnippetError(f"{block.where}: yaml block is not a valid recipe: {e}") from e


def run_page(page: Path, folder: Path, text: str | None = None) -> list[Block]:
    """Runs every block of ``page`` in order in ``folder``; returns the blocks run.

    Raises:
        SnippetError: A block failed as written, or the page's markers are malformed.
    """
    blocks = parse_blocks(page, text)
    for name in ("tools", "recipes"):
        link = folder / name
        if not link.exists():
            link.symlink_to(REPO / name, target_is_directory=True)
    module = types.ModuleType("snippets_" + re.sub(r"\W", "_", page.stem))
    module.__file__ = str(folder / f"{page.stem}_snippets.py")
    sys.modules[module.__name__] = module
    cwd = Path.cwd()
    ran: list[Block] = []
    try:
        os.chdir(folder)
        for block in blocks:
            if block.skip_reason is not None or block.language in SHOWN_LANGUAGES:
                continue
            if block.file_name is not None:
                (folder / block.file_name).parent.mkdir(parents=True, exist_ok=True)
                (folder / block.file_name).write_text(block.code, encoding="utf-8")
            elif block.language == "python":
                _run_python(block, module)
            elif block.language == "bash":
                _run_bash(block, folder)
            else:
                _run_yaml(block, folder)
            ran.append(block)
    finally:
        os.chdir(cwd)
        sys.modules.pop(module.__name__, None)
    return ran
