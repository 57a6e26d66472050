"""The fifth adversarial round's classes, kept as fast refusals (docs/reliability.md, "fifth round").

Each case runs the console entry point in this process (``reliability.run_cli``) and asserts the house manners:
bad input exits 2 with one ``Error:`` line naming the key, file or flag (a fault at run time exits 1), no
traceback, no output folder left behind and nothing written outside it. Every case here is refused before a
model is trained or a prompt sampled, so the file runs in seconds.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from reliability import run_cli, snapshot


def refused(r, *needles, code: int = 2) -> str:
    """The one ``Error:`` line of a refusal, checked: exit ``code``, no traceback, the line names every needle."""
    assert r.exc is None, r.traceback
    assert r.code == code, (r.code, r.err[-2000:])
    errors = [line for line in r.err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, r.err[-2000:]
    assert "Traceback" not in r.err
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


@pytest.fixture
def prompts(tmp_path) -> Path:
    p = tmp_path / "p.txt"
    p.write_text("Sort: 3 1 2\n")
    return p


# --------------------------------------------------------------------------- settings of another family or noise
@pytest.mark.parametrize("sampler", ["llada", "dream"])
def test_a_masked_diffusion_rule_on_diffusiongemma_is_refused_by_name(tmp_path, prompts, sampler):
    out = tmp_path / "g"
    r = run_cli(["generate", "demo_gemma", "-o", out, "--prompts", prompts, "--sampler", sampler])
    refused(r, "generate.sampler", sampler, "uniform")
    assert not out.exists()


def test_a_gen_length_beyond_diffusiongemmas_positions_is_refused(tmp_path, prompts):
    out = tmp_path / "g"
    r = run_cli(["generate", "demo_gemma", "-o", out, "--prompts", prompts, "--gen-length", "100000"])
    refused(r, "gen_length", "positions")
    assert not out.exists()


@pytest.mark.parametrize("recipe, key", [("demo", "reference.surrogate=flat_ce"),
                                         ("demo", "reference.parameterization=loo"),
                                         ("demo_block", "reference.self_conditioning=detached"),
                                         ("demo_block", "reference.time_power=3")])
def test_recipes_check_refuses_a_setting_of_another_noise_process(recipe, key):
    r = run_cli(["recipes", "check", recipe, "--set", key])
    refused(r, key.partition("=")[0], "likelihood")
    assert r.out == ""


def test_recipes_check_refuses_packing_on_diffusiongemma_and_demo_leaves_no_folder(tmp_path):
    refused(run_cli(["recipes", "check", "demo_gemma", "--set", "data.padding=packed"]), "data.padding")
    out = tmp_path / "d"
    refused(run_cli(["demo", "--recipe", "demo_gemma", "--set", "data.padding=packed", "-o", out]), "data.padding")
    assert not out.exists()


def test_diffusiongemmas_default_shape_passes_recipes_check(tmp_path):
    """gen_length 16 with sampler auto: the block rule's check never applies to the family's own rule."""
    recipe = tmp_path / "g16.yaml"
    recipe.write_text("extends: demo\nmodel:\n  name_or_path: builtin:tiny-diffusiongemma\n"
                      "generate:\n  gen_length: 16\n  block_length: 32\n  steps: 16\n  sampler: auto\n")
    r = run_cli(["recipes", "check", recipe])
    assert r.code == 0, r.err


# --------------------------------------------------------------------------- refusals before the work
@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "inf", "86400", "5s", "1e400"])
def test_a_bad_rule_timeout_is_refused_before_any_work(tmp_path, value):
    out = tmp_path / "lab"
    r = run_cli(["label", "demo", "-o", out, "--rule", "sort"], env={"DLLM_ALIGN_RULE_TIMEOUT": value})
    refused(r, "DLLM_ALIGN_RULE_TIMEOUT")
    assert "samples from" not in r.err and not out.exists()


def test_a_20000_character_name_is_not_echoed_whole(tmp_path):
    name = "x" * 20000
    for args in (["recipes", "check", "demo", "--set", f"generate.backend={name}"],
                 ["recipes", "check", "demo", "--set", f"generate.sampler={name}"],
                 ["recipes", "check", "demo", "--set", f"train.{name}=1"]):
        line = refused(run_cli(args))
        assert len(line) < 1000, len(line)


def test_a_trailing_space_kept_in_a_backend_name_is_refused():
    """A quoted trailing space is part of the name (an unquoted one is not, in --set as in a recipe file: YAML)."""
    refused(run_cli(["recipes", "check", "demo", "--set", 'generate.backend="in_process "']), "generate.backend")


# --------------------------------------------------------------------------- recipes check on numbers
def test_a_5000_digit_integer_is_refused_naming_the_key(tmp_path):
    r = run_cli(["recipes", "check", "demo", "--set", "train.seed=" + "9" * 5000])
    refused(r, "train.seed", "5,000 digits")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("extends: demo\ntrain:\n  max_steps: " + "1" * 5000 + "\n")
    refused(run_cli(["recipes", "check", recipe]), "train.max_steps")


def test_a_process_group_timeout_beyond_a_week_is_refused_at_check():
    refused(run_cli(["recipes", "check", "demo", "--set", "train.process_group_timeout_minutes=1e300"]),
            "train.process_group_timeout_minutes")


# --------------------------------------------------------------------------- judge: user functions, strict JSON
def _gens(tmp: Path, n: int = 3, a_longer: bool = True) -> tuple[Path, Path]:
    out = []
    for m in ("A", "B"):
        p = tmp / f"{m.lower()}.jsonl"
        long = (m == "A") == a_longer
        p.write_text("".join(json.dumps({"id": str(i), "prompt": f"Q {i}?", "completion": "x" * (9 if long else 3)}) + "\n"
                             for i in range(n)))
        out.append(p)
    return out[0], out[1]


@pytest.mark.parametrize("body, code, needles", [
    ("import time\ndef f(p, a, b):\n    time.sleep(60)\n", 1, ("rule:r5_judge_{n}:f", "did not return within 1 s")),
    ("import sys\ndef f(p, a, b):\n    sys.exit(0)\n", 1, ("rule:r5_judge_{n}:f", "sys.exit(0)")),
    ("import sys\ndef f(p, a, b):\n    sys.exit(3)\n", 1, ("rule:r5_judge_{n}:f", "sys.exit(3)")),
    ("def f(p, a, b):\n    return 1 / 0\n", 2, ("rule:r5_judge_{n}:f", "f() raised ZeroDivisionError")),
])
def test_a_rule_judge_from_a_module_is_contained_as_label_contains_verifiers(tmp_path, monkeypatch, body, code, needles):
    n = abs(hash(body)) % 10**8
    (tmp_path / f"r5_judge_{n}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    a, b = _gens(tmp_path)
    r = run_cli(["judge", a, b, "--judge", f"rule:r5_judge_{n}:f", "--bootstrap", "100", "-o", tmp_path / "o"],
                env={"DLLM_ALIGN_RULE_TIMEOUT": "1"})
    refused(r, *(x.format(n=n) for x in needles), code=code)
    assert not (tmp_path / "o" / "results.json").exists()


def test_a_rule_judges_prints_do_not_corrupt_json_on_stdout(tmp_path, monkeypatch):
    (tmp_path / "r5_noisy.py").write_text("def f(p, a, b):\n    print('noise')\n    return 'A'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    a, b = _gens(tmp_path)
    r = run_cli(["judge", a, b, "--judge", "rule:r5_noisy:f", "--bootstrap", "100", "--json", "-o", tmp_path / "o"])
    assert r.code == 0, r.err
    assert json.loads(r.out)["n"] == 3 and "noise" in r.err


def _strict_load(text: str):
    def bad(c):
        raise AssertionError(f"not strict JSON: {c}")
    return json.loads(text, parse_constant=bad)


@pytest.mark.parametrize("n", [1, 4])
def test_results_json_is_strict_json_when_one_side_always_wins(tmp_path, n):
    a, b = _gens(tmp_path, n=n)
    out = tmp_path / "o"
    r = run_cli(["judge", a, b, "--judge", "rule:longer", "--bootstrap", "100", "--json", "-o", out])
    assert r.code == 0, r.err
    for text in ((out / "results.json").read_text(), r.out):
        res = _strict_load(text)
        if "undefined" in res:
            assert all("not defined for these data" in why for why in res["undefined"].values())


@pytest.mark.parametrize("content", ['"a string"\n', "[1, 2]\n", '{"id": "0", "judges": {"rule:longer": {"outcome": [1]}}}\n',
                                     '{"id": "0", "judges": ["rule:longer"]}\n', '{"id": "0", "judges": {"rule:longer": {"outcome": "won"}}}\n'])
def test_difficulty_from_a_file_of_the_wrong_shape_is_refused_naming_it(tmp_path, content):
    a, b = _gens(tmp_path)
    other = tmp_path / "other.jsonl"
    other.write_text(content)
    out = tmp_path / "o"
    r = run_cli(["judge", a, b, "--judge", "rule:longer", "--bootstrap", "100", "--difficulty-from", other, "-o", out])
    refused(r, "other.jsonl")
    assert not (out / "results.json").exists()


# --------------------------------------------------------------------------- what an export copies
def _code_folder(tmp: Path, make) -> Path:
    code = tmp / "code"
    code.mkdir()
    (code / "configuration_llada.py").write_text("X = 1\n")
    make(code)
    return code


def _link_out(code: Path):
    secret = code.parent / "secret.txt"
    secret.write_text("not for final/\n")
    (code / "modeling_llada.py").symlink_to(secret)


def _fifo(code: Path):
    os.mkfifo(code / "modeling_llada.py")


def _folder(code: Path):
    (code / "modeling_llada.py").mkdir()


def _not_utf8(code: Path):
    (code / "modeling_llada.py").write_bytes(b"x = '\xff\xfe'\n")


def _tok_garbage(code: Path):
    (code / "modeling_llada.py").write_text("Y = 1\n")
    (code / "tokenizer_config.json").write_text("{not json")


def _tok_outside(code: Path):
    (code / "modeling_llada.py").write_text("Y = 1\n")
    (code.parent / "outside5.py").write_text("Z = 1\n")
    (code / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["../outside5.T", None]}}))


def _sibling_link(code: Path):
    (code / "modeling_llada.py").write_text("from .helpers import x\n")
    (code.parent / "helpers.py").write_text("x = 1\n")
    (code / "helpers.py").symlink_to(code.parent / "helpers.py")


@pytest.mark.parametrize("make, needle", [(_link_out, "modeling_llada.py"), (_fifo, "modeling_llada.py"),
                                          (_folder, "modeling_llada.py"), (_not_utf8, "modeling_llada.py"),
                                          (_tok_garbage, "tokenizer_config.json"), (_tok_outside, "outside5"),
                                          (_sibling_link, "helpers.py")],
                         ids=["link-out", "fifo", "folder", "not-utf8", "tokenizer-config", "dotdot", "sibling-link"])
def test_published_code_that_an_export_cannot_copy_is_refused_before_training(tmp_path, make, needle):
    code = _code_folder(tmp_path, make)
    before = snapshot(code.parent)
    refused(run_cli(["recipes", "check", "demo", "--set", f"model.published_code={code}"]), needle)
    out = tmp_path / "run"
    r = run_cli(["train", "demo", "--set", f"model.published_code={code}", "-o", out])
    refused(r, needle)
    assert not out.exists()
    assert snapshot(code.parent) == before if make is not _fifo else True


# --------------------------------------------------------------------------- a flag and --set of the same key
@pytest.mark.parametrize("args, key", [
    (["online", "demo_online", "--n", "2", "--set", "online.n=3"], "online.n"),
    (["generate", "demo", "--gen-length", "8", "--set", "generate.gen_length=16"], "generate.gen_length"),
    (["train", "demo", "--set", "output_dir={t}/a"], "output_dir"),
])
def test_a_flag_beside_a_set_of_the_same_key_is_refused(tmp_path, args, key):
    out = tmp_path / "o"
    r = run_cli([a.format(t=tmp_path) for a in args] + ["-o", out])
    refused(r, key, "give one")
    assert not out.exists() and not (tmp_path / "a").exists()


# --------------------------------------------------------------------------- the benchmark scripts' flags
def _script(name: str):
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"r5_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _refused_script(mod, argv, capsys, *needles):
    try:
        code = mod.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.startswith("Error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.parametrize("argv, needle", [
    (["--threads", "0"], "--threads"), (["--threads", "-3"], "--threads"), (["--threads", "100000"], "--threads"),
    (["--json", "/nonexistent-r5/x.json"], "--json"), (["--json", "{t}"], "--json"), (["--only"], "--only"),
    (["--bogus"], "unrecognized"), (["--threads", "many"], "--threads"),
])
def test_benchmarks_run_refuses_bad_flags_before_any_work(tmp_path, capsys, argv, needle):
    before = snapshot(tmp_path)
    _refused_script(_script("run"), [a.format(t=tmp_path) for a in argv], capsys, needle)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("argv, needle", [
    (["--out", ""], "--out"), (["--measure-lengths", "{t}/missing"], "--measure-lengths"), (["--bogus"], "unrecognized"),
    (["--out", "{t}/o", "--budget", "nan"], "--budget"),
])
def test_gpu_check_refuses_bad_flags_writing_nothing(tmp_path, capsys, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    _refused_script(_script("gpu_check"), [a.format(t=tmp_path) for a in argv], capsys, needle)
    assert list(tmp_path.iterdir()) == []


def test_gpu_check_on_cuda_without_a_gpu_writes_nothing(tmp_path, capsys, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the refusal is for machines without one")
    monkeypatch.chdir(tmp_path)
    _refused_script(_script("gpu_check"), ["--out", str(tmp_path / "o")], capsys, "--device cuda")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- a refused rerun changes nothing
def test_a_refusal_part_way_writes_back_the_records_it_found(tmp_path):
    from dllm_align.core.errors import UserError
    from dllm_align.core.runfolder import records_kept_on_refusal

    out = tmp_path / "on"
    (out / "round-0" / "ref_cache").mkdir(parents=True)
    files = {"online.json": '{"n": 2}\n', "round-0/ref_cache/manifest.json": '{"v": 1}\n',
             "round-0/recipe.train.yaml": "train: {}\n"}
    for rel, text in files.items():
        (out / rel).write_text(text)
    before = snapshot(out)
    with pytest.raises(UserError):
        with records_kept_on_refusal(out):
            for rel in files:
                (out / rel).write_text("rewritten on the way to a refusal\n")
            raise UserError("refused")
    assert snapshot(out) == before


# --------------------------------------------------------------------------- --help
def _command_paths():
    import typer

    from dllm_align.cli.app import app

    def walk(cmd, path):
        yield path
        for name, sub in sorted((getattr(cmd, "commands", None) or {}).items()):
            yield from walk(sub, path + [name])

    return list(walk(typer.main.get_command(app), []))


def test_no_help_page_shows_a_value_beside_a_flag():
    paths = _command_paths()
    assert len(paths) >= 20
    for path in paths:
        r = run_cli([*path, "--help"], env={"COLUMNS": "200"})
        assert r.code == 0, (path, r.err)
        assert "<bool>" not in r.out, (path, [line for line in r.out.splitlines() if "<bool>" in line])
        assert "--help" in r.out


# --------------------------------------------------------------------------- DiffusionGemma's temperature
def test_diffusiongemmas_temperature_is_refused_by_name_and_not_recorded(tmp_path, prompts):
    out = tmp_path / "g"
    refused(run_cli(["generate", "demo_gemma", "-o", out, "--prompts", prompts, "--temperature", "0.7"]),
            "--temperature 0.7", "diffusion_gemma")
    assert not out.exists()
    r = run_cli(["generate", "demo_gemma", "-o", out, "--prompts", prompts, "--gen-length", "8"])
    assert r.code == 0, r.err
    sidecar = json.loads(next(out.glob("*.settings.json")).read_text())
    assert "temperature" not in sidecar["sampler"] and "top_p" not in sidecar["sampler"]
    assert sidecar["sampler"]["gen_length"] == 8


# --------------------------------------------------------------------------- tampered weights
ASSETS = Path(__file__).resolve().parent.parent / "src" / "dllm_align" / "assets"
BASES = ["toy_sort_base", "toy_sort_base_dream", "toy_sort_base_sdar", "toy_sort_base_gemma"]


def _tampered(tmp: Path, base: str, change) -> Path:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp / "m"
    shutil.copytree(ASSETS / base, folder)
    f = folder / "model.safetensors"
    sd = load_file(str(f))
    name = next(k for k in sorted(sd) if k.endswith("weight") and sd[k].dim() == 2)
    change(sd, name, torch)
    save_file(sd, str(f))
    return folder


def _drop(sd, name, torch):
    del sd[name]


def _extra(sd, name, torch):
    sd["evil.injected"] = torch.zeros(2, 2)


def _int32(sd, name, torch):
    for k in sd:
        sd[k] = sd[k].to(torch.int32)


def _fp16(sd, name, torch):
    for k in sd:
        sd[k] = sd[k].to(torch.float16)


def _nan(sd, name, torch):
    sd[name] = sd[name].clone()
    sd[name][0, 0] = float("nan")


def _shape(sd, name, torch):
    sd[name] = sd[name][:-1].clone()


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("change, needles", [(_drop, ("missing",)), (_extra, ("evil.injected",)), (_int32, ("int", "I32")),
                                             (_fp16, ("F16",)), (_nan, ("NaN",)), (_shape, ("shape",))],
                         ids=["missing", "unexpected", "int32", "fp16", "nan", "shape"])
def test_tampered_weights_are_refused_on_load_for_every_family(tmp_path, prompts, base, change, needles):
    folder = _tampered(tmp_path, base, change)
    out = tmp_path / "g"
    r = run_cli(["generate", "demo", "-o", out, "--prompts", prompts, "--model", folder, "--limit", "1"])
    line = refused(r)
    assert any(n in line for n in needles), line
    assert not out.exists()


@pytest.mark.parametrize("base", BASES)
def test_a_truncated_weights_file_is_refused_naming_it(tmp_path, prompts, base):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(ASSETS / base, folder)
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    out = tmp_path / "g"
    refused(run_cli(["generate", "demo", "-o", out, "--prompts", prompts, "--model", folder]), "model.safetensors")
    assert not out.exists()


@pytest.mark.parametrize("base", ["toy_sort_base", "toy_sort_base_dream", "toy_sort_base_sdar"])
def test_a_config_of_a_larger_model_beside_the_weights_is_refused_before_allocating_it(tmp_path, prompts, base):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(ASSETS / base, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 400  # 100 times the layers (a few hundred MB if it were allocated: safe to get wrong)
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:1] * 400
    (folder / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "g"
    line = refused(run_cli(["generate", "demo", "-o", out, "--prompts", prompts, "--model", folder]))
    assert "config.json" in line or "missing" in line, line
    assert not out.exists()


def test_label_on_diffusiongemma_samples_without_a_temperature_or_cache_and_refuses_one(tmp_path, prompts):
    out = tmp_path / "lab"
    refused(run_cli(["label", "demo_gemma", "-o", out, "--rule", "sort", "--prompts", prompts, "--n", "2",
                     "--temperature", "0.7"]), "--temperature 0.7", "diffusion_gemma")
    assert not out.exists()
    r = run_cli(["label", "demo_gemma", "-o", out, "--rule", "sort", "--prompts", prompts, "--n", "2"])
    assert r.code == 0, r.err
    rows = [json.loads(line) for line in (out / "labelled.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("temperature" not in r["sampler"] and "cache" not in r["sampler"] for r in rows)
