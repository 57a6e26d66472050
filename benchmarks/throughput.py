"""Throughput: ELBO-KTO training steps and the reference precompute, in examples per second.

Rows
    Rows drawn at random (seed 0) from the 1,500 real kto-mix-14k test
    rows (chosen = desirable, rejected = undesirable; ids made unique with a
    ``:chosen`` / ``:rejected`` suffix). Each row is rendered with the chat
    template and tokenised with the byte-level tiny tokenizer, then cut to the
    length it would have with LLaDA's tokenizer (CHARS_PER_TOKEN characters a
    token, as in ``padding.py``) times a scale factor s: prompt and completion
    each keep their first ``ceil(chars / 4 * s)`` tokens (the completion's last
    one is the end-of-turn token), under a cap of ``4,096 * s``. The shape of the
    real length distribution (long prompts, a heavy tail) is kept; only its
    scale shrinks, so that a CPU run takes minutes. Full run: 32 rows, s =
    1/24 (real rows average ~750 LLaDA tokens; the output's settings give the
    mean here); ``--quick``: 16 rows, 1/32; ``--smoke``: 8 rows, 1/64.

Model
    A small bidirectional body (Llama, 2 layers of width 64,
    ``is_causal=False``, as in ``memory.py``) with LLaDA's real vocabulary of
    126,464, saved to a folder and loaded by the library like any checkpoint.
    K = 8 draws (paper), AdamW, ELBO-KTO with beta 0.1 and the batch-mean
    baseline, clipping at 1.0, batches of 4 rows. With a body this small
    nearly all the work is the output head; the settings also report the
    positions each side feeds the body and the head, from which the gain on a
    body-dominated model (LLaDA-8B: the head is ~6% of the FLOPs) can be read:
    there it is about the body-positions ratio (padding and grouping).

Ours: the library's own code, run as a user runs it
    ``reference.precompute`` (length-sorted batches, ``padding: none``, all K
    draws of a batch in one forward, logits only at masked positions through
    the chunked head), then ``training.train`` on that cache (length-grouped
    ``plan_batches``, ``collate``, ``elbo_draws``, ``elbo_kto_loss``, backward,
    clip, AdamW). Training time is the sum of the per-step times the loop logs
    to metrics.jsonl; precompute time is the report's compute time.

Straightforward: written here (:func:`straightforward_draws`)
    K separate forward passes per batch (one per draw), full [B, T, V] logits
    from the model's own forward, log_softmax, gather at the masked positions;
    random batches (``plan_batches(..., group_by_length=False)``), each padded
    to its longest row with hidden pads; the same masks (``elbo.draw_masks``),
    batch size, loss, clipping and optimiser.

Timing: wall clock. Each repeat runs both sides, interleaved, and gives one ratio (ours / straightforward
examples per second, training and precompute apart); the headline ratios are the medians over the repeats
(3; ``--quick`` 2, ``--smoke`` 1) with their spread under ``<key>_spread`` (``benchmarks/paired.py``), the
absolute rates the medians of each side's.

Equal work is checked before timing: on one batch both sides give the same
per-draw ELBOs, loss and gradient (float tolerance), and the two precomputes
give the same value for every row and draw. On CUDA both run in bf16 (autocast
for training with fp32 master weights; a bf16 reference), logits scored in fp32.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from paired import spread

VOCAB = 126_464
K = 8
CHARS_PER_TOKEN = 4.0
MAX_LENGTH = 4096
BETA = 0.1
REPO = Path(__file__).resolve().parents[1]
SETTINGS = {  # size -> (rows, scale, batch, paired repeats: one ratio each, benchmarks/paired.py)
    "full": (32, 1 / 24, 4, 3),
    "quick": (16, 1 / 32, 4, 2),
    "smoke": (8, 1 / 64, 4, 1),  # the equal-work checks and every figure, in seconds
}


# --------------------------------------------------------------------------- rows and model
def load_examples(folder: Path, n_rows: int, scale: float, seed: int = 0) -> list:
    """Real rows (``folder``: chosen.jsonl + rejected.jsonl) cut to their scaled LLaDA-token length
    (module docstring)."""
    import dataclasses

    import numpy as np

    from dllm_align.data.load import load_unpaired
    from dllm_align.models.load import build_tiny_tokenizer
    from dllm_align.config.schema import DataSection
    from dllm_align.data.tokenize import Example, end_of_turn_id, tokenize_rows

    rows = []
    for name, label in (("chosen", True), ("rejected", False)):
        for r in load_unpaired(str(folder / f"{name}.jsonl"), label=label, quiet=True):
            rows.append(dataclasses.replace(r, id=f"{r.id}:{name}"))
    pick = np.random.default_rng(seed).choice(len(rows), n_rows, replace=False)
    rows = [rows[i] for i in sorted(pick)]
    tok = build_tiny_tokenizer()
    eot = end_of_turn_id(tok)
    full = tokenize_rows(rows, tok, DataSection(max_length=1 << 20), quiet=True)
    cap = math.ceil(MAX_LENGTH * scale)
    out = []
    for r, ex in zip(rows, full):
        prompt_chars = len(tok.decode(ex.prompt_ids))
        n_p = max(1, math.ceil(prompt_chars / CHARS_PER_TOKEN * scale))
        n_c = max(1, math.ceil(len(r.completion.strip()) / CHARS_PER_TOKEN * scale))
        n_p = min(n_p, cap - 1)
        n_c = min(n_c, cap - n_p)
        out.append(Example(ex.id, ex.prompt_ids[:n_p], ex.completion_ids[: n_c - 1] + [eot], ex.label, ex.pair_id))
    return out


def save_model(folder: Path):
    """The benchmark model (random init, seed 0) and the tiny tokenizer, in save_pretrained layout."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from dllm_align.models.load import build_tiny_tokenizer, require_transformers

    require_transformers(transformers.__version__)  # older releases make the body causal
    transformers.utils.logging.disable_progress_bar()  # save_pretrained's bar is noise on stderr
    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
                      is_causal=False, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg.mask_token_id = VOCAB - 1  # as LLaDA: a mask id far from the text ids
    LlamaForCausalLM(cfg).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


# --------------------------------------------------------------------------- the straightforward method
def straightforward_draws(model, batch: dict, cfg, mask_token_id: int):
    """Per-draw ELBO values [B, K]: one full forward per draw, full logits, log_softmax, gather.

    Draw k of row b: weight_k * sum over its masked positions of log p(clean token) (paper
    eq. elbo-l), with the masks of ``elbo.draw_masks`` so the values can be compared.
    """
    import torch

    from dllm_align.objective.draws import draw_masks

    ids, am, cm = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    B, T = ids.shape
    masks = torch.zeros(cfg.n_mc, B, T, dtype=torch.bool)
    weights = torch.zeros(cfg.n_mc, B, dtype=torch.float64)
    for b in range(B):
        pos = torch.nonzero(cm[b].cpu()).squeeze(-1)
        m, w = draw_masks(batch["ids"][b], pos.numel(), cfg)
        for k in range(cfg.n_mc):
            masks[k, b, pos[torch.from_numpy(m[k])]] = True
        weights[:, b] = torch.from_numpy(w)
    masks, weights = masks.to(ids.device), weights.to(ids.device)
    out = []
    for k in range(cfg.n_mc):
        noisy = torch.where(masks[k], torch.full_like(ids, mask_token_id), ids)
        logits = model(input_ids=noisy, attention_mask=am).logits  # [B, T, V]
        logp = torch.log_softmax(logits.float(), dim=-1)
        picked = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [B, T]
        sums = (picked * masks[k]).sum(-1)
        out.append((sums.double() * weights[k]).float())
    return torch.stack(out, dim=1)


def _autocast(device: str):
    import contextlib

    import torch

    return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _to(batch: dict, device: str) -> dict:
    import torch

    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}


def straightforward_train(model, examples, collate, batch: int, cfg, ref: dict, device: str, train_section) -> dict:
    """Time one epoch of straightforward ELBO-KTO steps over random batches.

    The optimiser is the training loop's own (``training.optim.build_optimizer``): the
    comparison is about how the ELBO is computed, not about the optimiser.
    """
    import torch

    from dllm_align.data.batching import plan_batches
    from dllm_align.objective.elbo_kto import elbo_kto_loss
    from dllm_align.training.optim import build_optimizer

    plan = plan_batches([e.length for e in examples], batch, 0, 0, group_by_length=False, drop_last=True)
    opt = build_optimizer(model.named_parameters(), train_section)
    model.train()
    steps, n = [], 0
    for idx in plan:
        b = _to(collate([examples[i] for i in idx]), device)
        r = torch.tensor([ref[examples[i].id] for i in idx], device=device)
        _sync(device)
        t0 = time.perf_counter()
        with _autocast(device):
            pol = straightforward_draws(model, b, cfg, model.config.mask_token_id).mean(1)
        loss = elbo_kto_loss(pol, r, b["labels"], beta=BETA).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        steps.append(time.perf_counter() - t0)
        n += len(idx)
    return {"examples": n, "step_seconds": steps, "plan": plan}


def straightforward_precompute(model, examples, collate, batch: int, cfg, device: str) -> dict:
    """Time the straightforward reference pass (no grad) over random batches; returns values too."""
    import torch

    from dllm_align.data.batching import plan_batches

    plan = plan_batches([e.length for e in examples], batch, 0, 0, group_by_length=False)
    model.eval()
    values = {}
    steps = []
    with torch.no_grad():
        for idx in plan:
            b = _to(collate([examples[i] for i in idx]), device)
            _sync(device)
            t0 = time.perf_counter()
            v = straightforward_draws(model, b, cfg, model.config.mask_token_id).float().cpu()
            _sync(device)
            steps.append(time.perf_counter() - t0)
            for j, i in enumerate(idx):
                values[examples[i].id] = v[j].tolist()
    return {"examples": len(examples), "step_seconds": steps, "values": values, "plan": plan}


# --------------------------------------------------------------------------- equal work
def check_equal(mp, examples, collate, cfg, batch: int, device: str) -> dict:
    """Ours and the straightforward method on one batch: same draws, loss and gradient.

    Raises when they differ beyond float tolerance (then the speed-up would not compare
    equal work). Also checks that the model is bidirectional (a late token moves the first
    position's output), as a masked diffusion LM must be.
    """
    import torch

    from dllm_align.data.batching import plan_batches
    from dllm_align.objective.elbo import elbo_draws
    from dllm_align.objective.elbo_kto import elbo_kto_loss

    plan = plan_batches([e.length for e in examples], batch, 0, 0, group_by_length=True, drop_last=True)
    b = _to(collate([examples[i] for i in plan[0]]), device)
    model = mp.model.train()
    params = [p for p in model.parameters()]

    def run(fn):
        with _autocast(device):
            vals = fn()
        ref = vals.detach().mean(1) + torch.linspace(-2, 2, vals.shape[0], device=vals.device)
        loss = elbo_kto_loss(vals.mean(1), ref, b["labels"], beta=BETA).loss
        loss.backward()
        grads = torch.cat([p.grad.flatten().float() for p in params])
        model.zero_grad(set_to_none=True)
        return vals.detach().float(), float(loss.detach()), grads

    ours = run(lambda: elbo_draws(mp, b["input_ids"], b["attention_mask"], b["completion_mask"], b["ids"], cfg))
    plain = run(lambda: straightforward_draws(model, b, cfg, mp.mask_token_id))
    value_rel = float(((ours[0] - plain[0]).abs().max() / plain[0].abs().max()))
    loss_diff = abs(ours[1] - plain[1])
    grad_rel = float((ours[2] - plain[2]).norm() / plain[2].norm())
    with torch.no_grad():
        x = b["input_ids"][:1, : int(b["attention_mask"][0].sum())].clone()
        h1 = model(input_ids=x).logits[0, 0]
        x[0, -1] = (x[0, -1] + 1) % 200
        h2 = model(input_ids=x).logits[0, 0]
    bidirectional = bool((h1 - h2).abs().max() > 0)
    tol = 2e-2 if device == "cuda" else 1e-4
    out = {"values_max_rel_diff": value_rel, "loss_abs_diff": loss_diff, "grad_rel_diff": grad_rel,
           "bidirectional": bidirectional, "tolerance": tol, "rows": len(plan[0])}
    if not bidirectional or value_rel > tol or grad_rel > 10 * tol or loss_diff > tol:
        raise RuntimeError(f"ours and the straightforward method differ on the same batch and masks: {out}")
    return out


# --------------------------------------------------------------------------- ours
def _recipe(folder: Path, root: Path, device: str, batch: int, max_length: int):
    from dllm_align.config.recipe import load_recipe

    return load_recipe(None, [
        f"model.name_or_path={folder}",
        f"data.max_length={max_length}",
        "data.padding=none",
        "data.group_by_length=true",
        f"reference.n_mc={K}",
        f"reference.batch_size={batch}",
        "reference.shard_size=100000",
        f"reference.cache={root / 'ref_cache'}",
        f"train.batch_size={batch}",
        f"train.beta={BETA}",
        "train.log_every=1000000",
        f"train.mixed_precision={'bf16' if device == 'cuda' else repr('no')}",  # quoted: YAML reads no as false
    ], output_dir=str(root / "run"))


def _positions(examples, plan, cfg) -> dict:
    """Positions fed to the body (rows x padded length x K) and scored by the head, for a batch plan."""
    from dllm_align.objective.draws import draw_masks

    body = sum(len(b) * max(examples[i].length for i in b) * cfg.n_mc for b in plan)
    scored = sum(int(draw_masks(examples[i].id, len(examples[i].completion_ids), cfg)[0].sum()) for b in plan for i in b)
    return {"body": body, "head_ours": scored, "head_full_logits": body}


def run(device: str = "cpu", size: str = "full") -> dict:
    import torch
    from accelerate import Accelerator

    from dllm_align.training import cache, reference
    from dllm_align.data.batching import plan_batches
    from dllm_align.core.console import info
    from dllm_align.objective.draws import DrawConfig
    from dllm_align.models.load import load_model
    from dllm_align.data.examples import make_collate
    from dllm_align.data.public import Unavailable, kto_mix_test
    from dllm_align.training.train import train

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible")
    try:
        # ../shared beside the checkout, DLLM_ALIGN_KTO_MIX_TEST, a cached copy, or the hub
        data = kto_mix_test(REPO)
    except Unavailable as e:
        return {"throughput_skipped": f"kto-mix-14k test split unavailable: {e}"}
    n_rows, scale, batch, repeats = SETTINGS[size]
    examples = load_examples(data, n_rows, scale)
    cfg = DrawConfig(n_mc=K, seed=0)
    max_length = math.ceil(MAX_LENGTH * scale)
    with tempfile.TemporaryDirectory(prefix="dllm-bench-") as tmp:
        root = Path(tmp)
        folder = save_model(root / "model")
        recipe = _recipe(folder, root, device, batch, max_length)
        acc = Accelerator(cpu=device == "cpu", mixed_precision="bf16" if device == "cuda" else "no")
        mp = load_model(str(folder), dtype="float32", device=device)
        collate = make_collate(recipe, mp.tokenizer)
        check = check_equal(mp, examples, collate, cfg, batch, device)  # also warms up both paths
        del mp

        # Each repeat runs both sides, interleaved, and gives one ratio, so a burst of load from other
        # jobs on a shared machine moves one repeat's ratio, not the median.
        ours_pre, ours_train, sf_pre, sf_train = [], [], [], []
        for rep_i in range(repeats):
            # -- ours: the reference precompute and the training loop, as `precompute-ref` and `train` run them
            shutil.rmtree(cache.cache_dir(recipe), ignore_errors=True)
            ref_mp = load_model(str(folder), dtype="auto", device=device)
            rep = reference.precompute(recipe, examples, collate, acc, ref_mp)
            ours_pre.append([rep.seconds])
            del ref_mp
            ref_cache = cache.ReferenceCache.open(cache.cache_dir(recipe))
            ours_values = ref_cache.lookup([e.id for e in examples], K)
            train(recipe, examples=examples, accelerator=acc, overwrite=True)
            rows = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
            ours_train.append([r["seconds"] for r in rows])

            # -- straightforward
            sf_ref = load_model(str(folder), dtype="auto", device=device).model
            pre = straightforward_precompute(sf_ref, examples, collate, batch, cfg, device)
            sf_pre.append(pre["step_seconds"])
            del sf_ref
            plain_values = torch.tensor([pre["values"][e.id] for e in examples])
            pre_rel = float((ours_values - plain_values).abs().max() / plain_values.abs().max())
            if pre_rel > (2e-2 if device == "cuda" else 1e-4):
                raise RuntimeError(f"the two precomputes differ: max relative difference {pre_rel:.3g}")
            ref = {e.id: float(v) for e, v in zip(examples, ours_values.mean(1))}
            policy = load_model(str(folder), dtype="float32", device=device).model
            tr = straightforward_train(policy, examples, collate, batch, cfg, ref, device, recipe.train)
            sf_train.append(tr["step_seconds"])
            del policy
            info(
                f"throughput (run {rep_i + 1}/{repeats}): train {len(examples) / sum(ours_train[-1]):.2f} vs "
                f"{len(examples) / sum(sf_train[-1]):.2f} ex/s, precompute {len(examples) / sum(ours_pre[-1]):.2f} vs "
                f"{len(examples) / sum(sf_pre[-1]):.2f} ex/s (ours vs straightforward)"
            )

    n = len(examples)
    per_run = {"train_ours": ours_train, "train_straightforward": sf_train, "precompute_ours": ours_pre,
               "precompute_straightforward": sf_pre}
    rates = {k: statistics.median(n / sum(r) for r in runs) for k, runs in per_run.items()}
    train_sp = spread([sum(b) / sum(a) for a, b in zip(ours_train, sf_train)])
    pre_sp = spread([sum(b) / sum(a) for a, b in zip(ours_pre, sf_pre)])
    lengths = [e.length for e in examples]
    grouped = plan_batches(lengths, batch, 0, 0, group_by_length=True, drop_last=True)
    order = sorted(range(len(examples)), key=lambda i: -lengths[i])
    sorted_plan = [order[s:s + batch] for s in range(0, len(order), batch)]
    random_plan = plan_batches(lengths, batch, 0, 0, group_by_length=False, drop_last=True)

    return {
        "train_speedup": train_sp["median"],
        "train_speedup_spread": train_sp,
        "precompute_speedup": pre_sp["median"],
        "precompute_speedup_spread": pre_sp,
        **{f"throughput_{k}_ex_per_s": v for k, v in rates.items()},
        "throughput_check": {**check, "precompute_values_max_rel_diff": pre_rel},
        "throughput_positions": {
            "train_ours": _positions(examples, grouped, cfg),
            "train_straightforward": _positions(examples, random_plan, cfg),
            "precompute_ours": _positions(examples, sorted_plan, cfg),
            "precompute_straightforward": _positions(examples, random_plan, cfg),
        },
        "throughput_settings": {
            "device": device,
            "dtype": "bf16 autocast, fp32 master weights; bf16 reference" if device == "cuda" else "float32",
            "rows": len(examples),
            "length_model": f"real kto-mix-14k test rows cut to ceil(chars / {CHARS_PER_TOKEN:g} x {scale:g}) tokens "
                            f"(LLaDA-like token counts scaled by {scale:g}), cap {max_length}",
            "mean_tokens_per_row": sum(lengths) / len(lengths),
            "max_tokens_per_row": max(lengths),
            "batch_size": batch,
            "n_mc": K,
            "vocab": VOCAB,
            "body": "Llama 2 layers x 64, bidirectional",
            "train_steps": len(grouped),
            "repeats": repeats,
            "timing": "wall clock; one ratio per paired repeat, the median reported (ours: the loop's own per-step log)",
            "torch_threads": torch.get_num_threads(),
        },
    }


if __name__ == "__main__":
    import argparse
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--size", default="full", choices=list(SETTINGS))
    a = ap.parse_args()
    print(json.dumps(run(a.device, a.size), indent=2, default=str))
