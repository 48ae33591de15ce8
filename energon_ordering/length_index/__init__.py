"""Length indexes: per-sample lengths stored next to a prepared dataset (``index``), built by
running a task encoder or raw length function over every sample (``build``), and the generic
length estimate (``estimate``).

Distributed and incremental builds: ``launcher`` (torchrun's and srun's variables),
``distributed`` (rendezvous, shared progress, the merge's barrier), ``shard_split`` (shards per
process), ``shard_digest`` (a shard file's identity), ``parts`` (a process's part file),
``shard_build`` (measure, write parts, merge) and ``reuse`` (lengths kept after ``energon
prepare``).

Exact lengths without decoding: ``image_header`` reads an image's size from its header (JPEG,
PNG, WebP, GIF; what ``PIL.Image.open(...).size`` reports), ``media_tokens`` turns a size into
the tokens it expands to for LLaVA-1.5, LLaVA-NeXT, InternVL and Qwen2-VL / Qwen2.5-VL (exact
against transformers), and ``header_length`` composes both with a caption's tokens into raw
length functions for ``energon-ordering index --raw-length-fn``.
"""
