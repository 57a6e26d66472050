"""Secrets and code execution (SECURITY.md).

* A planted API key never reaches a file, a log line, a progress line or an
  error, whether the judge succeeds, fails, is killed or runs with
  DLLM_ALIGN_DEBUG=1, live or through the Batch API (the request files
  written and uploaded, the results downloaded) - even when the server quotes
  the key back.
* Nothing in src/ unpickles user files or evaluates text as code (an AST scan).
* Recipes are read with a safe YAML loader.
* A model's own code runs only when trust_remote_code is turned on, and the tool
  says so on stderr.
* The judge contacts only --base-url: no redirects, no proxies.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path

import pytest

from judge_server import JudgeServer, answer
from reliability import files_under, run_cli, run_killed

SRC = Path(__file__).resolve().parents[1] / "src" / "dllm_align"
KEY = "sk-proj-PLANTEDsecret-4f3e2d1c0b9a8877"
IDS = [f"p{i}" for i in range(6)]


def _gens(tmp: Path) -> tuple[Path, Path]:
    out = []
    for m in ("A", "B"):
        p = tmp / f"{m.lower()}.jsonl"
        p.write_text("".join(json.dumps({"id": i, "prompt": f"Q {i}?", "completion": answer(m, i)}) + "\n" for i in IDS))
        out.append(p)
    return out[0], out[1]


def _leaks(text: str) -> list[str]:
    """The key, or any 8-character piece of it, in ``text``."""
    pieces = {KEY[i:i + 8] for i in range(len(KEY) - 7)}
    return sorted(p for p in pieces if p in text)


def _everything(tmp: Path, *runs) -> str:
    """Every file the runs produced (the whole tmp folder), their stdout / stderr / tracebacks."""
    text = [p.read_bytes().decode("utf-8", "replace") for p in files_under(tmp)]
    for r in runs:
        text += [r.out, r.err, r.traceback]
    return "\n".join(text)


def test_a_planted_key_never_leaves_the_environment(tmp_path):
    a, b = _gens(tmp_path)
    env = {"OPENAI_API_KEY": KEY}
    base = ["judge", a, b, "--judge", "m", "--timeout", "2", "--retry-delay", "0.01", "--bootstrap", "100"]
    runs = []
    with JudgeServer(KEY, echo_auth=True) as srv:  # replies and errors quote "Bearer <key>" back
        url = ["--base-url", srv.url]
        # 1. a run that succeeds
        runs.append(run_cli(base + url + ["-o", tmp_path / "ok"], env=env))
        assert runs[-1].code == 0, runs[-1].err
        assert "Bearer ***" in (tmp_path / "ok" / "cache.jsonl").read_text()  # the echo was there, and scrubbed
        # 2. judgements that fail: 400 (quoted back), 500s until the retries run out, replies with no verdict
        srv.faults = {("m2", "p0", "AB"): ["400"], ("m2", "p1", "AB"): ["500"] * 5, ("m2", "p2", "BA"): ["forever-garbage"]}
        runs.append(run_cli(base + url + ["--judge", "m2", "--max-retries", "2", "--max-parse-retries", "1",
                                          "-o", tmp_path / "failing"], env=env))
        assert runs[-1].code == 1 and "judgement(s) failed" in runs[-1].err
        assert "context too long (you sent Bearer ***)" in runs[-1].err  # the reason is shown, the key is not
        # 3. the same, with DLLM_ALIGN_DEBUG=1 (the exception escapes with its traceback)
        runs.append(run_cli(base + url + ["--judge", "m2", "--max-retries", "0", "-o", tmp_path / "debug"],
                            env={**env, "DLLM_ALIGN_DEBUG": "1"}))
        assert runs[-1].exc is not None and "Traceback" in runs[-1].traceback
        # 4. a run killed in the middle of writing a cache line
        runs.append(run_killed(base + url + ["-o", tmp_path / "killed"], "kill_mid_record:3", env=env))
        assert runs[-1].code == -9
        # 7. through the Batch API (the results quote the key back), and a batch run killed after its create
        batch = ["--batch", "--batch-poll", "0.01"]
        runs.append(run_cli(base + url + batch + ["--judge", "m3", "-o", tmp_path / "batch"], env=env))
        assert runs[-1].code == 0, runs[-1].err
        assert "Bearer ***" in (tmp_path / "batch" / "batches" / "batch-0001.output.jsonl").read_text()
        runs.append(run_killed(base + url + batch + ["--judge", "m4", "-o", tmp_path / "batch-killed"], "kill_at:batch_after_create", env=env))
        assert runs[-1].code == -9
        uploaded = [name + "\n" + data.decode("utf-8", "replace") for name, data in srv.uploads]
        assert len(uploaded) == 3 and all("custom_id" in u for u in uploaded)  # one batch per judge (m, m3), one killed
    # 5. a server that rejects the key and quotes it in the 401
    with JudgeServer("sk-the-right-one", echo_auth=True) as srv:
        runs.append(run_cli(base + ["--base-url", srv.url, "-o", tmp_path / "rejected"], env=env))
        assert runs[-1].code == 2 and "HTTP 401" in runs[-1].err and "OPENAI_API_KEY" in runs[-1].err
    # 6. nothing listening at all
    runs.append(run_cli(base + ["--base-url", "http://127.0.0.1:9/v1", "--max-retries", "0", "-o", tmp_path / "down"], env=env))
    assert runs[-1].code == 1

    everything = _everything(tmp_path, *runs) + "\n".join(uploaded)  # what was written, and what was uploaded
    assert len(files_under(tmp_path)) > 15 and len(everything) > 10_000  # the grep had material to search
    assert list((tmp_path / "batch" / "batches").glob("*.jsonl")) and list((tmp_path / "batch-killed" / "batches").glob("*.jsonl"))
    assert _leaks(everything) == []


def test_the_key_reaches_the_server_only_in_the_authorization_header(tmp_path):
    a, b = _gens(tmp_path)
    with JudgeServer(KEY) as srv:
        r = run_cli(["judge", a, b, "--judge", "m", "--base-url", srv.url, "--bootstrap", "100", "-o", tmp_path / "o"],
                    env={"OPENAI_API_KEY": KEY})
        assert r.code == 0, r.err
        assert len(srv.contents) == 12 and _leaks("\n".join(srv.contents + srv.paths)) == []  # not in a prompt or a path


# --------------------------------------------------------------------------- the judge talks to --base-url only
def test_the_judge_contacts_only_the_base_url(tmp_path):
    """A redirect to another server is not followed, and proxy variables are ignored."""
    a, b = _gens(tmp_path)
    with JudgeServer(KEY) as target, JudgeServer(None) as elsewhere, JudgeServer(None) as proxy:
        for i in IDS:
            for o in ("AB", "BA"):
                target.faults[("m", i, o)] = ["302"]
        target.redirect_to = elsewhere.url + "/chat/completions"
        env = {"OPENAI_API_KEY": KEY, "HTTP_PROXY": proxy.url, "HTTPS_PROXY": proxy.url, "ALL_PROXY": proxy.url,
               "http_proxy": proxy.url, "https_proxy": proxy.url, "NO_PROXY": ""}
        r = run_cli(["judge", a, b, "--judge", "m", "--base-url", target.url, "--concurrency", "1", "-o", tmp_path / "o"],
                    env=env)
        assert r.code == 2 and "HTTP 302" in r.err and "not followed" in r.err
        assert len(target.log) == 1  # the first answer stopped the run
        assert elsewhere.log == [] and proxy.log == []
        # without faults, every request goes to the target, none through the proxy
        target.faults.clear()
        r = run_cli(["judge", a, b, "--judge", "m", "--base-url", target.url, "-o", tmp_path / "o2", "--bootstrap", "100"],
                    env=env)
        assert r.code == 0, r.err
        assert len(target.log) == 13 and proxy.log == [] and elsewhere.log == []


# --------------------------------------------------------------------------- no pickle, no eval
def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f"{ast.unparse(f.value)}.{f.attr}" if isinstance(f, ast.Attribute) else ""
            yield name, node


def _kw(node: ast.Call, name: str):
    for k in node.keywords:
        if k.arg == name:
            return k.value
    return None


def scan(source: str, where: str) -> tuple[list[str], bool]:
    """Problems in one module's source: pickle-family imports, eval/exec, torch.load without
    weights_only=True, unsafe YAML loaders, numpy allow_pickle, shell=True, trust_remote_code
    hard-wired on or left implicit. Also whether it imports modules by name at run time."""
    tree = ast.parse(source, where)
    problems, dynamic = [], False
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for m in mods:
                if m.split(".")[0] in {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}:
                    problems.append(f"{where}:{node.lineno}: imports {m}")
    for name, node in _calls(tree):
        line = f"{where}:{node.lineno}: {ast.unparse(node)[:80]}"
        if name in {"eval", "exec", "compile", "__import__"}:
            problems.append(f"{line} (evaluates text as code)")
        if name.endswith("torch.load"):
            wo = _kw(node, "weights_only")
            if not (isinstance(wo, ast.Constant) and wo.value is True):
                problems.append(f"{line} (torch.load without weights_only=True)")
        if name.startswith("yaml.") and name.split(".")[-1] in {"load", "load_all", "unsafe_load", "full_load", "full_load_all"}:
            problems.append(f"{line} (YAML without the safe loader)")
        if name.split(".")[-1] in {"read_pickle", "from_pickle"}:
            problems.append(f"{line} (pickle)")
        if name.endswith(("np.load", "numpy.load")):
            ap = _kw(node, "allow_pickle")
            if not (ap is None or isinstance(ap, ast.Constant) and ap.value is False):
                problems.append(f"{line} (numpy allow_pickle)")
        sh = _kw(node, "shell")
        if isinstance(sh, ast.Constant) and sh.value is True:
            problems.append(f"{line} (shell=True)")
        trc = _kw(node, "trust_remote_code")
        if isinstance(trc, ast.Constant) and trc.value is True:
            problems.append(f"{line} (trust_remote_code hard-wired on)")
        splat = any(k.arg is None for k in node.keywords)  # **kw: models.py builds kw with trust_remote_code
        if name.endswith(".from_pretrained") and trc is None and not splat:
            problems.append(f"{line} (from_pretrained without an explicit trust_remote_code)")
        if name.endswith("import_module"):
            dynamic = True
    return problems, dynamic


def test_the_scan_finds_what_it_looks_for():
    bad = """
import pickle
import yaml, torch, numpy as np, subprocess
from transformers import AutoModel
x = torch.load(f)
y = torch.load(f, weights_only=False)
z = yaml.load(text)
eval("1 + 1")
np.load(f, allow_pickle=True)
subprocess.run(cmd, shell=True)
AutoModel.from_pretrained(p, trust_remote_code=True)
AutoModel.from_pretrained(p)
ok = yaml.safe_load(text); torch.load(f, weights_only=True); model.eval()
"""
    problems, _ = scan(bad, "bad.py")
    assert len(problems) == 9 and not any(p.startswith("bad.py:13:") for p in problems), problems


def test_nothing_in_src_unpickles_or_evaluates_user_data():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 20
    problems, dynamic_imports = [], set()
    for path in files:
        found, dynamic = scan(path.read_text(encoding="utf-8"), str(path.relative_to(SRC)))
        problems += found
        if dynamic:
            dynamic_imports.add(str(path.relative_to(SRC)))
    assert problems == []
    # Code named at run time is imported in one place: core/usercode.py (verifiers and rule judges named as
    # module:function, announced on stderr: test below; config/components.py loads DLLM_ALIGN_PLUGINS modules and
    # its declarations' targets through usercode.load_module); judge/run.py imports only its registered
    # rule modules.
    assert dynamic_imports == {"core/usercode.py", "judge/run.py"}


def test_every_torch_load_in_src_is_weights_only():
    """The same rule as above, said plainly: every torch.load names weights_only=True."""
    hits = [(p, line) for p in SRC.rglob("*.py") for line in p.read_text().splitlines() if "torch.load(" in line]
    assert hits and all("weights_only=True" in line for _, line in hits)


def test_a_rule_judge_from_a_module_is_announced(tmp_path, monkeypatch):
    mod = tmp_path / "rel_sec_rules.py"
    mod.write_text("def first(prompt, a, b):\n    return 'A'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    a, b = _gens(tmp_path)
    r = run_cli(["judge", a, b, "--judge", "rule:rel_sec_rules:first", "--bootstrap", "100", "-o", tmp_path / "o"])
    assert r.code == 0, r.err
    assert f"rule:rel_sec_rules:first: running your function first() from {mod}" in r.err


# --------------------------------------------------------------------------- YAML and remote code
def test_recipes_are_read_with_a_safe_loader(tmp_path):
    marker = tmp_path / "PWNED"
    recipe = tmp_path / "evil.yaml"
    recipe.write_text(f"name: !!python/object/apply:os.system ['touch {marker}']\n")
    r = run_cli(["recipes", "check", recipe])
    assert r.code == 2 and "invalid YAML" in r.err
    r = run_cli(["train", "demo", "--set", f"name=!!python/object/apply:os.system ['touch {marker}']", "-o", tmp_path / "run"])
    assert r.code == 2
    assert not marker.exists()


@pytest.fixture()
def custom_code_model(tmp_path, tiny_dir):
    """A model folder whose config asks for its own code (auto_map), which would leave a marker file if run."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    marker = tmp_path / "PWNED"
    (folder / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig as EvilConfig, LlamaForCausalLM as EvilForCausalLM\n"
    )
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilForCausalLM"})
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, marker


def test_model_code_does_not_run_by_default(custom_code_model, tmp_path):
    from dllm_align.config.schema import ModelSection

    assert ModelSection().trust_remote_code is False
    folder, marker = custom_code_model
    _gens(tmp_path)
    r = run_cli(["generate", "demo", "--model", folder, "--prompts", tmp_path / "a.jsonl", "--output", tmp_path / "g.jsonl"],
                cwd=SRC.parents[1])
    assert r.code == 2 and "trust_remote_code" in r.err  # one line that says what would be needed
    assert not marker.exists()


def test_trust_remote_code_is_said_on_stderr(tiny_dir, tmp_path):
    _gens(tmp_path)
    r = run_cli(["generate", "demo", "--model", tiny_dir, "--set", "model.trust_remote_code=true", "--limit", "1",
                 "--prompts", tmp_path / "a.jsonl", "--output", tmp_path / "g.jsonl", "--gen-length", "8"], cwd=SRC.parents[1])
    assert r.code == 0, r.err
    assert f"Warning: trust_remote_code is on: running Python code shipped with {tiny_dir}" in r.err
    r = run_cli(["generate", "demo", "--model", tiny_dir, "--limit", "1", "--prompts", tmp_path / "a.jsonl",
                 "--output", tmp_path / "g2.jsonl", "--gen-length", "8"], cwd=SRC.parents[1])
    assert r.code == 0 and "Warning: trust_remote_code" not in r.err
    assert os.environ.get("DLLM_ALIGN_DEBUG") is None
