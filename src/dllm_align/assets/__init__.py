"""Trained artefacts shipped with the package (the demo's base model)."""
