"""Sequence-length warmup: the schedule (a pure function of the step), the token layout that
says what may be cut, and ``SeqLenWarmupDataset``, which caps lengths at batch time.
"""
