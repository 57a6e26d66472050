"""Workflows that chain the stages: the whole method in one call (`pipeline`), the offline CPU demo (`demo`)
and the ablation sweeps (`ablate`).

May import: every stage package; never `cli`.
"""
