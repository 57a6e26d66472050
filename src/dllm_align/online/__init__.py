"""Online labelling: sample the policy's own completions and label each one desirable or not with a
verifier (`verifiers`: the components of kind verifier, declared in `components`, or your `module:function`), giving the
unpaired rows ELBO-KTO trains on (`label`). Rounds of labelling and training are
`dllm_align.workflows.online` (the `online` command), which calls this package (docs/design.md#online-rounds).

May import: `core`, `config`, `data`, `models`, `generate`, `judge`.
"""
