"""Gives megatron-core 0.19.x's ``build_tokenizer`` the ``--tokenizer-model`` path for ``MultimodalTokenizer``.

Why: megatron-core 0.19.2's ``megatron/core/tokenizers/utils/build_tokenizer.py`` sets no
``tokenizer_path`` in its ``MultimodalTokenizer`` branch (every other branch sets it), so
``MegatronTokenizer.from_pretrained`` fails with ``AssertionError: Tokenizer path must be
specified.`` for Megatron-LM's own ``examples/multimodal`` flags (``--tokenizer-type
MultimodalTokenizer --tokenizer-model ...``): NVIDIA/Megatron-LM issue #3465, fixed upstream by
passing ``tokenizer_path = args.tokenizer_model`` in that branch. This shim supplies exactly that
one value when Megatron passes none for the ``multimodal`` library; Megatron's ``build_tokenizer``,
``MegatronTokenizer`` and ``MegatronMultimodalTokenizer`` run unmodified. Where the bug is fixed (or
on core 0.16, which builds the tokenizer elsewhere) it changes nothing. Test-only: never imported
by the package.
"""

from __future__ import annotations

from typing import Any


def install(tokenizer_model: str) -> bool:
    """Call before Megatron builds its tokenizer; returns whether core's build_tokenizer exists."""
    try:
        import megatron.core.tokenizers.utils.build_tokenizer as bt
    except ImportError:  # older megatron-core: the tokenizer is built by megatron.training
        return False
    real = bt.MegatronTokenizer
    if getattr(real, "_energon_ordering_path_shim", False):
        return True

    class _WithPath(real):  # type: ignore[misc, valid-type]
        _energon_ordering_path_shim = True

        @staticmethod
        def from_pretrained(tokenizer_path: Any = None, metadata_path: Any = None, **kwargs: Any) -> Any:
            if not tokenizer_path and isinstance(metadata_path, dict) and metadata_path.get("library") == "multimodal":
                tokenizer_path = tokenizer_model
            return real.from_pretrained(tokenizer_path=tokenizer_path, metadata_path=metadata_path, **kwargs)

    bt.MegatronTokenizer = _WithPath
    return True
