"""The command line's one-line note for the pipeline's index-encoder warnings, in both of the
warning's forms: the index command for an importable encoder, and the Python API
``build_length_index`` for an encoder defined in the script that runs (``__main__``, which no
``--task-encoder MODULE:CLASS`` can import; issue 33)."""

from __future__ import annotations

import warnings

import pytest

from energon_ordering.cli.index_encoder_note import MISMATCH, index_encoder_note

HEAD = ("length index /data/web/.nv-meta/length_index.sqlite was computed by task encoder "
        "est.Estimate, not by task encoder {mine}; the pool sorts by those lengths. For exact "
        "lengths build one ")
FORMS = {
    "command": HEAD.format(mine="my_pkg.TE") + "with `energon-ordering index /data/web "
               "--task-encoder my_pkg:TE` (it is kept next to the others, named after what "
               "computed it).",
    "python": HEAD.format(mine="__main__.TE") + "in your training script with "
              "`energon_ordering.build_length_index('/data/web', task_encoder=TE())` (an encoder "
              "defined in the script that runs cannot be imported by the command line).",
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_both_forms_of_the_warning_are_read(form):
    m = MISMATCH.match(FORMS[form])
    assert m is not None and m["dataset"] == "/data/web"
    assert m["by"] == "task encoder est.Estimate"


@pytest.mark.parametrize("form", sorted(FORMS))
def test_both_forms_become_one_note_line(form, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning the note did not take would raise here
        with index_encoder_note("/data/web", "my_pkg:TE"):
            warnings.warn(FORMS[form], UserWarning, stacklevel=1)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("note: 1 dataset(s) of /data/web have length "
                                               "indexes computed by Estimate")
