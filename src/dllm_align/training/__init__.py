"""Stage 4, training: the reference precompute and its cache (`reference`, `cache`), the run's plan (`plan`: the
values derived once from the recipe and launch), the policy loaded, wrapped and given its optimiser (`policy`), the
launch (`distributed`), the optimisation (`optim`: schedule, AdamW, clipping), the one training step for every
objective (`loop`), `train` (the run read top to bottom: setup steps, the step loop, the export), checkpoints and
resume (`checkpoint`), what a run reports (`monitor`), the memory model (`memory`) and the GPU preflight (`doctor`).

May import: `core`, `config`, `data`, `models`, `objective`.
"""
