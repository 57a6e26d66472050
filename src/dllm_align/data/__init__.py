"""Stage 1, data: reading preference files in the layouts people have (`read`, `layouts`, `load`), paired ->
unpaired conversion and writing (`convert`), class imbalance (`imbalance`), statistics (`stats`), tokenising with
the chat template (`tokenize`), batch plans, padding and packing (`batching`), tokenised examples for training
(`examples`), the public kto-mix-14k test rows (`public`) and the bundled toy sorting task (`toy`).

May import: `core`, `config`.
"""
