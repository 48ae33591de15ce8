"""Length indexes: per-sample lengths stored next to a prepared dataset (``index``), built by
running a task encoder or raw length function over every sample (``build``), and the generic
length estimate (``estimate``).
"""
