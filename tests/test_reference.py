"""The reference cache (docs/design.md#the-reference-cache): values, fingerprints, resumable shards, tamper detection."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dllm_align.training import reference as ref
from dllm_align.training import cache as refcache
from dllm_align.core.errors import UserError
from dllm_align.config.recipe import load_recipe

from fixtures.sort_toy import write_pairs




def _recipe(tmp: Path, data: Path, *sets: str):
    return load_recipe(
        None,
        [f"data.train={data}", "data.format=paired", "data.max_length=64", "reference.n_mc=4",
         "reference.shard_size=5", "reference.batch_size=3", *sets],
        output_dir=str(tmp / "run"),
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from dllm_align.models.load import load_model
    from dllm_align.data.examples import load_training_examples, make_collate

    tmp = tmp_path_factory.mktemp("ref")
    data = write_pairs(tmp / "pairs.jsonl", n=8)
    rec = _recipe(tmp, data)
    mp = load_model("builtin:tiny")
    exs = load_training_examples(rec, mp.tokenizer, quiet=True)
    collate = make_collate(rec, mp.tokenizer)
    report = ref.precompute(rec, exs, collate, None, mp)
    return {"tmp": tmp, "data": data, "rec": rec, "mp": mp, "examples": exs, "collate": collate, "report": report}


def _fp(rec, mp, exs, cache=None):
    return refcache.fingerprint(
        rec, tokenizer=mp.tokenizer, mask_token_id=mp.mask_token_id, device="cpu", examples=exs,
        known_files=cache.weight_files() if cache else None,
    )


def test_cached_values_are_the_per_draw_elbos(setup):
    from dllm_align.objective.elbo import DrawConfig, elbo_draws

    rep, exs, mp = setup["report"], setup["examples"], setup["mp"]
    assert rep.n_examples == 16 and rep.n_shards == 4 and rep.computed_shards == 4  # 16 rows, shards of 5
    cache = refcache.ReferenceCache.open(rep.cache)
    assert cache.K == 4
    # each example alone (no padding from batch neighbours), same masks
    for ex in exs[:6]:
        b = setup["collate"]([ex])
        want = elbo_draws(mp, b["input_ids"], b["attention_mask"], b["completion_mask"], b["ids"], DrawConfig(n_mc=4))
        got = cache.lookup([ex.id], 4)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(cache.lookup([ex.id], 2), got[:, :2])  # any K' <= K: a prefix
    manifest = json.loads((rep.cache / "manifest.json").read_text())
    assert {s["file"] for s in manifest["shards"]} == {f"shard-{i:05d}.safetensors" for i in range(4)}
    for key in ("reference_weights", "tokenizer", "dataset", "max_length", "padding", "truncation", "n_mc", "seed",
                "estimator", "stratified", "reference_model", "reference_revision", "mask_token_id", "reference_dtype",
                "compute_dtype", "end_of_turn", "group_by_length", "baseline"):
        assert key in manifest["fingerprint"], key
    cache.check(_fp(setup["rec"], mp, exs, cache), exs, 4)  # its own run: accepted
    # no pickle anywhere: shards are safetensors, ids live in their JSON metadata
    assert not any(p.suffix in (".pt", ".pkl", ".bin") for p in rep.cache.iterdir())


@pytest.mark.parametrize(
    "override, field",
    [
        ("reference.n_mc=8", "n_mc"),
        ("reference.seed=1", "seed"),
        ("data.padding=paper", "padding"),
        ("data.max_length=128", "max_length"),
        ("reference.estimator=t", "estimator"),
        ("reference.stratified=true", "stratified"),
        ("data.truncation=prompt_left", "truncation"),
        ("data.end_of_turn=none", "end_of_turn"),
        ("train.mixed_precision=bf16", "compute_dtype"),
    ],
)
def test_mismatched_cache_is_refused_naming_the_field(setup, override, field):
    rec = _recipe(setup["tmp"], setup["data"], override)
    cache = refcache.ReferenceCache.open(setup["report"].cache)
    with pytest.raises(UserError) as e:
        cache.check(_fp(rec, setup["mp"], setup["examples"], cache), setup["examples"], 4)
    assert f"field '{field}'" in e.value.message
    assert "precompute-ref" in e.value.hint


def test_other_dataset_or_model_is_refused(setup, tmp_path):
    from dllm_align.models.load import TinySpec, save_tiny
    from dllm_align.data.tokenize import Example

    cache = refcache.ReferenceCache.open(setup["report"].cache)
    exs = setup["examples"]
    fp = _fp(setup["rec"], setup["mp"], exs, cache)
    changed = [Example(exs[0].id, exs[0].prompt_ids, exs[0].completion_ids[:-2] + exs[0].completion_ids[-1:], exs[0].label, exs[0].pair_id)]
    with pytest.raises(UserError, match=r"field 'dataset'.*other tokens"):
        cache.check(fp, changed + exs[1:], 4)
    new = [Example("not-in-cache", exs[0].prompt_ids, exs[0].completion_ids, True, None)]
    with pytest.raises(UserError, match=r"field 'dataset'.*not in the cache"):
        cache.check(fp, new, 4)
    # a subset (a class-ratio ablation) is served by the full cache
    cache.check(fp, exs[::3], 4)
    # another reference model: a tiny model with other weights
    other = save_tiny(tmp_path / "other", TinySpec(seed=1))
    rec = _recipe(setup["tmp"], setup["data"], f"reference.model={other}")
    with pytest.raises(UserError, match="field 'reference_weights'"):
        cache.check(_fp(rec, setup["mp"], exs, cache), exs, 4)
    with pytest.raises(UserError, match="holds 4 draws"):
        cache.check(fp, exs, 5)


def test_interrupted_precompute_keeps_good_shards_and_redoes_damaged_ones(setup, tmp_path):
    rec = _recipe(tmp_path, setup["data"])
    exs, mp, collate = setup["examples"], setup["mp"], setup["collate"]
    first = ref.precompute(rec, exs, collate, None, mp)
    want = {i: refcache.ReferenceCache.open(first.cache).lookup([i], 4) for i in (e.id for e in exs)}
    folder = first.cache
    # an interruption: no manifest; one shard truncated mid-write, one modified
    (folder / "manifest.json").unlink()
    s1 = folder / "shard-00001.safetensors"
    s1.write_bytes(s1.read_bytes()[:-7])
    s2 = folder / "shard-00002.safetensors"
    raw = bytearray(s2.read_bytes())
    raw[-3] ^= 0xFF  # inside the float data
    s2.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="incomplete"):
        refcache.ReferenceCache.open(folder)
    again = ref.precompute(rec, exs, collate, None, mp)
    assert (again.computed_shards, again.reused_shards) == (2, 2)
    cache = refcache.ReferenceCache.open(folder)
    for i, v in want.items():
        torch.testing.assert_close(cache.lookup([i], 4), v)
    # a third run has nothing to do
    assert ref.precompute(rec, exs, collate, None, mp).computed_shards == 0


def test_shard_modified_after_the_manifest_is_refused(setup, tmp_path):
    rec = _recipe(tmp_path, setup["data"])
    rep = ref.precompute(rec, setup["examples"], setup["collate"], None, setup["mp"])
    p = rep.cache / "shard-00000.safetensors"
    elbo, ids, dig, fp = refcache.read_shard(p)
    elbo = elbo.copy()
    elbo[0, 0] += 1.0
    refcache.write_shard(p, elbo, ids, dig, fp)  # self-consistent, but not what the manifest recorded
    with pytest.raises(UserError, match="does not match its checksum"):
        refcache.ReferenceCache.open(rep.cache)
    with pytest.raises(refcache.ShardError, match="checksum"):
        raw = bytearray(p.read_bytes())
        raw[-1] ^= 0x01
        p.write_bytes(bytes(raw))
        refcache.read_shard(p)


def test_a_shard_edited_in_place_with_size_and_mtime_kept_is_refused_naming_it(setup, tmp_path):
    # Opening the cache hashes each shard's bytes against the manifest: no size-and-mtime shortcut to fool.
    rec = _recipe(tmp_path, setup["data"])
    rep = ref.precompute(rec, setup["examples"], setup["collate"], None, setup["mp"])
    p = rep.cache / "shard-00000.safetensors"
    st = p.stat()
    raw = bytearray(p.read_bytes())
    raw[-4] ^= 0x01  # one bit of a stored value
    p.write_bytes(bytes(raw))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (p.stat().st_size, p.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with pytest.raises(UserError, match="shard-00000.safetensors"):
        refcache.ReferenceCache.open(rep.cache)


def test_folder_digest_trusts_unchanged_files_only(tmp_path, tiny_dir):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(tiny_dir, folder)
    d1, entries = refcache.folder_weights_digest(folder)
    assert {e["name"] for e in entries} == {"config.json", "model.safetensors"}
    # a recorded digest is trusted while size and mtime match (no reread) ...
    fake = [dict(e, sha256="0" * 64) if e["name"] == "model.safetensors" else e for e in entries]
    d_fake, _ = refcache.folder_weights_digest(folder, {e["name"]: e for e in fake})
    assert d_fake != d1
    # ... and ignored once the file changes
    w = folder / "model.safetensors"
    st = w.stat()
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    d2, _ = refcache.folder_weights_digest(folder, {e["name"]: e for e in fake})
    assert d2 == d1


def test_hub_cache_blob_names_are_used_as_digests(tmp_path):
    blobs = tmp_path / "blobs"
    snap = tmp_path / "snapshots" / "abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    digest = "ab" * 32
    (blobs / digest).write_bytes(b"not really weights")
    (snap / "model.safetensors").symlink_to(blobs / digest)
    (snap / "config.json").write_text("{}")
    _, entries = refcache.folder_weights_digest(snap)
    assert {e["name"]: e["sha256"] for e in entries}["model.safetensors"] == digest


def test_no_cache_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no reference cache") as e:
        refcache.ReferenceCache.open(tmp_path / "nothing")
    assert "precompute-ref" in e.value.hint
