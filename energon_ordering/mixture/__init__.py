"""Data mixtures that change over training: the schedule (a pure function of the step), draw
policies, and ``ScheduledBlendDataset``, which draws inside Energon with those weights.
"""
