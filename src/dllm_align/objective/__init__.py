"""Stage 3, the objective: the Monte Carlo ELBO estimator with shared masks (`elbo`, paper eq. elbo-l) and the
losses (`losses`: ELBO-KTO with its baselines, VRPO, SFT), as pure functions of tensors.

May import: `core`, `config`, `data`, `models`.
"""
