"""Online labelling: sample the policy's own completions and label each one desirable or not with a
verifier (`verifiers`: the toy sort rule, `math_answer`, `regex:`, or your `module:function`), giving the
unpaired rows ELBO-KTO trains on (`label`). Training in rounds on such rows is issue 25's next step.

May import: `core`, `config`, `data`, `models`, `generate`, `judge`.
"""
