"""Two nodes on one box: the harness of tests/test_multinode.py, and the program each node runs.

Harness (imported by the tests): :func:`two_nodes` starts two ``torchrun --nnodes 2 --node_rank {0,1}
--nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT`` agents (gloo, a free port), each
with its own working folder, so that each worker has ``LOCAL_RANK`` 0 but the global ranks are 0 and 1;
:func:`one_process` runs the same program without torchrun, the baseline the launches are compared with.

Node program (what torchrun starts): ``python tests/multinode.py SPEC.json`` runs SPEC's steps, each a
``dllm-align`` command line, one after the other in one process (one interpreter start per node, not per
command) and writes ``$MULTINODE_REPORT`` (JSON: its global, local and node rank and every step's exit
code). A step with ``"launch": "fsdp2"`` trains under FSDP2: accelerate enables FSDP only for GPU
backends, so the accelerator ``train`` makes is switched to FSDP after creation as
tests/dist_invariants.py does (the plugin from the shipped recipes/accelerate/fsdp_8gpu.yaml).
``"die"`` in SPEC makes one global rank kill (SIGKILL: a crashed node, its sockets closed by the kernel)
or freeze (SIGSTOP: a node that stops answering) its whole node, agent included, just before a given
training step (or, with ``"during": "sampling"`` / ``"precompute"``, as it samples its first batch of an online
round / scores its first micro-batch group of the reference); ``"how": "raise"`` raises an error there instead,
its process left to report it; the time of that moment goes to ``die.stamp``.

Note: torchrun ignores ``--node_rank`` with the c10d rendezvous (it says so); ranks follow the sorted
(host, agent pid) of the nodes. The node started first gets rank 0 here, and the reports say which.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


# ---------------------------------------------------------------- harness side


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", DLLM_ALIGN_NO_PROGRESS="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(HERE)]))
    env.pop("DLLM_ALIGN_DEBUG", None)
    env.update(extra or {})
    return env


@dataclass
class Node:
    node_rank: int  # what was passed to torchrun (-1: one process, no torchrun)
    cwd: Path
    rc: Optional[int]
    seconds: float  # from the start to the exit
    ended: float  # time.time() at the exit
    stdout: str
    stderr: str
    report: Optional[dict]  # None when the node program did not get to write it

    @property
    def rank(self) -> Optional[int]:
        return None if self.report is None else self.report["rank"]


def _start(cmd: list, cwd: Path, env: dict, tag: str):
    cwd.mkdir(parents=True, exist_ok=True)
    out = open(cwd / f"{tag}.stdout", "w")
    err = open(cwd / f"{tag}.stderr", "w")
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True)
    return p, out, err


def _finish(procs: list, timeout: float, on_tick=None) -> list[tuple[Optional[int], float]]:
    """Wait for every process; past ``timeout`` every one still running is killed (a hang: AssertionError)."""
    t0 = time.time()
    ended: list = [None] * len(procs)
    while any(e is None for e in ended):
        for i, (p, *_rest) in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.time()
        if on_tick is not None:
            on_tick([p for p, *_r in procs], ended)
        if time.time() - t0 > timeout:
            for p, *_rest in procs:
                _kill_group(p, signal.SIGKILL)
            for p, *_rest in procs:
                p.wait()
            raise AssertionError(f"a node was still running after {timeout:.0f} s: hung")
        time.sleep(0.05)
    for _p, out, err in procs:
        out.close()
        err.close()
    return ended


def _kill_group(p, sig) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _collect(tag_cwds: list, procs: list, ended: list, t0: float) -> list[Node]:
    nodes = []
    for (node_rank, cwd, tag), (p, *_r), end in zip(tag_cwds, procs, ended):
        rep = cwd / f"{tag}.report.json"
        nodes.append(Node(node_rank, cwd, p.returncode, end - t0, end, (cwd / f"{tag}.stdout").read_text(),
                          (cwd / f"{tag}.stderr").read_text(), json.loads(rep.read_text()) if rep.exists() else None))
    return nodes


def two_nodes(spec: dict, cwds: list[Path], spec_path: Path, *, timeout: float = 300, env: Optional[dict] = None,
              on_tick=None) -> list[Node]:
    """Launch the node program on two loopback "nodes" (node_rank 0 in ``cwds[0]``, 1 in ``cwds[1]``)."""
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    procs, tags = [], []
    t0 = time.time()
    for node_rank, cwd in enumerate(cwds):
        tag = f"node{node_rank}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node_rank),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--max-restarts", "0", "--monitor-interval", "0.2", str(HERE / "multinode.py"), str(spec_path)]
        e = node_env(dict(env or {}, MULTINODE_REPORT=str(cwd / f"{tag}.report.json")))
        procs.append(_start(cmd, cwd, e, tag))
        tags.append((node_rank, cwd, tag))
        if node_rank == 0:
            time.sleep(0.3)  # rank order follows agent pids: node 0 first
    ended = _finish(procs, timeout, on_tick)
    return _collect(tags, procs, ended, t0)


def one_process(spec: dict, cwd: Path, spec_path: Path, *, timeout: float = 300) -> Node:
    """The node program in one process without torchrun: the baseline."""
    spec_path.write_text(json.dumps(spec))
    tag = "single"
    e = node_env({"MULTINODE_REPORT": str(cwd / f"{tag}.report.json")})
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    t0 = time.time()
    procs = [_start([sys.executable, str(HERE / "multinode.py"), str(spec_path)], cwd, e, tag)]
    ended = _finish(procs, timeout)
    return _collect([(-1, cwd, tag)], procs, ended, t0)[0]


def by_rank(nodes: list[Node]) -> list[Node]:
    """The nodes ordered by the global rank their worker got."""
    assert all(n.report is not None for n in nodes), [n.stderr[-2000:] for n in nodes]
    return sorted(nodes, key=lambda n: n.rank)


# ---------------------------------------------------------------- node side


def _fsdp2(acc):
    """Switch an accelerator made for gloo to FSDP2 (the CPU stand-in for an FSDP launch)."""
    sys.path.insert(0, str(HERE))
    from dist_invariants import switch_to_fsdp

    return switch_to_fsdp(acc, "fsdp2", acc.mixed_precision)


def _patch(spec: dict, current: dict) -> None:
    import dllm_align.training.distributed as distributed
    import dllm_align.training.train as train_mod

    original = distributed.make_accelerator

    def make_accelerator(recipe):
        acc = original(recipe)
        fsdp = current.get("launch") == "fsdp2" and acc.num_processes > 1  # one process: the baseline
        return _fsdp2(acc) if fsdp else acc

    distributed.make_accelerator = make_accelerator
    train_mod.make_accelerator = make_accelerator

    die = spec.get("die")
    if die and int(os.environ.get("RANK", "-1")) == die["rank"]:
        def dying() -> None:
            Path(die["stamp"]).write_text(json.dumps({"time": time.time(), "how": die["how"]}))
            if die["how"] == "raise":  # a failure that this rank reports itself
                raise RuntimeError(f"injected failure on rank {die['rank']}")
            sig = signal.SIGKILL if die["how"] == "kill" else signal.SIGSTOP
            os.kill(os.getppid(), sig)  # the node's torchrun agent
            os.kill(os.getpid(), sig)

        where = die.get("during", "training")
        if where == "training":
            from dllm_align.training.loop import Run

            step_once = Run.step_once

            def dying_step(self, *a, **kw):
                if self.state.step + 1 == die["before_step"]:
                    dying()
                return step_once(self, *a, **kw)

            Run.step_once = dying_step
        elif where == "sampling":  # the first batch an online round samples on this rank
            from dllm_align.generate import in_process

            generate = in_process.InProcessGenerator.generate

            def dying_generate(self, *a, **kw):
                dying()
                return generate(self, *a, **kw)

            in_process.InProcessGenerator.generate = dying_generate
        elif where == "precompute":  # the first micro-batch group precompute-ref scores on this rank
            from dllm_align.training import reference

            group_values = reference.group_values

            def dying_group(*a, **kw):
                dying()
                return group_values(*a, **kw)

            reference.group_values = dying_group


def _check_shared(folder: str) -> int:
    """The core check alone, with the commands' error manners (one Error line, exit 2)."""
    from accelerate import PartialState

    from dllm_align.core.errors import UserError
    from dllm_align.core.runfolder import check_shared_folder

    PartialState(cpu=True)  # the process group, as every command's accelerator opens it
    try:
        check_shared_folder(folder, settle_s=1.0)
    except UserError as e:
        sys.stderr.write(f"Error: {e.message}\n")
        return e.exit_code
    return 0


def node_main(spec_file: str) -> int:
    import torch

    torch.set_num_threads(1)
    from accelerate.state import AcceleratorState, GradientState

    from dllm_align.cli.app import app

    spec = json.loads(Path(spec_file).read_text())
    current: dict = {}
    _patch(spec, current)
    report = {"rank": int(os.environ.get("RANK", "0")), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
              "group_rank": int(os.environ.get("GROUP_RANK", "0")), "world": int(os.environ.get("WORLD_SIZE", "1")),
              "host": socket.gethostname(), "cwd": os.getcwd(), "steps": []}
    rep_path = Path(os.environ["MULTINODE_REPORT"])
    rc = 0
    for step in spec["steps"]:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        current["launch"] = step.get("launch", "ddp")
        sys.stderr.write(f"== step {step['name']}\n")
        sys.stderr.flush()
        try:
            if "check_shared" in step:
                rc = _check_shared(step["check_shared"])
            else:
                rc = app(args=[str(a) for a in step["argv"]], prog_name="dllm-align", standalone_mode=False)
        except SystemExit as e:
            rc = e.code
        rc = int(rc or 0)
        report["steps"].append({"name": step["name"], "rc": rc})
        rep_path.write_text(json.dumps(report))
        if rc and not spec.get("keep_going"):
            break
    rep_path.write_text(json.dumps(report))
    import torch.distributed as dist

    if rc == 0 and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # left to exit, gloo's threads can abort a finished rank
    sys.stdout.flush()
    sys.stderr.flush()
    return rc


if __name__ == "__main__":
    sys.exit(node_main(sys.argv[1]))
