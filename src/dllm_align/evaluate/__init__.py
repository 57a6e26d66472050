"""Stage 7, downstream evaluation: the lm-evaluation-harness adapter (`harness`) and the task plans, runs and
comparison tables of the `evaluate` command (`run`).

May import: `core`, `config`, `data`, `models`, `objective`, `generate`.
"""
