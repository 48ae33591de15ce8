#!/usr/bin/env python
"""Build the length index of a prepared dataset (or of every dataset in a metadataset).

The lean pool (``length_sort_placement: pre-encode``) sorts by lengths known before decoding.
This runs your task encoder (or a raw length function) over every sample once, with a progress
bar, and writes ``<dataset>/.nv-meta/energon_ordering_lengths.<what computed it>.sqlite`` (or
under ``--index-dir``), tied to the dataset's ``index.uuid`` (a stale index is refused). Same as
``energon-ordering index``.

Examples:
    python tools/build_length_index.py /data/llava_pretrain --task-encoder my_pkg.te:MyTaskEncoder
    python tools/build_length_index.py /data/metadataset.yaml --tokens-per-media 576 --workers 8
"""

from energon_ordering.cli.index import command as index

if __name__ == "__main__":
    index(prog_name="build_length_index.py")
