"""What a run reports: the margin watch, the run's result record, the trackers' flat config.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np


@dataclass
class MarginWatch:
    """Warn when the desirable class's mean margin keeps falling (likelihood displacement: docs/design.md#class-weights).

    The per-step desirable margins are averaged over windows of ``window``
    steps; three consecutive falling windows ending below zero trigger one
    warning (again only after a new fall of three windows).
    """

    window: int
    current: list = field(default_factory=list)
    means: list = field(default_factory=list)
    warned_at: int = -1

    def add(self, step: int, desirable_margin: Optional[float]) -> Optional[str]:
        if desirable_margin is None or not math.isfinite(desirable_margin):
            return None
        self.current.append(desirable_margin)
        if len(self.current) < self.window:
            return None
        self.means.append(float(np.mean(self.current)))
        self.current = []
        m = self.means
        if len(m) >= 4 and m[-1] < m[-2] < m[-3] < m[-4] and m[-1] < 0 and len(m) - self.warned_at >= 3:
            self.warned_at = len(m)
            return (
                f"step {step}: the desirable rows' mean margin has fallen for 3 windows of {self.window} steps "
                f"({m[-4]:+.3g} -> {m[-1]:+.3g}); both classes may be pushed down (likelihood displacement). "
                "Consider a lower train.lr or a smaller train.lambda_undesirable."
            )
        return None

    def state(self) -> dict:
        return {"window": self.window, "current": self.current, "means": self.means, "warned_at": self.warned_at}

    @classmethod
    def from_state(cls, d: dict, window: int) -> "MarginWatch":
        if d.get("window") != window:
            return cls(window)
        return cls(window, list(d["current"]), list(d["means"]), int(d["warned_at"]))


@dataclass
class TrainResult:
    output_dir: Path
    final_dir: Path
    steps: int
    seconds: float
    examples: int
    last_metrics: dict

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else float("nan")

    @property
    def examples_per_second(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else float("nan")


def flat_config(d: dict, prefix: str = "") -> dict:
    """``d`` flattened to dotted keys of scalars for the trackers (None as "null", anything else as JSON)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_config(v, key + "."))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v if v is not None else "null"
        else:
            out[key] = json.dumps(v)
    return out


def status_line(parts: list[str], lr: float, tok_s: float) -> str:
    """A step's progress line: the objective's parts, then the learning rate and the throughput."""
    return " | ".join([*parts, f"lr {lr:.2e}", f"{tok_s:,.0f} tok/s"])
