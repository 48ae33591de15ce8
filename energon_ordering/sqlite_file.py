"""Opening sqlite files read-only, from any folder name.

sqlite opens a read-only file through a URI (``file:PATH?mode=ro``). Written as
``f"file:{path}?mode=ro"``, a folder name holding ``#``, ``?`` or ``%`` ends the path early or
changes it: ``/data/d#a/index.sqlite`` opens ``/data/d`` -- without ``mode=ro``, so sqlite
creates an empty file of that name next to the dataset and the real file is never read. Every
read-only sqlite open of the package goes through :func:`connect_readonly` (and an ``ATTACH``
through :func:`readonly_uri`), which percent-encodes the path.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

__all__ = ["connect_readonly", "readonly_uri", "sqlite_problem"]


def readonly_uri(path: str | os.PathLike[str]) -> str:
    """The sqlite URI that opens the file ``path`` read-only (``mode=ro``: never created).

    The path is made absolute (without resolving symlinks) and percent-encoded, so any folder
    or file name is taken literally.
    """
    return Path(os.path.abspath(path)).as_uri() + "?mode=ro"


def connect_readonly(
    path: str | os.PathLike[str], *, check_same_thread: bool = True
) -> sqlite3.Connection:
    """Opens the sqlite file ``path`` read-only; raises ``sqlite3.OperationalError`` if it does
    not exist (nothing is created). ``ATTACH`` more files with :func:`readonly_uri`."""
    return sqlite3.connect(readonly_uri(path), uri=True, check_same_thread=check_same_thread)


def sqlite_problem(path: str | os.PathLike[str]) -> str | None:
    """What is wrong with the sqlite file ``path`` (unreadable, not a database, or its
    ``PRAGMA quick_check`` fails), or None if it reads as a sound database."""
    try:
        con = connect_readonly(path)
        try:
            check = con.execute("PRAGMA quick_check").fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error as e:
        return str(e)
    return None if check == "ok" else f"integrity check: {check}"
