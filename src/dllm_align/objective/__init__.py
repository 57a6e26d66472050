"""Stage 3, the objective: the likelihoods (``likelihood``: the interface; ``masked``, ``block``: one
component per noise process; ``draws``: the deterministic draws they share; ``elbo``: the registry by name
and the Monte Carlo ELBO every command calls, paper eq. elbo-l) and the objectives, one module each
(``elbo_kto`` with its baselines, ``vrpo``, ``sft``): the loss as a pure function of ELBO values, and what the
training loop asks of the objective (``base``: the ``Objective`` interface and its registry by name).

May import: `core`, `config`, `data`, `models`.
"""

# The built-in objectives register themselves by name (objective.base.get_objective finds them).
from dllm_align.objective import elbo_kto, sft, vrpo  # noqa: E402,F401
