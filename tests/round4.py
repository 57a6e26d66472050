"""The fourth adversarial round: the newest surfaces (`label`, `online`, recipes, block families, caches,
`benchmarks/gpu_check.py`, the judge under a hostile server), written before any fix.

Every case is a small declarative record (:class:`Case`): the command line, the files it writes first,
the exit code and the substrings its one ``Error:`` line must carry (the file, line, key or flag at
fault), and what must hold on disk afterwards (``absent``: nothing half-written; ``unchanged``: no data
lost). Kill cases (:class:`KillCase`) interrupt `online` at a fault point (``DLLM_ALIGN_FAULT``, with
SIGKILL, SIGINT or SIGTERM as the signal) and rerun it: the rerun must end with the files of an
uninterrupted run.

Each case runs the console entry point in a forked child (torch is imported once, by the parent) with a
wall-clock bound: a case that runs past its ``timeout`` is killed and recorded as a hang, a failure,
never a stuck suite. Nothing here asserts a speed.

    python tests/reliability.py --round 4                 # every case, the table on stdout
    python tests/reliability.py --round 4 --fast          # only the refusals that take < 1 s
    python tests/reliability.py --round 4 -k label- --markdown docs/round4.md

The pytest wrapper is tests/test_reliability_round4.py.
"""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from reliability import Run, snapshot  # noqa: E402

FAST = ["--set", "generate.gen_length=16", "--set", "generate.block_length=16", "--set", "generate.steps=16"]
LABEL = ["label", "demo", "-o", "{t}/lab", "--n", "2", "--limit", "3", *FAST]
ONLINE_SMALL = ["--n", "2", "--limit", "8", *FAST, "--set", "train.batch_size=2", "--set", "reference.n_mc=2",
                "--set", "train.n_mc=2", "--set", "reference.shard_size=4"]
ONLINE = ["online", "demo", "-o", "{t}/on", "--rounds", "2", *ONLINE_SMALL]
KEY = "sk-test-round4-0123456789abcdef"
Content = Union[str, bytes, Callable[["Ctx"], Union[str, bytes]]]


# --------------------------------------------------------------------------- records
@dataclass
class Case:
    id: str
    cls: str                         # the class of the table (label-prompts, label-rule, ...)
    args: list                       # the command line after `dllm-align` ({t}: the case's folder, {root}: shared, {url}: judge server)
    code: Union[int, tuple]          # the exit code(s) expected
    needles: tuple = ()              # substrings of the one Error: line (file / line / key / flag, and what is wrong)
    files: dict = field(default_factory=dict)   # relative path -> content written before the run
    absent: tuple = ("lab", "on", "run", "out")  # paths (relative to {t}) that must not exist afterwards
    unchanged: tuple = ()            # paths (relative to {t}) whose every byte must be as before
    stdout: Optional[str] = "empty"  # "empty", "json" (one JSON document), or None (not checked)
    not_in_err: tuple = ()           # substrings stderr must not hold (e.g. work started before the refusal)
    prep: Optional[Callable] = None  # prep(ctx, t): what exists before the run (an earlier run, a held lock...)
    env: dict = field(default_factory=dict)
    server: Optional[Callable] = None  # server(srv): a judge server on 127.0.0.1 for this case, scripted
    check: Optional[Callable] = None   # check(ctx, t, run, srv) -> problem or None: anything else that must hold
    script: bool = False             # args run as `python ARGS` in a fresh interpreter (benchmarks/gpu_check.py)
    timeout: float = 60.0
    fast: bool = False               # a refusal expected in well under a second: a regular test in the suite
    why: str = ""                    # what the issue expects, when the code alone does not say it


@dataclass
class KillCase:
    id: str
    fault: str                       # DLLM_ALIGN_FAULT, "kill_after_records:N" (N may be "R0+k": k records into round 1)
    sig: str = "KILL"                # KILL, INT (Ctrl-C) or TERM
    code: tuple = (-9,)              # the interrupted run's exit
    cls: str = "online-kill"
    timeout: float = 240.0
    fast: bool = False


@dataclass
class Ctx:
    root: Path
    recipe: Path = None          # a 16-pair toy recipe with a reference cache (cache cases)
    cache: Path = None
    sdar: Path = None            # an SDAR-layout block model folder (config.json, weights, tokenizer)
    straight: Path = None        # an uninterrupted `online` run (kill cases)
    r0_records: int = 0
    url: str = ""


@dataclass
class Result:
    id: str
    cls: str
    expected: str
    got: str
    ok: bool
    problems: list
    seconds: float


# --------------------------------------------------------------------------- running one command
def run_forked(args: list, *, env: dict, cwd: Path, timeout: float, sig: Optional[str] = None) -> tuple[Run, bool]:
    """``dllm-align ARGS`` in a forked child with its own cwd (on sys.path, as ``PYTHONPATH=.`` would put a
    user's rule module); returns (run, timed_out). ``sig`` turns the fault hooks' SIGKILL into that signal."""
    import tempfile

    fd_out, p_out = tempfile.mkstemp(prefix="r4-out-")
    fd_err, p_err = tempfile.mkstemp(prefix="r4-err-")
    sys.stdout.flush()
    sys.stderr.flush()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 70
        try:
            os.setsid()  # its own process group: a hang is killed with everything it started
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(fd_out, 1)
            os.dup2(fd_err, 2)
            sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), write_through=True)
            sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), write_through=True)
            for k, v in {"DLLM_ALIGN_NO_PROGRESS": "1", "DLLM_ALIGN_DEBUG": None, "DLLM_ALIGN_FAULT": None, **env}.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            os.chdir(cwd)
            sys.path.insert(0, str(cwd))
            import torch

            torch.set_num_threads(1)
            # As at a terminal: Ctrl-C raises KeyboardInterrupt, SIGTERM ends the process (a shell's background
            # job would otherwise inherit SIGINT ignored).
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if sig and sig != "KILL":
                from dllm_align.core import faults

                signum = {"INT": signal.SIGINT, "TERM": signal.SIGTERM}[sig]
                faults.kill = lambda: os.kill(os.getpid(), signum)
            from dllm_align.cli.app import main

            try:
                main([str(a) for a in args])
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except KeyboardInterrupt:
            traceback.print_exc()
            code = 72  # a Ctrl-C that escaped the command's own handling
        except BaseException:  # noqa: BLE001 - what the interpreter would print as a traceback
            traceback.print_exc()
            code = 71
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    os.close(fd_out)
    os.close(fd_err)
    deadline = time.monotonic() + timeout
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            timed_out = True
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.02)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    out, err = Path(p_out).read_text(errors="replace"), Path(p_err).read_text(errors="replace")
    os.unlink(p_out)
    os.unlink(p_err)
    return Run(code, out, err), timed_out


def run_script(args: list, *, env: dict, cwd: Path, timeout: float) -> tuple[Run, bool]:
    e = dict(os.environ, PYTHONPATH=str(REPO / "src"), **env)
    try:
        p = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=e, capture_output=True, text=True,
                           timeout=timeout, stdin=subprocess.DEVNULL)
        return Run(p.returncode, p.stdout, p.stderr), False
    except subprocess.TimeoutExpired as x:
        return Run(-9, (x.stdout or b"").decode(errors="replace") if isinstance(x.stdout, bytes) else (x.stdout or ""),
                   (x.stderr or b"").decode(errors="replace") if isinstance(x.stderr, bytes) else (x.stderr or "")), True


# --------------------------------------------------------------------------- checking one case
def _fill(a, ctx: Ctx, t: Path) -> str:
    return (str(a).replace("{t}", str(t)).replace("{root}", str(ctx.root)).replace("{url}", ctx.url)
            .replace("{repo}", str(REPO)).replace("{sdar}", str(ctx.sdar)).replace("{recipe}", str(ctx.recipe)))


def _expected(case) -> str:
    codes = case.code if isinstance(case.code, tuple) else (case.code,)
    s = "exit " + "/".join(map(str, codes))
    if getattr(case, "needles", ()):
        s += ", Error: " + " + ".join(repr(n) for n in case.needles)
    return s


def check_case(case: Case, ctx: Ctx, t: Path, run: Run, timed_out: bool, before: dict, srv) -> list[str]:
    problems = []
    codes = case.code if isinstance(case.code, tuple) else (case.code,)
    if timed_out:
        return [f"hang: still running after {case.timeout:.0f} s (killed)"]
    if run.code not in codes:
        problems.append(f"exit {run.code}")
    errors = [line for line in run.err.splitlines() if line.startswith("Error:")]
    if codes == (130,):  # Ctrl-C: the command says "Interrupted." (the CLI's convention), no Error line needed
        if "Interrupted" not in run.err or len(errors) > 1:
            problems.append("no 'Interrupted.' on Ctrl-C" if "Interrupted" not in run.err else f"{len(errors)} Error: lines")
    elif any(c != 0 for c in codes) and 0 not in codes:
        if len(errors) != 1:
            problems.append(f"{len(errors)} Error: lines")
        else:
            missing = [n for n in case.needles if n not in errors[0]]
            if missing:
                problems.append("Error line lacks " + ", ".join(repr(m) for m in missing))
    if "Traceback (most recent call last)" in run.err:
        problems.append("traceback")
    if case.stdout == "empty" and run.out.strip():
        problems.append("stdout not empty: " + repr(run.out.strip()[:60]))
    elif case.stdout == "json":
        try:
            json.loads(run.out)
        except ValueError:
            problems.append("stdout is not one JSON document: " + repr(run.out.strip()[:60]))
    for s in case.not_in_err:
        if s in run.err:
            problems.append(f"stderr shows {s!r} (work started before the refusal)")
    for rel in case.absent:
        if (t / rel).exists() and rel not in before:
            problems.append(f"{rel} was created")
    for rel, snap in before.items():
        if snapshot(t / rel) != snap:
            problems.append(f"{rel} changed")
    if case.check is not None:
        p = case.check(ctx, t, run, srv)
        if p:
            problems.append(p)
    return problems


def _write(t: Path, rel: str, content, ctx: Ctx) -> None:
    p = t / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    if callable(content):
        content = content(ctx)
    if isinstance(content, str) and len(content) < 100_000:
        content = _fill(content, ctx, t)
    p.write_bytes(content if isinstance(content, bytes) else content.encode())


def run_case(case: Case, ctx: Ctx, t: Path) -> Result:
    from judge_server import JudgeServer

    shutil.rmtree(t, ignore_errors=True)  # a case starts from an empty folder, also when --keep reruns it
    t.mkdir(parents=True)
    for rel, content in case.files.items():
        _write(t, rel, content, ctx)
    srv = None
    t0 = time.monotonic()
    try:
        if case.server is not None:
            srv = JudgeServer(KEY).__enter__()
            case.server(srv)
            ctx.url = srv.url
        hold = case.prep(ctx, t) if case.prep else None
        before = {rel: snapshot(t / rel) for rel in case.unchanged if (t / rel).exists()}
        for rel in case.absent:  # what prep made is not the case's doing
            if (t / rel).exists():
                before.setdefault(rel, snapshot(t / rel))
        args = [_fill(a, ctx, t) for a in case.args]
        env = {"OPENAI_API_KEY": KEY, **{k: (_fill(v, ctx, t) if v is not None else None) for k, v in case.env.items()}}
        t0 = time.monotonic()
        if case.script:
            run, timed_out = run_script(args, env={k: v for k, v in env.items() if v is not None}, cwd=t, timeout=case.timeout)
        else:
            run, timed_out = run_forked(args, env=env, cwd=t, timeout=case.timeout)
        seconds = time.monotonic() - t0
        if hold is not None and hasattr(hold, "__exit__"):
            hold.__exit__(None, None, None)
        problems = check_case(case, ctx, t, run, timed_out, before, srv)
        errors = [line for line in run.err.splitlines() if line.startswith("Error:")]
        got = "hang" if timed_out else f"exit {run.code}" + (f", {errors[0][:160]}" if errors else "")
    except Exception as e:  # noqa: BLE001 - a broken case is a failure of the case, with its reason
        seconds = time.monotonic() - t0
        problems, got = [f"harness: {type(e).__name__}: {e}"], "harness error"
    finally:
        if srv is not None:
            srv.__exit__(None, None, None)
    return Result(case.id, case.cls, _expected(case), got, not problems, problems, seconds)


# --------------------------------------------------------------------------- kill cases
TIMING = {"created", "seconds", "steps_per_s", "tokens_per_s", "examples_per_s", "elapsed", "wall_seconds", "time", "started", "finished",
          "duration_s", "when"}


def _scrub(v):
    if isinstance(v, dict):
        return {k: _scrub(x) for k, x in v.items() if k not in TIMING and k != "sha256"}
    if isinstance(v, list):
        return [_scrub(x) for x in v]
    return v


def _text(p: Path, folder: Path) -> str:
    return p.read_text().replace(str(folder), "<run>")


def comparable(folder: Path) -> dict:
    """Every file of an `online` run folder as what must be equal between two runs: JSON and JSONL without
    wall-clock fields, safetensors as tensors and metadata, other files byte for byte (the plot excepted)."""
    from safetensors import safe_open

    out = {}
    for p in sorted(folder.rglob("*")):
        if not p.is_file() or p.suffix == ".png" or p.name.startswith("run_info"):
            continue
        rel = p.relative_to(folder).as_posix()
        if p.suffix == ".safetensors":
            with safe_open(str(p), framework="pt") as f:
                out[rel] = ({k: f.get_tensor(k).numpy().tobytes() for k in f.keys()}, f.metadata())
        elif p.suffix == ".jsonl":
            out[rel] = [_scrub(json.loads(x)) for x in _text(p, folder).splitlines()]
        elif p.suffix == ".json" and p.name != "checksums.json":
            out[rel] = _scrub(json.loads(_text(p, folder)))
        elif p.name == "checksums.json":
            out[rel] = sorted(json.loads(p.read_text()).get("files", {}))
        elif p.suffix in (".yaml", ".txt", ".md", ".jinja"):
            out[rel] = _text(p, folder)
        else:
            out[rel] = p.read_bytes()
    return out


def run_kill(kc: KillCase, ctx: Ctx, t: Path) -> Result:
    from reliability import stray_temps

    shutil.rmtree(t, ignore_errors=True)
    t.mkdir(parents=True)
    fault = kc.fault
    if "R0+" in fault:
        kind, _, n = fault.partition(":")
        fault = f"{kind}:{ctx.r0_records + int(n.split('+')[1])}"
    args = [_fill(a, ctx, t) for a in ONLINE]
    problems = []
    t0 = time.monotonic()
    k, timed_out = run_forked(args, env={"DLLM_ALIGN_FAULT": fault}, cwd=t, timeout=kc.timeout, sig=kc.sig)
    first = "hang" if timed_out else f"exit {k.code}"
    if timed_out:
        problems.append(f"the interrupted run hung past {kc.timeout:.0f} s")
    elif k.code not in kc.code:
        problems.append(f"interrupted run: exit {k.code}, expected {'/'.join(map(str, kc.code))}")
    if "Traceback (most recent call last)" in k.err:
        problems.append("interrupted run printed a traceback")
    if "R0+" in kc.fault and not timed_out and not (t / "on" / "round-0" / "train.done").exists():
        problems.append("harness: the interruption did not land in round 1")  # round 0 must be finished first
    if kc.sig != "KILL" and k.code in kc.code and len([x for x in k.err.splitlines() if x.startswith("Error:")]) > 1:
        problems.append("more than one Error line on interruption")
    r, timed_out = run_forked(args, env={}, cwd=t, timeout=kc.timeout)
    if timed_out or r.code != 0:
        problems.append("rerun " + ("hung" if timed_out else f"exit {r.code}: " + next(
            (x for x in r.err.splitlines() if x.startswith("Error:")), r.err.strip().splitlines()[-1:] and r.err.strip().splitlines()[-1] or "")))
    else:
        a, b = comparable(ctx.straight), comparable(t / "on")
        diff = sorted(set(a) ^ set(b)) + sorted(x for x in set(a) & set(b) if a[x] != b[x])
        if diff:
            problems.append("rerun differs from an uninterrupted run: " + ", ".join(diff[:4]))
        if stray_temps(t / "on"):
            problems.append("temporary files left: " + ", ".join(stray_temps(t / "on")[:3]))
    seconds = time.monotonic() - t0
    expected = f"{kc.sig} at {kc.fault}: exit {'/'.join(map(str, kc.code))}; rerun exit 0, files as uninterrupted"
    got = f"{first}; rerun " + ("ok" if not problems else "; ".join(problems))[:200]
    return Result(kc.id, kc.cls, expected, got, not problems, problems, seconds)


# --------------------------------------------------------------------------- shared setup
def make_ctx(root: Path, *, need_cache: bool = False, need_sdar: bool = False, need_straight: bool = False) -> Ctx:
    ctx = Ctx(root=root)
    root.mkdir(parents=True, exist_ok=True)
    if need_cache and ctx.cache is None:
        _make_cache(ctx)
    if need_sdar:
        _make_sdar(ctx)
    if need_straight:
        _make_straight(ctx)
    return ctx


def _make_cache(ctx: Ctx) -> None:
    import yaml
    from fixtures.sort_toy import write_pairs

    root = ctx.root / "cachebase"
    root.mkdir(exist_ok=True)
    data = write_pairs(root / "pairs.jsonl", n=16)
    recipe = {"name": "round4", "model": {"name_or_path": "builtin:tiny"},
              "data": {"train": str(data), "format": "paired", "max_length": 64},
              "reference": {"n_mc": 4, "batch_size": 8, "shard_size": 8, "cache": str(root / "ref_cache")},
              "train": {"lr": 1e-3, "batch_size": 2, "max_steps": 2, "save_every": None}}
    ctx.recipe = root / "toy.yaml"
    ctx.recipe.write_text(yaml.safe_dump(recipe))
    r, _ = run_forked(["precompute-ref", ctx.recipe, "-o", root / "run"], env={}, cwd=root, timeout=300)
    assert r.code == 0, r.err
    ctx.cache = root / "ref_cache"


def _make_sdar(ctx: Ctx) -> None:
    from safetensors.torch import save_file

    from dllm_align.models.families.dream import build_dream_tokenizer
    from fixtures.family_checkpoints import sdar_state

    cfg = json.loads((HERE / "fixtures" / "sdar_1.7b_chat_config.json").read_text())
    tok = build_dream_tokenizer()
    cfg["vocab_size"] = max(cfg["vocab_size"], len(tok))  # room for every id the toy prompts tokenize to
    folder = ctx.root / "sdar"
    if not (folder / "model.safetensors").exists():
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(cfg))
        save_file({k: v.contiguous() for k, v in sdar_state(cfg).items()}, str(folder / "model.safetensors"))
        tok.save_pretrained(folder)
    ctx.sdar = folder


def _make_straight(ctx: Ctx) -> None:
    t = ctx.root / "straight"
    if not (t / "on" / "rounds.json").exists():
        shutil.rmtree(t, ignore_errors=True)
        t.mkdir()
        r, timed_out = run_forked([_fill(a, ctx, t) for a in ONLINE], env={}, cwd=t, timeout=600)
        assert r.code == 0 and not timed_out, r.err
    ctx.straight = t / "on"
    r0 = ctx.straight / "round-0"
    ctx.r0_records = len(list((r0 / "ref_cache").glob("shard-*.safetensors"))) + len((r0 / "metrics.jsonl").read_text().splitlines())


# --------------------------------------------------------------------------- the table
def table(results: list[Result]) -> str:
    lines = ["| case | class | expected | got | result |", "|---|---|---|---|---|"]
    for r in results:
        got = r.got.replace("|", "\\|").replace("\n", " ")
        exp = r.expected.replace("|", "\\|")
        lines.append(f"| `{r.id}` | {r.cls} | {exp} | {got} | {'pass' if r.ok else 'FAIL: ' + '; '.join(r.problems)[:160].replace('|', '/')} |")
    return "\n".join(lines)


def summary(results: list[Result]) -> str:
    by: dict[str, list[Result]] = {}
    for r in results:
        by.setdefault(r.cls, []).append(r)
    lines = ["| class | cases | pass | fail |", "|---|---|---|---|"]
    for cls, rs in by.items():
        lines.append(f"| {cls} | {len(rs)} | {sum(r.ok for r in rs)} | {sum(not r.ok for r in rs)} |")
    lines.append(f"| **all** | {len(results)} | {sum(r.ok for r in results)} | {sum(not r.ok for r in results)} |")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    import argparse
    import tempfile

    from round4_cases import CASES, KILLS

    ap = argparse.ArgumentParser(prog="tests/reliability.py --round 4", description=__doc__.split("\n\n")[0])
    ap.add_argument("--fast", action="store_true", help="only the fast refusals (the suite's subset)")
    ap.add_argument("--slow", action="store_true", help="only the cases outside the fast subset, and the kills")
    ap.add_argument("-k", default="", help="only cases whose id contains this")
    ap.add_argument("--no-kills", action="store_true", help="leave out the kill-and-rerun cases")
    ap.add_argument("--markdown", help="also write the table here")
    ap.add_argument("--json", help="also write the results here as JSON")
    ap.add_argument("--keep", help="run in this folder and keep it (default: a temporary folder)")
    a = ap.parse_args(argv)
    cases = [c for c in CASES if a.k in c.id and (c.fast or not a.fast) and not (a.slow and c.fast)]
    kills = [] if (a.fast or a.no_kills) else [k for k in KILLS if a.k in k.id]
    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="round4-"))
    ctx = make_ctx(root / "shared", need_cache=any(c.id.startswith("cache-") for c in cases),
                   need_sdar=any("{sdar}" in " ".join(map(str, c.args)) or c.cls == "block" for c in cases),
                   need_straight=bool(kills))
    results = []
    for c in cases:
        r = run_case(c, ctx, root / "cases" / c.id)
        print(f"{'pass' if r.ok else 'FAIL'} {r.id} ({r.seconds:.1f} s): {r.got[:150]}" + ("" if r.ok else f"  <- {'; '.join(r.problems)}"),
              file=sys.stderr, flush=True)
        results.append(r)
    for k in kills:
        r = run_kill(k, ctx, root / "cases" / k.id)
        print(f"{'pass' if r.ok else 'FAIL'} {r.id} ({r.seconds:.1f} s): {r.got[:200]}", file=sys.stderr, flush=True)
        results.append(r)
    md = summary(results) + "\n\n" + table(results) + "\n"
    print(md)
    if a.markdown:
        Path(a.markdown).write_text(md)
    if a.json:
        Path(a.json).write_text(json.dumps([r.__dict__ for r in results], indent=1))
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r.ok for r in results) else 1
