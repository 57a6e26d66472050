"""Stage 3, the objective: the Monte Carlo ELBO estimator with shared masks (`elbo`, paper eq. elbo-l) and the
losses, one module per objective (`elbo_kto` with its baselines, `vrpo`, `sft`; `base`: what they share), as pure functions of tensors.

May import: `core`, `config`, `data`, `models`.
"""
