"""Measuring an order: diagnostics, rank simulation on real Energon pipelines, inspection and
resume checks, plots, pool memory, and the synthetic datasets and task encoders used by the
demo, the benchmarks and the tests.
"""
