"""Serving: `dllm-align serve`, an OpenAI-compatible server over the in-process samplers of every family
(`engine`: the model, the request queue and its micro-batching worker; `api`: the HTTP routes, request checks and
error shapes), the client backend `generate.backend: openai` that generates through any OpenAI-compatible
server (`engines`: what each engine takes per request, fixes at launch or cannot honour; `client`: the backend),
and `dllm-align parity`, the same prompts through two backends compared (`parity`).

May import: `core`, `config`, `data`, `models`, `generate`, `judge`, `online`.
"""
