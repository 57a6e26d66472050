"""The bad-input corpus: data files, recipes, command-line arguments, caches and checkpoints.

Every case runs the real console entry point (``dllm_align.cli.app.main``) and
must give: exit code 2 (bad input) or 1 (a fault at run time); exactly one
``Error:`` line (optionally followed by a ``Hint:``) that names the file, line
or key at fault; no traceback - unless ``DLLM_ALIGN_DEBUG=1``, which lets the
exception escape with its traceback; and no partial output (the output path
does not exist afterwards, or is byte-for-byte unchanged).
"""

from __future__ import annotations

import copy
import gzip
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
import yaml

from fixtures.sort_toy import write_pairs
from judge_server import answer
from reliability import run_cli, snapshot




RECIPE = {
    "name": "bad-inputs",
    "model": {"name_or_path": "builtin:tiny"},
    "data": {"format": "paired", "max_length": 64},
    "reference": {"n_mc": 4, "batch_size": 8, "shard_size": 8},
    "train": {"lr": 1e-3, "batch_size": 2, "max_steps": 4, "save_every": 2},
    "generate": {"gen_length": 8, "block_length": 8, "steps": 8, "batch_size": 2},
}


@dataclass
class Base:
    root: Path
    recipe: dict
    recipe_path: Path
    cache: Path
    run: Path
    tiny_dir: Path
    gen_a: Path
    gen_b: Path

    def write_recipe(self, tmp: Path, edit: Callable[[dict], None] | None = None, text: str | bytes | None = None) -> Path:
        p = tmp / "recipe.yaml"
        if text is not None:
            p.write_bytes(text if isinstance(text, bytes) else text.encode())
            return p
        r = copy.deepcopy(self.recipe)
        if edit:
            edit(r)
        p.write_text(yaml.safe_dump(r))
        return p


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Base:
    """A recipe on 16 toy pairs, its reference cache, a 4-step run with checkpoints, a saved tiny model, two generation files."""
    from dllm_align.models.load import save_tiny

    root = tmp_path_factory.mktemp("inputs")
    data = write_pairs(root / "pairs.jsonl", n=16)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Sort: {i} 1"}) + "\n" for i in range(3)))
    recipe = copy.deepcopy(RECIPE)
    recipe["data"].update(train=str(data), test=str(prompts))
    recipe["reference"]["cache"] = str(root / "ref_cache")
    path = root / "toy.yaml"
    path.write_text(yaml.safe_dump(recipe))
    r = run_cli(["precompute-ref", path, "-o", root / "run"])
    assert r.code == 0, r.err
    r = run_cli(["train", path, "-o", root / "run"])
    assert r.code == 0, r.err
    assert sorted(p.name for p in (root / "run" / "checkpoints").iterdir()) == ["step-2", "step-4"]
    gens = []
    for m in ("A", "B"):
        g = root / f"{m.lower()}.jsonl"
        g.write_text("".join(json.dumps({"id": i, "prompt": f"Q{i}", "completion": answer(m, str(i))}) + "\n" for i in range(4)))
        gens.append(g)
    return Base(root, recipe, path, root / "ref_cache", root / "run", save_tiny(root / "tiny"), *gens)


# --------------------------------------------------------------------------- helpers for building cases
def _jsonl(rows: list) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


GOOD = {"prompt": "Sort: 2 1", "completion": "1 2", "label": True}


def data_case(content: str | bytes, name: str = "bad.jsonl"):
    """`convert` on a bad data file; the output file must not appear."""

    def build(b: Base, tmp: Path):
        src = tmp / name
        src.write_bytes(content if isinstance(content, bytes) else content.encode())
        out = tmp / "out.jsonl"
        return ["convert", src, "--output", out], out

    return build


def recipe_case(edit=None, text=None, command="train", extra=()):
    """A bad recipe; the run folder must not appear."""

    def build(b: Base, tmp: Path):
        p = b.write_recipe(tmp, edit, text)
        out = tmp / "run"
        if command == "generate":
            return ["generate", p, "--output", out / "gen.jsonl", *extra], out
        return [command, p, "-o", out, *extra], out

    return build


def args_case(make_args):
    def build(b: Base, tmp: Path):
        args, out = make_args(b, tmp)
        return args, out

    return build


def _copy_cache(b: Base, tmp: Path) -> Path:
    c = tmp / "cache"
    shutil.copytree(b.cache, c)
    return c


def _rewrite_shard(cache: Path, name: str, change: Callable[[np.ndarray], None]) -> None:
    """Change a shard's values but keep it self-consistent (its own checksum and the manifest's sha256 recomputed),
    as a careless edit or a buggy tool would: only the range check can catch it."""
    from dllm_align.core.io import sha256_file
    from dllm_align.training.cache import _contents_sha
    from safetensors import safe_open
    from safetensors.torch import save_file

    p = cache / name
    with safe_open(str(p), framework="pt") as f:
        meta = dict(f.metadata())
        elbo = f.get_tensor("elbo").numpy().copy()
    change(elbo)
    ids, digests = json.loads(meta["ids"]), json.loads(meta["digests"])
    meta["contents_sha256"] = _contents_sha(elbo, ids, digests)
    save_file({"elbo": torch.from_numpy(elbo)}, str(p), metadata=meta)
    m = json.loads((cache / "manifest.json").read_text())
    for e in m["shards"]:
        if e["file"] == name:
            e["sha256"] = sha256_file(p)
    (cache / "manifest.json").write_text(json.dumps(m))


def cache_case(tamper: Callable[[Path], None], extra=()):
    """train on a damaged / mismatched reference cache; the run folder must not appear."""

    def build(b: Base, tmp: Path):
        c = _copy_cache(b, tmp)
        tamper(c)
        out = tmp / "run"
        return ["train", b.recipe_path, "-o", out, "--set", f"reference.cache={c}", *extra], out

    return build


def _flip_byte(p: Path, offset: int = -10) -> None:
    data = bytearray(p.read_bytes())
    data[offset] ^= 0x01
    p.write_bytes(bytes(data))


def _truncate(p: Path, keep: float = 0.5) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * keep)])


def ckpt_case(tamper: Callable[[Path], None], extra=()):
    """train --resume from a damaged checkpoint (the newest, step-4); the run folder must stay as it was."""

    def build(b: Base, tmp: Path):
        run = tmp / "run"
        shutil.copytree(b.run, run)
        tamper(run / "checkpoints" / "step-4")
        return ["train", b.recipe_path, "-o", run, "--resume", *extra], run

    return build


def model_case(tamper: Callable[[Path], None], from_run: bool = True):
    """generate --model FOLDER with a damaged model folder; the output must not appear."""

    def build(b: Base, tmp: Path):
        folder = tmp / "model"
        shutil.copytree(b.run / "final" if from_run else b.tiny_dir, folder)
        tamper(folder)
        out = tmp / "gen.jsonl"
        return ["generate", b.recipe_path, "--model", folder, "--output", out], out

    return build


def judge_case(make):
    """judge with a bad input; the output folder must not appear (or stay unchanged)."""

    def build(b: Base, tmp: Path):
        a, bb = tmp / "a.jsonl", tmp / "b.jsonl"
        shutil.copy(b.gen_a, a)
        shutil.copy(b.gen_b, bb)
        out = tmp / "judged"
        extra = make(tmp, a, bb, out)
        return ["judge", a, bb, "-o", out, "--judge", "rule:longer", "--bootstrap", "100", *extra], out

    return build


def _damaged_cache_line(tmp, a, bb, out):
    out.mkdir()
    row = {"key": "k", "judge": "m", "id": "0", "order": "AB", "verdict": "A"}
    (out / "cache.jsonl").write_text(_jsonl([row, "{not json", dict(row, key="k2")]))
    return ["--judge", "m", "--base-url", "http://127.0.0.1:9/v1", "--api-key-env", ""]


def _damaged_settings(b: Base, t: Path):
    """An earlier output whose settings sidecar was damaged: refused, and the output left as it was."""
    (t / "g.jsonl").write_text(json.dumps({"id": "q0", "completion": "x"}) + "\n")
    (t / "g.settings.json").write_text("{")
    return ["generate", b.recipe_path, "--output", t / "g.jsonl"], t


def _damaged_weights(b: Base, t: Path):
    (t / "w.weights.json").write_text('{"lambda_desirable": 1.0, "lambda_undesirable": ')
    p = b.write_recipe(t, lambda r: r["data"].update(weights_file=str(t / "w.weights.json")))
    return ["train", p, "-o", t / "run"], t / "run"


_GOOD_ACCEL = {"distributed_type": "FSDP", "num_processes": 8, "mixed_precision": "bf16",
               "fsdp_config": {"fsdp_version": 2, "fsdp_activation_checkpointing": True}}
_GOOD_SHAPE = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
               "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 512}


def doctor_case(accel_edit=None, shape_edit=None, extra=(), accel_text=None, shape_text=None):
    """`doctor` on a model folder holding only config.json and an accelerate config, one of them bad."""

    def build(b: Base, t: Path):
        model = t / "model"
        model.mkdir()
        shape = copy.deepcopy(_GOOD_SHAPE)
        if shape_edit:
            shape_edit(shape)
        (model / "config.json").write_text(shape_text if shape_text is not None else json.dumps(shape))
        accel = copy.deepcopy(_GOOD_ACCEL)
        if accel_edit:
            accel_edit(accel)
        (t / "accel.yaml").write_text(accel_text if accel_text is not None else yaml.safe_dump(accel))
        p = b.write_recipe(t, lambda r: r["model"].update(name_or_path=str(model)))
        return ["doctor", p, "--config", t / "accel.yaml", "-o", t / "run", *extra], t / "run"

    return build


@dataclass
class Case:
    id: str
    build: Callable
    code: int
    needles: tuple  # substrings of the Error line: the file / line / key at fault, and what is wrong
    hint: tuple = ()  # substrings of the Hint line


CASES = [
    # ---------------------------------------------------------------- data files
    Case("data-truncated-json", data_case(_jsonl([GOOD]) + '{"prompt": "a", "completion": "b", "lab'), 2,
         ("bad.jsonl:2", "malformed JSON")),
    Case("data-label-wrong-type", data_case(_jsonl([dict(GOOD, label="yes")])), 2, ("bad.jsonl:1", "label")),
    Case("data-empty-completion", data_case(_jsonl([GOOD, dict(GOOD, completion="  ")])), 2, ("bad.jsonl:2", "completion")),
    Case("data-missing-column", data_case(_jsonl([{"prompt": "p", "label": True}])), 2, ("bad.jsonl", "completion")),
    Case("data-non-utf8", data_case(_jsonl([GOOD, GOOD]).encode() + b'{"prompt": "caf\xe9", "completion": "x", "label": true}\n'), 2,
         ("bad.jsonl:3", "UTF-8")),
    Case("data-nested-too-deep", data_case("[" * 200_000 + "]" * 200_000 + "\n"), 2, ("bad.jsonl:1", "nested too deeply")),
    Case("data-huge-garbage-row", data_case(_jsonl([GOOD]) + "x" * 20_000_000 + "\n"), 2, ("bad.jsonl:2", "malformed JSON")),
    Case("data-huge-bad-label", data_case(_jsonl([dict(GOOD, label="y" * 5_000_000)])), 2, ("bad.jsonl:1", "label")),
    Case("data-row-not-object", data_case(_jsonl([GOOD, "[1, 2, 3]"])), 2, ("bad.jsonl:2", "object")),
    Case("data-empty-file", data_case(""), 2, ("bad.jsonl", "no rows")),
    Case("data-duplicate-id", data_case(_jsonl([dict(GOOD, id="x"), dict(GOOD, id="x", completion="2 1")])), 2, ("'x'",)),
    Case("data-json-not-a-list", data_case("42", name="bad.json"), 2, ("bad.json", "list")),
    Case("data-truncated-parquet", data_case(b"PAR1" + b"\x00" * 64, name="bad.parquet"), 2, ("bad.parquet", "Parquet")),
    Case("data-corrupt-gzip", data_case(gzip.compress(_jsonl([GOOD] * 50).encode())[:-30], name="bad.jsonl.gz"), 2,
         ("bad.jsonl.gz", "gzip")),
    Case("data-csv-bad-label", data_case("prompt,completion,label\np,c,maybe\n", name="bad.csv"), 2, ("bad.csv:2", "label")),
    Case("data-bad-message-role", data_case(_jsonl([dict(GOOD, prompt=[{"role": 5, "content": "hi"}])])), 2,
         ("bad.jsonl:1", "role")),
    # ---------------------------------------------------------------- recipes
    Case("recipe-unknown-key", recipe_case(lambda r: r["train"].update(bta=0.1)), 2, ("train.bta", "did you mean 'train.beta'")),
    Case("recipe-unknown-section", recipe_case(lambda r: r.update(trainer={})), 2, ("'trainer'", "did you mean 'train'")),
    Case("recipe-wrong-type", recipe_case(lambda r: r["train"].update(lr="fast")), 2, ("train.lr", "fast")),
    Case("recipe-out-of-range", recipe_case(lambda r: r["data"].update(max_length=4)), 2, ("data.max_length",)),
    Case("recipe-n-mc-above-cache", recipe_case(lambda r: r["train"].update(n_mc=8)), 2, ("train.n_mc", "reference.n_mc")),
    Case("recipe-vrpo-unpaired", recipe_case(lambda r: (r["train"].update(objective="vrpo"), r["data"].update(format="unpaired"))), 2,
         ("vrpo", "data.format")),
    Case("recipe-blocks-dont-divide", recipe_case(lambda r: r["generate"].update(gen_length=12), command="generate"), 2,
         ("gen_length", "block_length")),
    Case("recipe-invalid-yaml", recipe_case(text="model:\n  name_or_path: builtin:tiny\ntrain: [lr: 1\n"), 2,
         ("recipe.yaml:", "invalid YAML")),
    Case("recipe-not-a-mapping", recipe_case(text="- train\n- model\n"), 2, ("recipe.yaml", "mapping")),
    Case("recipe-non-utf8", recipe_case(text=b"name: caf\xe9\n"), 2, ("recipe.yaml", "UTF-8")),
    Case("recipe-three-judges", recipe_case(lambda r: r.update(judge={"judges": ["a", "b", "c"]})), 2, ("judge.judges",)),
    Case("recipe-set-without-equals", recipe_case(extra=("--set", "train.beta")), 2, ("--set", "train.beta")),
    Case("recipe-set-bad-value", recipe_case(extra=("--set", "train.beta=-1")), 2, ("train.beta", "greater than 0")),
    Case("recipe-python-tag", recipe_case(text="name: !!python/object/apply:os.system ['echo pwned']\n"), 2,
         ("recipe.yaml", "invalid YAML")),
    Case("recipe-max-length-1e38", recipe_case(text="model:\n  name_or_path: builtin:tiny\ndata:\n  max_length: 1e38\n"), 2,
         ("data.max_length",)),
    Case("recipe-max-length-huge-int", recipe_case(lambda r: r["data"].update(max_length=2_000_000_000)), 2, ("data.max_length", "1048576")),
    Case("recipe-max-length-past-positions", recipe_case(lambda r: r["data"].update(max_length=1_000_000, padding="paper")), 2,
         ("data.max_length 1000000", "beyond the model's", "positions")),
    Case("precompute-max-length-past-positions",
         recipe_case(lambda r: r["data"].update(max_length=1_000_000, padding="paper"), command="precompute-ref"), 2,
         ("data.max_length 1000000", "positions")),
    Case("recipe-flex-training-on-cpu", recipe_case(lambda r: r["model"].update(attn_implementation="flex_attention")), 2,
         ("flex_attention", "cannot train on a CPU")),
    Case("recipe-epochs-below-half-a-step", recipe_case(lambda r: (r["train"].pop("max_steps"), r["train"].update(epochs=0.001))), 2,
         ("train.epochs 0.001", "less than half a step")),
    Case("recipe-fp16-on-cpu", recipe_case(lambda r: r["train"].update(mixed_precision="fp16")), 2,
         ("train.mixed_precision fp16", "CUDA")),
    Case("recipe-binary-tag", recipe_case(text="model:\n  name_or_path: !!binary YnVpbHRpbjp0aW55\n"), 2,
         ("recipe.yaml:2", "!!binary", "not allowed")),
    Case("recipe-nested-too-deep", recipe_case(text="train:\n  beta: " + "[" * 5000 + "]" * 5000 + "\n"), 2,
         ("recipe.yaml", "nested deeper than 32 levels")),
    Case("recipe-set-nested-too-deep", recipe_case(extra=("--set", "train.beta=" + "[" * 3000 + "]" * 3000)), 2,
         ("--set train.beta", "nested deeper than 32 levels")),
    # ---------------------------------------------------------------- doctor's inputs
    Case("doctor-processes-not-a-number", doctor_case(lambda a: a.update(num_processes="eight")), 2,
         ("accel.yaml", "num_processes", "'eight'")),
    Case("doctor-processes-negative", doctor_case(lambda a: a.update(num_processes=-8)), 2, ("accel.yaml", "num_processes", "-8")),
    Case("doctor-fsdp-config-a-list", doctor_case(lambda a: a.update(fsdp_config=["fsdp_version", 2])), 2,
         ("accel.yaml", "fsdp_config must be a mapping")),
    Case("doctor-fsdp-version-9", doctor_case(lambda a: a["fsdp_config"].update(fsdp_version=9)), 2,
         ("accel.yaml", "fsdp_version must be 1 or 2")),
    Case("doctor-config-json-a-list", doctor_case(shape_text="[1, 2]"), 2, ("config.json", "JSON object")),
    Case("doctor-zero-heads", doctor_case(shape_edit=lambda c: c.update(num_attention_heads=0)), 2,
         ("config.json", "num_attention_heads", "whole number >= 1")),
    Case("doctor-heads-true", doctor_case(shape_edit=lambda c: c.update(num_attention_heads=True)), 2,
         ("config.json", "num_attention_heads", "True")),
    Case("doctor-negative-width", doctor_case(shape_edit=lambda c: c.update(hidden_size=-64)), 2, ("config.json", "hidden_size")),
    Case("doctor-more-experts-per-token-than-experts",
         doctor_case(shape_edit=lambda c: c.update(num_experts=64, num_experts_per_tok=128, moe_intermediate_size=32)), 2,
         ("config.json", "num_experts_per_tok 128", "num_experts 64")),
    Case("doctor-gpu-memory-inf", doctor_case(extra=("--gpu-memory", "inf")), 2, ("--gpu-memory",)),
    Case("doctor-smoke-unbounded", doctor_case(extra=("--smoke", "1000000000")), 2, ("--smoke",)),
    # ---------------------------------------------------------------- command-line arguments
    Case("args-evaluate-unknown-task", args_case(lambda b, t: (["evaluate", b.recipe_path, "--tasks", "nosuchtask", "-o", t / "ev"], t / "ev")), 2,
         ("nosuchtask",)),
    Case("args-limit-zero", args_case(lambda b, t: (["generate", b.recipe_path, "--limit", "0", "--output", t / "g.jsonl"], t / "g.jsonl")), 2,
         ("--limit",)),
    Case("args-output-suffix", args_case(lambda b, t: (["generate", b.recipe_path, "--output", t / "g.txt"], t / "g.txt")), 2, ("g.txt", ".jsonl")),
    Case("args-resume-and-overwrite", args_case(lambda b, t: (["train", b.recipe_path, "-o", t / "r", "--resume", "--overwrite"], t / "r")), 2,
         ("--resume", "--overwrite")),
    Case("args-ratio-above-one", args_case(lambda b, t: (["convert", b.gen_a, "--output", t / "o.jsonl", "--desirable-ratio", "1.5"], t / "o.jsonl")), 2,
         ("--desirable-ratio",)),
    Case("args-unknown-option", args_case(lambda b, t: (["train", b.recipe_path, "--bogus"], t / "x")), 2, ("--bogus",)),
    Case("args-missing-recipe", args_case(lambda b, t: (["train", t / "nope.yaml", "-o", t / "r"], t / "r")), 2, ("nope.yaml", "not found")),
    Case("args-output-is-input", args_case(lambda b, t: (["convert", b.gen_a, "--output", b.gen_a], b.gen_a)), 2, ("overwrite the input",)),
    Case("args-same-judge-twice", judge_case(lambda t, a, bb, out: ["--judge", "rule:longer"]), 2, ("rule:longer", "twice")),
    Case("args-credentials-in-url", judge_case(lambda t, a, bb, out: ["--judge", "m", "--base-url", "http://u:pw@127.0.0.1:9/v1",
                                                                      "--api-key-env", ""]), 2, ("--base-url", "credentials")),
    Case("args-concurrency-zero", judge_case(lambda t, a, bb, out: ["--concurrency", "0"]), 2, ("--concurrency",)),
    Case("args-unknown-remasking", args_case(lambda b, t: (["generate", b.recipe_path, "--remasking", "best", "--output", t / "g.jsonl"], t / "g.jsonl")), 2,
         ("generate.remasking",)),
    # ---------------------------------------------------------------- reference caches
    Case("cache-shard-truncated", cache_case(lambda c: _truncate(c / "shard-00001.safetensors")), 2,
         ("shard-00001.safetensors", "checksum")),
    Case("cache-shard-bit-flip", cache_case(lambda c: _flip_byte(c / "shard-00002.safetensors")), 2,
         ("shard-00002.safetensors", "checksum")),
    Case("cache-manifest-not-json", cache_case(lambda c: (c / "manifest.json").write_text('{"fingerprint": ')), 2,
         ("manifest.json", "not valid JSON")),
    Case("cache-manifest-path-escape", cache_case(lambda c: (c / "manifest.json").write_text(json.dumps(
        dict(json.loads((c / "manifest.json").read_text()), shards=[{"file": "../../x.safetensors", "n": 8, "sha256": "0"}])))), 2,
         ("manifest.json", "malformed")),
    Case("cache-interrupted", cache_case(lambda c: (c / "manifest.json").unlink()), 2, ("incomplete", "interrupted")),
    Case("cache-other-model", cache_case(lambda c: None, extra=("--set", "reference.model=TINY_DIR")), 2,
         ("field 'reference_weights'",)),
    Case("cache-other-settings", cache_case(lambda c: None, extra=("--set", "reference.seed=7")), 2, ("field 'seed'", "reference.seed")),
    Case("cache-nan-values", cache_case(lambda c: _rewrite_shard(c, "shard-00000.safetensors", lambda v: v.__setitem__((3, 1), np.nan))), 2,
         ("shard-00000.safetensors", "out-of-range", "draw 1 is nan")),
    Case("cache-positive-values", cache_case(lambda c: _rewrite_shard(c, "shard-00003.safetensors", lambda v: v.__setitem__((0, 0), 5.0))), 2,
         ("shard-00003.safetensors", "positive log-likelihood")),
    Case("cache-manifest-edited", cache_case(lambda c: (c / "manifest.json").write_text(json.dumps(
        dict(json.loads((c / "manifest.json").read_text()),
             fingerprint=dict(json.loads((c / "manifest.json").read_text())["fingerprint"], seed=7)))),
        extra=("--set", "reference.seed=7")), 2, ("manifest.json does not match shard",)),
    # ---------------------------------------------------------------- checkpoints (train --resume)
    Case("ckpt-model-bit-flip", ckpt_case(lambda k: _flip_byte(k / "model.safetensors")), 2,
         ("step-4", "model.safetensors", "sha256"), ("resume from step-2",)),
    Case("ckpt-model-truncated", ckpt_case(lambda k: _truncate(k / "model.safetensors")), 2, ("model.safetensors", "truncated")),
    Case("ckpt-state-edited", ckpt_case(lambda k: (k / "trainer_state.json").write_text(
        (k / "trainer_state.json").read_text().replace('"step": 4', '"step": 3'))), 2, ("trainer_state.json", "sha256")),
    Case("ckpt-optimizer-truncated", ckpt_case(lambda k: _truncate(k / "optimizer.pt", 0.9)), 2, ("optimizer.pt", "truncated")),
    Case("ckpt-no-checksums", ckpt_case(lambda k: (k / "checksums.json").unlink()), 2, ("step-4", "checksums.json")),
    Case("ckpt-other-model", ckpt_case(lambda k: None, extra=("--set", "model.name_or_path=TINY_DIR")), 2,
         ("step-4", "builtin:tiny", "model.name_or_path")),
    # a run folder copied without its recipe record: the checkpoint's own record is compared
    Case("ckpt-no-record-other-objective", ckpt_case(lambda k: (k.parent.parent / "recipe.train.yaml").unlink(),
                                                     extra=("--set", "train.objective=sft")), 2,
         ("cannot continue", "train.objective", "elbo_kto", "sft")),
    Case("ckpt-no-record-other-lr", ckpt_case(lambda k: (k.parent.parent / "recipe.train.yaml").unlink(),
                                              extra=("--set", "train.lr=0.5")), 2, ("train.lr", "0.5")),
    Case("args-allow-change-unknown-key", ckpt_case(lambda k: None, extra=("--allow-change", "train.nosuch")), 2,
         ("--allow-change train.nosuch", "no such recipe key")),
    Case("args-allow-change-typo", ckpt_case(lambda k: None, extra=("--allow-change", "train.btea")), 2,
         ("--allow-change train.btea", "did you mean 'train.beta'")),
    Case("model-truncated-checkpoint", model_case(lambda m: _truncate(m / "model.safetensors")), 2,
         ("model.safetensors", "truncated")),
    Case("model-truncated-no-checksums", model_case(lambda m: _truncate(m / "model.safetensors"), from_run=False), 2,
         ("model.safetensors", "not a readable safetensors file")),
    Case("model-pickle-only", model_case(lambda m: (m / "model.safetensors").rename(m / "pytorch_model.bin"), from_run=False), 2,
         ("no safetensors weights", "model")),
    Case("model-no-config", model_case(lambda m: (m / "config.json").unlink(), from_run=False), 2, ("no config.json",)),
    Case("model-config-garbage", model_case(lambda m: (m / "config.json").write_text("{oops"), from_run=False), 2,
         ("config.json", "invalid JSON")),
    # ---------------------------------------------------------------- other files a run reads back
    Case("generate-settings-damaged", args_case(_damaged_settings), 2, ("g.settings.json", "not valid JSON")),
    Case("judge-cache-damaged-middle", judge_case(_damaged_cache_line), 2, ("cache.jsonl:2", "damaged line")),
    Case("judge-template-placeholder", judge_case(lambda t, a, bb, out: (
        (t / "tpl.txt").write_text("Compare {answer_a} with nothing. [[A]] or [[B]]"), ["--template", t / "tpl.txt"])[1]), 2,
         ("tpl.txt", "{prompt}", "{answer_b}")),
    Case("judge-bad-row-type", judge_case(lambda t, a, bb, out: (
        a.write_text(a.read_text() + json.dumps({"id": [1], "prompt": "p", "completion": "c"}) + "\n"), [])[1]), 2,
         ("a.jsonl:5", "'id'")),
    Case("train-weights-file-damaged", args_case(_damaged_weights), 2, ("w.weights.json", "JSON")),
]


def _prepare(case: Case, b: Base, tmp: Path):
    tmp.mkdir()
    args, watched = case.build(b, tmp)
    return [str(a).replace("TINY_DIR", str(b.tiny_dir)) for a in args], Path(watched)


def test_the_corpus_is_large_and_varied():
    kinds = {c.id.split("-")[0] for c in CASES}
    assert len(CASES) >= 25 and {"data", "recipe", "args", "cache", "ckpt", "model"} <= kinds
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, base: Base, tmp_path: Path):
    args, watched = _prepare(case, base, tmp_path / "plain")
    before = snapshot(watched) if watched.exists() else None

    r = run_cli(args)
    assert r.exc is None, r.traceback
    assert r.code == case.code, r.err
    lines = r.err.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("Error:")]
    assert len(errors) == 1, r.err
    error = lines[errors[0]]
    for needle in case.needles:
        assert needle in error, f"{needle!r} not in {error!r}"
    assert len(error) < 600  # a huge bad row is quoted, not dumped
    rest = lines[errors[0] + 1:]
    assert all(line.startswith(("Hint:", "  ")) for line in rest), r.err  # a hint, or the listed problems
    for needle in case.hint:
        assert any(needle in line for line in rest if line.startswith("Hint:")), r.err
    print(f"{case.id}: {error}\n  {' | '.join(rest)}")
    assert "Traceback" not in r.err and r.out == ""
    if before is None:
        assert not watched.exists(), sorted(p.name for p in watched.parent.iterdir())
    else:
        assert snapshot(watched) == before

    # DLLM_ALIGN_DEBUG=1: the same failure, with the traceback
    args, _ = _prepare(case, base, tmp_path / "debug")
    d = run_cli(args, env={"DLLM_ALIGN_DEBUG": "1"})
    assert d.exc is not None, d.err
    assert d.traceback.startswith("Traceback (most recent call last)")
    assert "Error:" not in d.err


@pytest.mark.parametrize("make_args", [
    lambda t: ["convert", t / "bad.jsonl", "--output", t / "out.jsonl"],
    lambda t: ["recipes", "check", t / "bad.yaml"],
    lambda t: ["convert", t / "bad.jsonl", "--desirable-ratio", "7", "--output", t / "out.jsonl"],
], ids=["bad-row", "bad-recipe", "bad-flag"])
def test_a_real_interpreter_prints_one_line_or_with_debug_a_traceback(tmp_path, make_args):
    """The same manners from `python -m dllm_align` (these commands start in under a second: no torch)."""
    import os
    import subprocess
    import sys

    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "completion": "b", "lab\n')
    (tmp_path / "bad.yaml").write_text("train:\n  bta: 0.1\n")
    src = Path(__file__).resolve().parents[1] / "src"
    env = dict(os.environ, PYTHONPATH=str(src))
    env.pop("DLLM_ALIGN_DEBUG", None)
    cmd = [sys.executable, "-m", "dllm_align", *map(str, make_args(tmp_path))]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.splitlines()
    assert lines[0].startswith("Error: ") and all(x.startswith("Hint: ") for x in lines[1:]), p.stderr
    assert "Traceback" not in p.stderr and "╭" not in p.stderr
    p = subprocess.run(cmd, env=dict(env, DLLM_ALIGN_DEBUG="1"), capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr.startswith("Traceback (most recent call last)")
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("command", ["train", "precompute-ref", "judge"])
def test_a_second_writer_of_the_same_folder_is_refused(base: Base, tmp_path: Path, command: str):
    """Two runs writing one folder would interleave their logs; the second is refused while the first holds it."""
    from dllm_align.core.io import DirLock

    if command == "train":
        folder, args = tmp_path / "run", ["train", base.recipe_path, "-o", tmp_path / "run"]
    elif command == "precompute-ref":
        folder = tmp_path / "cache"
        args = ["precompute-ref", base.recipe_path, "-o", tmp_path / "run", "--set", f"reference.cache={folder}"]
    else:
        folder, args = tmp_path / "judged", ["judge", base.gen_a, base.gen_b, "--judge", "rule:longer", "-o", tmp_path / "judged"]
    folder.mkdir()
    with DirLock(folder, "held by the first run"):  # as the first run would hold it
        r = run_cli(args)
    assert r.code == 2, r.err
    if command == "precompute-ref":
        assert "is in use by another dllm-align command: a `precompute-ref` writing it" in r.err and str(folder) in r.err
    else:
        assert f"Error: another `dllm-align {command}`" in r.err and str(folder) in r.err
    assert list(folder.iterdir()) == []


def test_a_cache_that_a_running_train_reads_is_not_replaced_under_it(base: Base, tmp_path: Path):
    """`precompute-ref --overwrite` into the cache a running `train` reads was accepted: the run's folder no
    longer held the values it trained against. The train holds a shared lock on its cache; the rewrite is
    refused naming the reading train, and, the other way round, a train does not start on a cache being rewritten."""
    from dllm_align.core.io import DirLock

    cache = tmp_path / "cache"
    shutil.copytree(base.cache, cache)
    before = snapshot(cache)
    with DirLock(cache, "a train reads it", shared=True):  # as a running train holds it
        r = run_cli(["precompute-ref", base.recipe_path, "-o", tmp_path / "run", "--set", f"reference.cache={cache}", "--overwrite"])
    assert r.code == 2, r.err
    assert "or a `train` reading it as its reference cache" in r.err and str(cache) in r.err
    assert snapshot(cache) == before
    with DirLock(cache, "a precompute-ref rewrites it"):  # as a running precompute-ref holds it
        r = run_cli(["train", base.recipe_path, "-o", tmp_path / "run2", "--set", f"reference.cache={cache}"])
    assert r.code == 2 and "is being rewritten by a running `dllm-align precompute-ref`" in r.err, r.err


@pytest.mark.parametrize("command", ["precompute-ref", "train"])
def test_packed_rows_longer_than_max_length_are_truncated_like_the_other_paddings(base: Base, tmp_path: Path, command: str):
    """`padding: packed` with `truncation: completion` cuts a too-long completion as `none` does (it was
    refused as "no rows fit in data.max_length"); both keep the same rows."""
    kept = {}
    for padding in ("none", "packed"):
        (tmp_path / padding).mkdir()
        p = base.write_recipe(tmp_path / padding, lambda r: (r["data"].update(padding=padding, max_length=40, truncation="completion"),
                                                            r["train"].update(max_steps=1), r["reference"].pop("cache", None),
                                                            r["reference"].update(mode="online") if command == "train" else None))
        r = run_cli([command, p, "-o", tmp_path / padding / "run"])
        assert r.code == 0, r.err
        assert "lost their tail to fit max_length 40" in r.err  # the truncation is reported, not refused
        kept[padding] = [line for line in r.err.splitlines() if "lost their tail" in line]
    assert kept["none"] == kept["packed"]


@pytest.mark.parametrize("fault", ["safetensors", "torch-save"])
def test_a_full_disk_during_a_checkpoint_is_one_line(base: Base, tmp_path: Path, monkeypatch, fault: str):
    """A full disk during `train`'s (and so `demo`'s) checkpoint write surfaced as a raw SafetensorError or
    torch's `[enforce fail at inline_container.cc] . unexpected pos`: it is now the one message the other
    commands give, naming the checkpoint."""
    import safetensors.torch

    if fault == "safetensors":
        def broken(*a, **k):
            raise safetensors.SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left on device\" })")
        monkeypatch.setattr(safetensors.torch, "save_file", broken)
        from dllm_align.training import checkpoint

        monkeypatch.setattr(checkpoint, "save_file", broken)  # bound at import there
    else:
        def broken(*a, **k):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
        monkeypatch.setattr(torch, "save", broken)
    r = run_cli(["train", base.recipe_path, "-o", tmp_path / "run"])
    assert r.exc is None and r.code == 1, r.err
    errors = [line for line in r.err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "checkpoint" in errors[0] and "no space left on the device" in errors[0], r.err
