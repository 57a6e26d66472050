"""The built-in components this package implements, declared for ``dllm_align.config.components``.

Torch-free: only declarations (names, settings, ignored keys, checks, targets); the implementations load when
a command first uses them.
"""

from __future__ import annotations
