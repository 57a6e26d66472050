"""Stage 2, models: resolving and loading checkpoints and tokenizers (`load`), the mask-predictor interface
every stage calls (`predictor`: the scoring forward, packed rows, the chunked output head), the precision policy
(`precision`) and one module per model family (`families/`: config translation, weights, special ids).

May import: `core`, `config`, `data`.
"""
