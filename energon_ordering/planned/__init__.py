"""The planned global order (``length_sort_mode: planned``, issue 23): pure functions only.

Every rank and loader worker computes the same plan of the global order from global
information (the sources' lengths, the seed, the schedule), with no communication
(DESIGN.md, contract 11). The modules, bottom up:

- :mod:`.permutation`: a keyed permutation of ``range(n)`` per (seed, source, source epoch),
  evaluable and invertible at any index in O(1) memory;
- :mod:`.sample_ids`: global sample ids (a flat id over the sources, with offsets);
- :mod:`.cursor`: which draws of each source a window uses, from the per-step counts;
- :mod:`.balance`: a window's drawn samples -> steps x ranks x micro-batches, exact per-step
  source counts, balanced ranks, little padding;
- :mod:`.window`: the plan of one window of steps, composing the above;
- :mod:`.packs`: with sequence packing, each step's packs built to its cap, the ranks balanced
  by the packs' attention cost, the per-step mix exact for the step's sample count.
"""
