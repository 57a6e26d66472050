"""Two nodes on one box (``-m multinode``): the commands launched as two torchrun "nodes" over loopback
(tests/multinode.py: gloo, c10d rendezvous, each worker LOCAL_RANK 0, global ranks 0 and 1) give what one
process gives, a run folder the nodes do not share is refused, and a node that dies does not hang the other.

* shared disk: ``precompute-ref`` (the same cache), ``train`` under DDP and FSDP2 with 2 micro-batches per
  step (the same weights as one process, to the tolerance of tests/test_invariants_distributed.py),
  ``generate`` (the same rows) and ``online`` for one round (the same weights), in one launch;
* node-local disks (each node its own working folder, the same relative ``-o``): the core check
  (:func:`dllm_align.core.runfolder.check_shared_folder`) refuses on every rank with one line, and so do
  ``precompute-ref``, ``train`` and ``generate``, before they write anything;
* a node that dies during training (SIGKILL of node 1's agent and worker, checkpoint every step): node 0
  exits with one error line saying another node stopped, instead of hanging; ``--resume`` on both nodes ends with the uninterrupted
  weights. A node that stops answering (SIGSTOP) is left to the process-group timeout (slow).

They run by default (CI runs the whole suite): three two-node launches and their one-process baseline,
~130 s on 2 shared CPU cores; ``-m multinode`` selects them, ``-m "not multinode"`` leaves them out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import multinode as mn  # noqa: E402

pytestmark = [pytest.mark.multinode, pytest.mark.multiproc]

# The toy sorting task on its packaged base model: 16 rows, 2 rows per process and micro-batch,
# a global batch of 8 (2 micro-batches per step on 2 processes, 4 on one), 2 steps; shards of 4 rows. adam_eps
# 1e-6: with the default 1e-8, lm_head rows of tokens the batch hardly sees (|g| ~ 1e-9, a sum that cancels)
# turn summation-order rounding into ~1e-5 weight differences; 1e-6 keeps the comparison on real updates.
SETS = ["data.limit=16", "reference.n_mc=2", "reference.shard_size=4", "reference.batch_size=8", "train.n_mc=2",
        "train.batch_size=2", "train.global_batch_size=8", "train.max_steps=2", "train.save_every=null",
        "train.warmup_ratio=0", "train.scheduler=constant", "train.lr=1e-3", "train.max_grad_norm=0.05",
        "train.adam_eps=1e-6",
        "train.process_group_timeout_minutes=0.5"]
GEN = ["--limit", "6", "--batch-size", "2"]
ONLINE = ["--rounds", "1", "--n", "2", "--limit", "4", "--set", "train.batch_size=2", "--set", "train.global_batch_size=4",
          "--set", "reference.n_mc=2", "--set", "train.n_mc=2", "--set", "generate.batch_size=4"]


THREE = ["train.max_steps=3", "train.save_every=1"]


def _sets(*extra: str) -> list[str]:
    out = []
    for s in (*SETS, *extra):
        out += ["--set", s]
    return out


def pipeline_steps(run: str) -> list[dict]:
    """The commands of the shared-disk launch, all writing under ``run``."""
    return [
        {"name": "shared-check", "check_shared": f"{run}/ddp"},
        {"name": "precompute-ref", "argv": ["precompute-ref", "demo", "-o", f"{run}/ddp", *_sets()]},
        {"name": "train-ddp", "argv": ["train", "demo", "-o", f"{run}/ddp", *_sets()]},
        {"name": "train-fsdp2", "launch": "fsdp2",
         "argv": ["train", "demo", "-o", f"{run}/fsdp2", *_sets(f"reference.cache={run}/ddp/ref_cache")]},
        {"name": "generate", "argv": ["generate", "demo", "-o", f"{run}/gen", *GEN]},
        {"name": "online", "argv": ["online", "demo", "-o", f"{run}/online", *ONLINE]},
    ]


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        # fp32; gradients summed in another order (all-reduce vs accumulation): ~1e-7 after Adam at lr 1e-3
        torch.testing.assert_close(got[k], want[k], atol=2e-6, rtol=0, msg=lambda m, k=k: f"{what} {k}: {m}")


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


def _cache_values(folder: Path) -> dict:
    from safetensors import safe_open

    out = {}
    manifest = json.loads((folder / "manifest.json").read_text())
    for s in manifest["shards"]:
        with safe_open(str(folder / s["file"]), "pt") as f:
            out[s["file"]] = {k: f.get_tensor(k) for k in f.keys()}
    return {"fingerprint": manifest["fingerprint"], "shards": out}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One two-node launch and one single process, every command, on a disk both nodes see."""
    root = tmp_path_factory.mktemp("shared")
    spec = {"steps": pipeline_steps(str(root / "nodes"))}
    nodes = mn.two_nodes(spec, [root / "n0", root / "n1"], root / "spec-nodes.json", timeout=900)
    s = str(root / "single")
    steps = pipeline_steps(s) + [  # the baseline of the node-that-dies test: 3 steps, a checkpoint every step
        {"name": "train-3", "argv": ["train", "demo", "-o", f"{s}/three", *_sets(*THREE, f"reference.cache={s}/ddp/ref_cache")]}]
    single = mn.one_process({"steps": steps}, root / "s", root / "spec-single.json", timeout=900)
    return {"root": root, "nodes": nodes, "single": single}


def test_two_nodes_ran_every_command_with_local_rank_0_and_global_ranks_0_1(shared):
    nodes = mn.by_rank(shared["nodes"])
    for n in nodes + [shared["single"]]:
        assert n.rc == 0, n.stderr[-3000:]
        assert all(s["rc"] == 0 for s in n.report["steps"]) and len(n.report["steps"]) >= 6, n.report
    assert [(n.report["rank"], n.report["local_rank"], n.report["world"]) for n in nodes] == [(0, 0, 2), (1, 0, 2)]
    assert {n.report["group_rank"] for n in nodes} == {0, 1}  # two torchrun agents: two "nodes"


def test_precompute_ref_across_nodes_is_the_one_process_cache(shared):
    root = shared["root"]
    two = _cache_values(root / "nodes" / "ddp" / "ref_cache")
    one = _cache_values(root / "single" / "ddp" / "ref_cache")
    assert len(one["shards"]) == 4  # 16 rows in shards of 4: both ranks computed rows of every shard
    assert two["fingerprint"] == one["fingerprint"]
    for name, tensors in one["shards"].items():
        for k, v in tensors.items():
            torch.testing.assert_close(two["shards"][name][k], v, atol=1e-6, rtol=0, msg=lambda m, k=k: f"{name} {k}: {m}")


@pytest.mark.parametrize("launch", ["ddp", "fsdp2"])
def test_train_across_nodes_ends_with_the_one_process_weights(shared, launch):
    root = shared["root"]
    want = _weights(root / "single" / launch / "final")
    got = _weights(root / "nodes" / launch / "final")
    _close(got, want, launch)
    one = _rows(root / "single" / launch / "metrics.jsonl")
    two = _rows(root / "nodes" / launch / "metrics.jsonl")
    assert [r["step"] for r in two] == [1, 2] and one[0]["grad_norm"] > 0.05  # step 1 clipped
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
    summary = json.loads((root / "nodes" / launch / "final" / "training_summary.json").read_text())
    assert summary["processes"] == 2 and summary["global_batch_size"] == 8


def test_generate_across_nodes_writes_the_one_process_rows(shared):
    root = shared["root"]
    one = _rows(root / "single" / "gen" / "gen.test.jsonl")
    two = _rows(root / "nodes" / "gen" / "gen.test.jsonl")
    assert len(one) == 6 and [r["id"] for r in two] == [r["id"] for r in one]
    assert [r["completion"] for r in two] == [r["completion"] for r in one]
    assert not list((root / "nodes" / "gen").glob("*.part*.jsonl"))  # merged on rank 0, parts removed


def test_online_round_across_nodes_is_the_one_process_round(shared):
    root = shared["root"]
    one = root / "single" / "online" / "round-0"
    two = root / "nodes" / "online" / "round-0"
    assert (two / "labelled.jsonl").read_text() == (one / "labelled.jsonl").read_text()
    _close(_weights(two / "final"), _weights(one / "final"), "online round 0")


def test_a_shared_run_folder_passes_the_check_and_keeps_no_probe(shared):
    assert shared["nodes"][0].report["steps"][0] == {"name": "shared-check", "rc": 0}
    assert not list((shared["root"] / "nodes" / "ddp").glob(".shared-probe-*"))


# -------------------------------------------------------------- node-local disks


@pytest.fixture(scope="module")
def local_disks(tmp_path_factory):
    """Each node its own working folder, every command given the same relative run folder: what a
    node-local disk (/tmp, local NVMe) at the same path on every node looks like to the processes."""
    root = tmp_path_factory.mktemp("local")
    spec = {"keep_going": True, "steps": [
        {"name": "check", "check_shared": "run"},
        {"name": "precompute-ref", "argv": ["precompute-ref", "demo", "-o", "run", *_sets()]},
        {"name": "train", "argv": ["train", "demo", "-o", "run", *_sets("reference.mode=online")]},
        {"name": "generate", "argv": ["generate", "demo", "-o", "gen", *GEN]},
    ]}
    nodes = mn.two_nodes(spec, [root / "n0", root / "n1"], root / "spec.json", timeout=600)
    return {"root": root, "nodes": mn.by_rank(nodes)}


def _step_rc(node, name):
    return next(s["rc"] for s in node.report["steps"] if s["name"] == name)


def _refused(nodes, name):
    for n in nodes:
        assert _step_rc(n, name) == 2, (name, n.report, n.stderr[-2000:])
        assert "is not shared between the nodes: rank(s) 1 " in n.stderr, n.stderr[-2000:]


def test_the_core_check_refuses_a_folder_the_nodes_do_not_share(local_disks):
    nodes = local_disks["nodes"]
    _refused(nodes, "check")
    for n in nodes:
        # one line per refused step (the check itself, then precompute-ref, train and generate), nothing else
        lines = [x for x in n.stderr.splitlines() if x.startswith("Error:")]
        assert len(lines) == 4 and all("is not shared between the nodes" in x for x in lines), n.stderr[-2000:]
    assert not list((nodes[0].cwd / "run").glob(".shared-probe-*"))  # the probe is removed
    assert not (nodes[1].cwd / "run").exists() or not any((nodes[1].cwd / "run").glob(".shared-probe-*"))


def test_precompute_ref_refuses_a_cache_the_nodes_do_not_share(local_disks):
    _refused(local_disks["nodes"], "precompute-ref")
    assert not (local_disks["nodes"][0].cwd / "run" / "ref_cache" / "manifest.json").exists()


def test_train_refuses_a_run_folder_the_nodes_do_not_share(local_disks):
    _refused(local_disks["nodes"], "train")
    assert not (local_disks["nodes"][0].cwd / "run" / "metrics.jsonl").exists()


def test_generate_refuses_an_output_folder_the_nodes_do_not_share(local_disks):
    """Refused before a row is written: without the check, rank 0 merged only the part files it saw and
    gen.test.jsonl silently lacked rank 1's rows."""
    _refused(local_disks["nodes"], "generate")
    for n in local_disks["nodes"]:
        assert not list((n.cwd / "gen").glob("gen.test*.jsonl")), n.cwd


# -------------------------------------------------------------- a node that dies


def _kill_run(shared, how: str, timeout_min: float):
    root = shared["root"]
    run = root / f"die-{how}"
    stamp = root / f"die-{how}.stamp"
    argv = ["train", "demo", "-o", str(run), *_sets(*THREE, f"reference.cache={root}/nodes/ddp/ref_cache",
                                                   f"train.process_group_timeout_minutes={timeout_min}")]
    spec = {"steps": [{"name": "train", "argv": argv}],
            "die": {"rank": 1, "before_step": 3, "how": how, "stamp": str(stamp)}}

    def reap(procs, ended):  # a frozen node never exits by itself: once node 0 is done, it is killed
        if ended[0] is not None and ended[1] is None:
            mn._kill_group(procs[1], 9)
            for pid in _stopped_children(procs[1].pid):
                mn.os.kill(pid, 9)

    nodes = mn.two_nodes(spec, [run.parent / f"{how}-n0", run.parent / f"{how}-n1"], root / f"die-{how}.json",
                         timeout=timeout_min * 60 + 240, on_tick=reap)
    return run, argv, stamp, nodes


def _stopped_children(pid):
    import subprocess

    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _node0(nodes):
    n0 = next(n for n in nodes if n.node_rank == 0)
    assert n0.report is not None and n0.rank == 0, n0.stderr[-2000:]
    return n0


@pytest.fixture(scope="module")
def killed(shared):
    run, argv, stamp, nodes = _kill_run(shared, "kill", 0.5)
    return {"run": run, "argv": argv, "stamp": stamp, "nodes": nodes, "shared": shared}


def test_node0_exits_with_an_error_line_when_node1_is_killed(killed):
    n0 = _node0(killed["nodes"])
    died = json.loads(killed["stamp"].read_text())["time"]
    assert n0.rc not in (0, None)
    assert n0.report["steps"] == [{"name": "train", "rc": 1}]
    errors = [x for x in n0.stderr.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1, n0.stderr[-3000:]
    print(f"node 0 exited {n0.ended - died:.1f} s after node 1 was killed: {errors[0]}")
    assert (killed["run"] / "checkpoints" / "step-2").is_dir() and not (killed["run"] / "final").exists()


def test_node0s_error_says_another_node_stopped(killed):
    n0 = _node0(killed["nodes"])
    line = next(x for x in n0.stderr.splitlines() if x.startswith("Error:"))
    assert line.startswith("Error: another node or process of this launch stopped (rank 1; this is rank 0 of 2)"), line
    assert "Hint: " in n0.stderr and "--resume" in n0.stderr


def test_resume_on_both_nodes_after_the_kill_ends_with_the_uninterrupted_weights(killed):
    root = killed["shared"]["root"]
    spec = {"steps": [{"name": "resume", "argv": [*killed["argv"], "--resume"]}]}
    nodes = mn.two_nodes(spec, [root / "resume-n0", root / "resume-n1"], root / "resume.json", timeout=600)
    for n in nodes:
        assert n.rc == 0, n.stderr[-3000:]
    assert "resuming from" in _node0(nodes).stderr and "step 2 of 3" in _node0(nodes).stderr
    _close(_weights(killed["run"] / "final"), _weights(root / "single" / "three" / "final"), "resumed")


@pytest.mark.slow
def test_node0_exits_within_the_timeout_when_node1_stops_answering(shared):
    """SIGSTOP: node 1's sockets stay open and silent, as when a machine hangs or its network goes; node 0
    waits in the collective until train.process_group_timeout_minutes (0.25 here), then exits with an error.
    Slow: the test waits the whole timeout by design."""
    run, _argv, stamp, nodes = _kill_run(shared, "stop", 0.25)
    n0 = _node0(nodes)
    died = json.loads(stamp.read_text())["time"]
    errors = [x for x in n0.stderr.splitlines() if x.startswith("Error:")]
    assert n0.rc not in (0, None) and len(errors) == 1, n0.stderr[-3000:]
    print(f"node 0 exited {n0.ended - died:.1f} s after node 1 froze (timeout 15 s): {errors[0]}")


def test_each_node_downloads_a_hub_model_once(tmp_path, tiny_dir):
    """Two nodes of two processes each (every node its own Hugging Face cache), all asking for the same hub model
    at once from a counting stand-in of the Hub on 127.0.0.1: each file is downloaded once per node, and every
    process reads the one local copy of its node."""
    import os
    import subprocess
    import time

    repo = tmp_path / "hub" / "repo"
    repo.mkdir(parents=True)
    for p in tiny_dir.iterdir():
        if p.is_file():
            (repo / p.name).write_bytes(p.read_bytes())
    port_file = tmp_path / "port"
    server = subprocess.Popen([sys.executable, str(HERE / "hub_server.py"), str(repo), "org/tiny", str(port_file)])
    try:
        for _ in range(100):
            if port_file.exists() and port_file.read_text():
                break
            time.sleep(0.1)
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{port_file.read_text()}"
        code = "from dllm_align.models.load import resolve_model_path; print(resolve_model_path('org/tiny'))"
        procs = [subprocess.Popen([sys.executable, "-c", code], env={**env, "HF_HOME": str(tmp_path / f"node{n}")},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for n in (0, 1) for _ in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        server.kill()
        server.wait()
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    paths = [o[0].strip() for o in outs]
    assert paths[0] == paths[1] and paths[2] == paths[3] and paths[0] != paths[2]
    counts = json.loads((tmp_path / "hub" / "counts.json").read_text())
    files = [n for n in counts if n not in ("api", "HEAD")]
    assert any(n.endswith(".safetensors") for n in files) and all(counts[n] == 2 for n in files), counts  # once per node
    # and only one process per node asks the Hub about them (huggingface_hub's own file locks already keep each
    # file's content to one GET per cache, but without the node's lock every process asks for every file: 18 here)
    assert counts["HEAD"] == 2 * len(files), counts


@pytest.mark.parametrize("during,argv", [
    ("sampling", ["online", "demo", *ONLINE]),
    ("precompute", ["precompute-ref", "demo", *_sets()]),
])
def test_a_rank_killed_while_sampling_or_precomputing_ends_the_launch_within_30_s(tmp_path, during, argv):
    """Node 1 killed (SIGKILL, agent included) as it samples an online round's first batch / scores its first
    reference group: node 0, waiting for it in the gather, exits within 30 s with one error line naming rank 1."""
    run = tmp_path / "run"
    stamp = tmp_path / "died.stamp"
    cmd = [argv[0], argv[1], "-o", str(run), *argv[2:]]
    spec = {"steps": [{"name": during, "argv": cmd}], "die": {"rank": 1, "how": "kill", "during": during, "stamp": str(stamp)}}
    nodes = mn.two_nodes(spec, [tmp_path / "n0", tmp_path / "n1"], tmp_path / "spec.json", timeout=300)
    n0 = _node0(nodes)
    died = json.loads(stamp.read_text())["time"]
    errors = [x for x in n0.stderr.splitlines() if x.startswith("Error:")]
    assert n0.rc not in (0, None) and len(errors) == 1, n0.stderr[-3000:]
    assert errors[0].startswith("Error: another node or process of this launch stopped (rank 1; this is rank 0 of 2)"), errors
    print(f"{during}: node 0 exited {n0.ended - died:.1f} s after node 1 was killed")
    assert n0.ended - died < 30


@pytest.mark.parametrize("during,argv", [
    ("sampling", ["online", "demo", *ONLINE]),
    ("precompute", ["precompute-ref", "demo", *_sets()]),
])
def test_a_rank_that_fails_while_sampling_or_precomputing_ends_the_launch_with_its_error(tmp_path, during, argv):
    """Node 1 raises as it samples / scores: it exits with its own error line, and node 0, waiting for it in the
    gather, exits within 30 s with one line naming rank 1."""
    stamp = tmp_path / "failed.stamp"
    spec = {"steps": [{"name": during, "argv": [argv[0], argv[1], "-o", str(tmp_path / "run"), *argv[2:]]}],
            "die": {"rank": 1, "how": "raise", "during": during, "stamp": str(stamp)}}
    nodes = mn.two_nodes(spec, [tmp_path / "n0", tmp_path / "n1"], tmp_path / "spec.json", timeout=300)
    n0 = _node0(nodes)
    n1 = next(n for n in nodes if n.node_rank != n0.node_rank)
    failed = json.loads(stamp.read_text())["time"]
    assert "Error: RuntimeError: injected failure on rank 1" in n1.stderr, n1.stderr[-3000:]
    errors = [x for x in n0.stderr.splitlines() if x.startswith("Error:")]
    assert n0.rc not in (0, None) and len(errors) == 1, n0.stderr[-3000:]
    assert "rank 1" in errors[0], errors
    print(f"{during}: node 0 exited {n0.ended - failed:.1f} s after rank 1 failed: {errors[0][:120]}")
    assert n0.ended - failed < 30
