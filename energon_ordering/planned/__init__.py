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
- :mod:`.lpt`: longest-processing-time dealing in tuples, the last step of every layout;
- :mod:`.mix`: ``planned_mix``, where the blend's weights hold exactly (per step or per window);
- :mod:`.window_mix`: ``planned_mix="window"``: a window's samples banded by length over its
  steps (the schedule's zeros and the warmup's caps per step; a sample that fits no step waits
  in the cursor);
- :mod:`.window_mix_buffer`: the same plan built in the memory of its output (whole lengths);
- :mod:`.window`: the plan of one window of steps, composing the above;
- :mod:`.epoch_end`: where a finite epoch ends, per mix granularity;
- :mod:`.window_size`: how many steps a window holds when ``plan_window_steps`` is not given
  (the step mix about 2^19 samples in 32-128 steps; the window mix about 2^20 samples);
- :mod:`.packs`: with sequence packing, each step's packs built to its cap, the ranks balanced
  by the packs' attention cost, the per-step mix exact for the step's sample count;
- :mod:`.window_packs`: the same with ``planned_mix="window"``: a window's packs built from the
  window's draws, banded to steps;
- :mod:`.plan_check`: a plan read from a node-shared file holds exactly its window's samples
  (either mix) before it is trusted;
- :mod:`.saved_state`: a saved state of the planned source checked before use.
"""
