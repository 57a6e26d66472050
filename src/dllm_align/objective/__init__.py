"""Stage 3, the objective: the likelihoods (``likelihood``: the interface; ``masked``, ``block``, ``uniform``: one
component per noise process; ``draws``: the deterministic draws they share; ``elbo``: the lookup by name and the
Monte Carlo ELBO every command calls, paper eq. elbo-l) and the objectives, one module each (``elbo_kto`` with
its baselines, ``vrpo`` over ``paired``'s pairs, ``sft``): the loss as a pure function of ELBO values, and what
the training loop asks of the objective (``base``: the ``Objective`` interface). ``components`` declares them
all by name (``dllm_align.config.components``); nothing here imports them.

May import: `core`, `config`, `data`, `models`.
"""
