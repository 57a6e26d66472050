"""``dllm-align parity``: the same prompts, settings and seeds through the in-process backend (the reference)
and the recipe's ``generate.backend`` (a served engine), and a verdict on whether the engine decodes what the
trainer would.

Checks, each a named reason when it fails:

- *serves another model*: both sides report a weights fingerprint and they differ;
- *greedy*: at temperature 0 the token-exact match rate of the completions (the first divergent position of
  each mismatch is recorded) must reach ``min_match``;
- *greedy-only*: at temperature > 0 every prompt's ``samples`` seeds give one completion on the engine while the
  reference gives several (the engine ignores the temperature: an online round would learn nothing);
- *ignores seeds*: the same request twice gives two completions, or (unless the backend takes unseeded samples,
  ``accept_unseeded``) the seeded samples do not match the reference's token for token;
- *distributions*: at temperature > 0 the completion lengths (and, with a verifier, the pass rates) of the two
  sides are compared by a two-sided permutation test on the difference of means; a p-value below ``alpha``
  fails.

The record (``parity.json`` in the run folder) holds both sides' backend, served folder and fingerprint, the
settings, every figure and the verdict; ``online`` on a served backend reads it (:func:`check_record`).
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Optional, Sequence

from dllm_align.core.console import info, warn
from dllm_align.core.errors import UserError
from dllm_align.core.io import atomic_write_json
from dllm_align.generate.backend import loads_here, make_generator, recorded_settings
from dllm_align.generate.settings import SamplerSettings, encode_prompt, model_fingerprint, row_seed
from dllm_align.online.label import read_prompts
from dllm_align.online.verifiers import apply, get_rule

RECORD = "parity.json"
PERMUTATIONS = 2000


def permutation_p(a: Sequence[float], b: Sequence[float], rounds: int = PERMUTATIONS, seed: int = 0) -> float:
    """Two-sided permutation p-value of the difference of means of ``a`` and ``b`` (add-one smoothed, so never 0)."""
    if not a or not b:
        return 1.0
    obs = abs(statistics.fmean(a) - statistics.fmean(b))
    pool = list(a) + list(b)
    rng = random.Random(seed)
    n, hits = len(a), 0
    for _ in range(rounds):
        rng.shuffle(pool)
        if abs(statistics.fmean(pool[:n]) - statistics.fmean(pool[n:])) >= obs - 1e-12:
            hits += 1
    return (hits + 1) / (rounds + 1)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """The first position where two token sequences differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _prompt_text(messages: list) -> str:
    users = [m.get("content", "") for m in messages if m.get("role") == "user"]
    return users[-1] if users else ""


def _prompts_to_compare(recipe, prompts: Optional[str], split: str, limit: int, verifier) -> list:
    """``--prompts`` or the recipe's ``--split`` of prompts, at least one."""
    if split not in ("test", "train"):
        raise UserError(f"--split {split[:40]!r}: test or train")
    source = prompts or (recipe.data.test if split == "test" else recipe.data.train)
    if source is None:
        raise UserError(f"data.{split}: no prompts to compare on", hint="--prompts FILE")
    items = read_prompts(str(source), None, limit, verifier)
    if not items:
        raise UserError(f"{source}: no prompts to compare on")
    return items


def run_parity(recipe, out_dir: str | Path, *, prompts: Optional[str] = None, split: str = "test", limit: int = 20,
               samples: int = 4, temperature: float = 1.0, rule: Optional[str] = None, min_match: float = 1.0,
               alpha: float = 0.01, device: Optional[str] = None) -> dict:
    """Compare the recipe's backend with the in-process one (module docstring); returns the record written."""
    gen_section = recipe.generate
    if gen_section.backend == "in_process":
        raise UserError("generate.backend: parity compares a served backend with the in-process one; the recipe's is "
                        "in_process", hint="--set generate.backend=openai --set generate.openai.base_url=...")
    # every flag and the prompts are checked before either backend is made (the served one is contacted then)
    if not 0 < temperature <= 10:
        raise UserError(f"--temperature {temperature}: the sampled comparison needs a temperature above 0 and at most 10 "
                        "(generate.temperature's range)")
    verifier = get_rule(rule, recipe=recipe) if rule else None
    items = _prompts_to_compare(recipe, prompts, split, limit, verifier)
    # the reference: the same section decoded in this process (the served backend's own settings left out)
    ref_section = type(gen_section)(**{**{k: v for k, v in gen_section.model_dump().items() if k != gen_section.backend},
                                       "backend": "in_process"})
    ref = make_generator(ref_section, recipe.model, device=device)
    cand = make_generator(gen_section, recipe.model, device=device)
    ids = [encode_prompt(ref.tokenizer, p.messages) for p in items]
    if [encode_prompt(cand.tokenizer, p.messages) for p in items] != ids:
        raise UserError("the two backends' tokenizers encode the prompts differently")
    base = SamplerSettings.from_section(gen_section)
    reasons: list[str] = []

    # what each side serves
    ref_serving = ref.serving() or {}
    ref_fp = ref_serving.get("fingerprint") or model_fingerprint(str(recipe.model.name_or_path))
    cand_serving = cand.serving() or {}
    if ref_fp is not None and cand_serving.get("fingerprint") is not None and cand_serving["fingerprint"] != ref_fp:
        reasons.append(f"serves another model: fingerprint {cand_serving['fingerprint']} where the recipe's model is {ref_fp}")

    # greedy
    greedy = cand.settings_for(base.replace(temperature=0.0))
    seeds = [row_seed(base.seed, p.id) for p in items]
    a = ref.generate(ids, ref.settings_for(greedy), seeds)
    b = cand.generate(ids, greedy, seeds)
    diverged = {p.id: first_divergence(x.ids, y.ids) for p, x, y in zip(items, a, b) if x.ids != y.ids}
    match = 1 - len(diverged) / len(items)
    if match < min_match:
        reasons.append(f"greedy: {match:.3f} of the completions match token for token (needed {min_match:g}); first "
                       f"divergence at position {min(diverged.values())} of the earliest")

    # sampled: `samples` seeds per prompt
    hot = cand.settings_for(base.replace(temperature=temperature))
    flat = [ids[i] for i in range(len(items)) for _ in range(samples)]
    flat_seeds = [row_seed(base.seed, f"{p.id}/{k}") for p in items for k in range(samples)]
    sa = ref.generate(flat, ref.settings_for(hot), flat_seeds)
    sb = cand.generate(flat, hot, flat_seeds)
    k = min(len(flat), 2 * samples)
    again = cand.generate(flat[:k], hot, flat_seeds[:k])

    def distinct(comps) -> list[int]:
        return [len({tuple(c.ids) for c in comps[i * samples:(i + 1) * samples]}) for i in range(len(items))]

    da, db = distinct(sa), distinct(sb)
    if max(db) == 1 and max(da) > 1:
        reasons.append(f"greedy-only: {samples} seeds at temperature {temperature:g} give one completion per prompt "
                       f"(the reference gives {statistics.fmean(da):.2f} on average): the engine ignores the temperature")
    sampled_match = sum(x.ids == y.ids for x, y in zip(sa, sb)) / len(sa)
    unseeded = bool(getattr(gen_section.own_settings(gen_section.backend), "accept_unseeded", False))
    if any(x.ids != y.ids for x, y in zip(again, sb)):
        reasons.append("ignores seeds: the same request with the same seed gave another completion")
    elif not unseeded and sampled_match < min_match:
        reasons.append(f"ignores seeds: {sampled_match:.3f} of the seeded samples at temperature {temperature:g} match "
                       f"the reference's (needed {min_match:g}): the engine's draws are not the samplers' for a seed")
    la, lb = [len(c.ids) for c in sa], [len(c.ids) for c in sb]
    p_len = permutation_p(la, lb)
    if p_len < alpha:
        reasons.append(f"lengths: the completion lengths differ (means {statistics.fmean(la):.2f} vs "
                       f"{statistics.fmean(lb):.2f}, permutation p = {p_len:.4f} < {alpha:g})")
    passes = _verifier_passes(verifier, rule, items, samples, sa, sb, alpha, reasons)

    record = {
        "backend": gen_section.backend,
        "backend_settings": gen_section.own_settings(gen_section.backend).model_dump(mode="json"),
        "served": cand_serving, "reference": {"backend": "in_process", "folder": str(recipe.model.name_or_path),
                                              "fingerprint": ref_fp},
        "settings": recorded_settings(base), "prompts": len(items), "samples": samples, "temperature": temperature,
        "greedy": {"match_rate": match, "first_divergence": diverged},
        "sampled": {"distinct_reference": statistics.fmean(da), "distinct_backend": statistics.fmean(db),
                    "length_mean_reference": statistics.fmean(la), "length_mean_backend": statistics.fmean(lb),
                    "length_p_value": p_len, "token_match_rate": sampled_match, "verifier": passes or None},
        "thresholds": {"min_match": min_match, "alpha": alpha},
        "passed": not reasons, "reasons": reasons,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / RECORD, record)
    close = getattr(cand, "close", None)
    if close is not None:
        close()
    info(f"parity: greedy match {match:.3f}, distinct samples {statistics.fmean(db):.2f} (reference "
         f"{statistics.fmean(da):.2f}), lengths p = {p_len:.4f}: " + ("passed" if not reasons else "; ".join(reasons)))
    return record


def _verifier_passes(verifier, rule, items, samples: int, sa, sb, alpha: float, reasons: list) -> dict:
    """Both sides' verifier pass rates on the sampled completions and their permutation p-value (a reason is
    added when they differ); empty without a verifier. An unsure verdict counts as not passing, as online's
    held-out share counts it."""
    if verifier is None:
        return {}

    def verdicts(comps):
        return [float(apply(verifier, _prompt_text(items[i // samples].messages), c.text, items[i // samples].row,
                            f"prompt {items[i // samples].id!r}").label is True) for i, c in enumerate(comps)]

    va, vb = verdicts(sa), verdicts(sb)
    p_pass = permutation_p(va, vb)
    passes = {"rule": rule, "reference": statistics.fmean(va), "backend": statistics.fmean(vb), "p_value": p_pass}
    if p_pass < alpha:
        reasons.append(f"verifier: pass rates {passes['reference']:.3f} vs {passes['backend']:.3f} differ "
                       f"(permutation p = {p_pass:.4f} < {alpha:g})")
    return passes


def check_record(path: str | Path, recipe) -> dict:
    """A passing parity record for this recipe's model and generation settings, or a ``UserError`` saying why not
    (``online`` on a served backend needs one)."""
    p = Path(path)
    if p.is_dir():
        p = p / RECORD
    try:
        rec = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"--parity {path}: no readable parity record ({type(e).__name__})",
                        hint="run dllm-align parity with this recipe first, or --skip-parity (recorded)") from None
    if not rec.get("passed"):
        raise UserError(f"--parity {path}: the backend failed parity: {'; '.join(rec.get('reasons') or ['?'])}")
    if rec.get("reference", {}).get("folder") != str(recipe.model.name_or_path):
        raise UserError(f"--parity {path}: the record is for model {rec.get('reference', {}).get('folder')!r}, "
                        f"not {recipe.model.name_or_path!r}")
    if rec.get("backend") != recipe.generate.backend or rec.get("settings") != recorded_settings(
            SamplerSettings.from_section(recipe.generate)):
        raise UserError(f"--parity {path}: the record was made with other generation settings or another backend",
                        hint="run dllm-align parity with these settings")
    return rec


def online_gate(recipe, record: Optional[str], skip: bool) -> Optional[dict]:
    """What ``online`` records about the parity gate of its backend: None for a backend that loads the weights
    here (the samplers themselves); else a passing record for this model and these settings (its path and what
    it saw served), or ``{"skipped": True}`` when the gate is skipped on request."""
    name = recipe.generate.backend
    if loads_here(name):
        return None
    if skip:
        warn(f"online: the parity gate of the backend {name!r} is skipped (--skip-parity); the run records it")
        return {"skipped": True}
    if record is None:
        raise UserError(f"generate.backend: {name!r} generates on a server; online needs a passing parity record for "
                        f"{recipe.model.name_or_path} with these settings",
                        hint="run dllm-align parity with this recipe and pass --parity DIR/parity.json, or --skip-parity "
                             "(recorded in the run)")
    rec = check_record(record, recipe)
    return {"record": str(record), "served": rec["served"], "skipped": False}


__all__ = ["RECORD", "check_record", "online_gate", "first_divergence", "permutation_p", "run_parity"]
