"""Stage 4, training: the reference precompute and its cache (`reference`), the run setup (`setup`:
accelerator, optimiser, FSDP wrapping, clipping), the one training loop for every objective (`loop`), checkpoints
and resume (`checkpoint`), the memory model (`memory`) and the GPU preflight (`doctor`).

May import: `core`, `config`, `data`, `models`, `objective`.
"""
