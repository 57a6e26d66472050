"""Recipes: the typed schema of every section (model, data, reference, train, generate, judge, ablate,
evaluate), YAML loading with `extends`, `--set` overrides, validation errors with dotted paths, and the
provenance written into each run folder.

May import: `core`.
"""
