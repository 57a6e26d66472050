"""Stage 5, generation: sampler settings and the LLaDA block sampler with its fast KV-cache mode (`sampler`),
Dream's published sampler rule (`dream`), and the `generate` command's orchestration over files, ranks and resume
(`run`).

May import: `core`, `config`, `data`, `models`.
"""
