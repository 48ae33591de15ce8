"""The length pool: pure pool orders, their settings, and the Energon stages that apply them.

``order`` (pure functions: lengths, seed -> order), ``settings`` (validated pool settings, state
stamp), ``length_pool_sort`` (pool of encoded samples), ``key_pool_sort`` (lean pool of restore keys
and lengths), ``deferred_load`` (loading split off the sources, run after a pre-encode pool),
``packed_sample``, ``sample_length``, ``restorability``.
"""
