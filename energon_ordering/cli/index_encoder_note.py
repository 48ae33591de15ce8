"""One short line instead of a long warning per dataset when a command's task encoder is not the
one that computed the length indexes it sorts by.

A pre-encode or planned pipeline warns, for every dataset and every pipeline it builds, that
the dataset's length index was computed by another task encoder than the loader's
(``OrderingTaskEncoder._ordering_length_source``). On the command line that is expected when
no ``--task-encoder`` is given: the commands then estimate lengths only where there is no index,
and a run sorts by the index's lengths, so nothing is printed. With ``--task-encoder`` it is a
real mismatch, said once per command in one line naming the encoders, the datasets and the fix.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator

import click

__all__ = ["MISMATCH", "index_encoder_note", "mismatch_line"]

#: The pipeline's warning (energon_ordering/task_encoder.py): index path, its encoder, the
#: loader's encoder, the dataset folder. It advises the index command, or, for an encoder defined
#: in the script that runs (``__main__``, which no command line can import), the Python API
#: ``energon_ordering.build_length_index('<dataset>', task_encoder=...)``.
MISMATCH = re.compile(r"length index (?P<index>.+?) was computed by (?P<by>.+?), not by "
                      r"(?P<mine>.+?); .*`(?:energon-ordering index |energon_ordering\.build_length_index\(')"
                      r"(?P<dataset>[^\s']+)")


def mismatch_line(path: str, found: dict[str, tuple[str, str]],
                  task_encoder: str | None) -> str | None:
    """The one line for ``{dataset folder: (computed by, loader's encoder)}`` of the command's
    dataset ``path``; None when there is nothing to say (no mismatch, or no ``--task-encoder``:
    the estimate is expected to differ)."""
    if not found or task_encoder is None:
        return None
    by = ", ".join(sorted({b.rsplit(".", 1)[-1] for b, _ in found.values()}))
    return (f"note: {len(found)} dataset(s) of {path} have length indexes computed by {by}, not "
            f"by --task-encoder {task_encoder}, and the runs sort by those; for yours: "
            f"`energon-ordering index {path} --task-encoder {task_encoder}`.")


@contextlib.contextmanager
def index_encoder_note(path: str, task_encoder: str | None) -> Iterator[None]:
    """Collects the pipeline's index-encoder warnings while the body runs on the dataset
    ``path`` (any other warning is shown as usual, once) and prints :func:`mismatch_line` to
    stderr at the end."""
    found: dict[str, tuple[str, str]] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", message="length index .* was computed by ")
        try:
            yield
        finally:
            shown = set()
            for w in caught:
                m = MISMATCH.match(str(w.message))
                if m is not None:
                    found.setdefault(m["dataset"], (m["by"], m["mine"]))
                elif (key := (str(w.message), w.category, w.filename, w.lineno)) not in shown:
                    shown.add(key)
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    line = mismatch_line(path, found, task_encoder)
    if line:
        click.echo(line, err=True)
