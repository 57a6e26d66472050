"""Stage 3, the objective: the likelihoods (``likelihood``: the interface; ``masked``, ``block``: one
component per noise process; ``draws``: the deterministic draws they share; ``elbo``: the registry by name
and the Monte Carlo ELBO every command calls, paper eq. elbo-l) and the losses (``losses``: ELBO-KTO with
its baselines, VRPO, SFT), as pure functions of tensors.

May import: `core`, `config`, `data`, `models`.
"""
