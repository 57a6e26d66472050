"""``dllm-align evaluate`` and the harness model class, end to end on the tiny model, offline.

The tasks are written here (task YAML + JSONL in tmp_path, loaded through
``include_path``), and every number the harness reports is recomputed
directly: the sampler on the same prompts for ``generate_until`` (exact
match), the ELBO on the same (context, continuation) pairs for the
multiple-choice task (accuracy). The targets are built from the model's own
outputs so that the scores are neither 0 nor 1 by accident.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dllm_align.cli.app import app

lm_eval = pytest.importorskip("lm_eval")
import lm_eval.api.instance  # noqa: E402  (the Instance class, whatever ran before)

from dllm_align.evaluate import harness as E  # noqa: E402
from dllm_align.evaluate import run as R  # noqa: E402
from dllm_align.objective.elbo import DrawConfig, elbo_draws, exact_elbo  # noqa: E402
from dllm_align.generate.settings import SamplerSettings, encode_prompt, row_seed  # noqa: E402
from dllm_align.generate.sampler import generate

runner = CliRunner()

GEN_QUESTIONS = ["Q: 2+2=", "Q: capital of France?", "Say hi.", "Count: 1 2 3", "abc", "The sky is"]
MC_DOCS = [
    ("The cat sat on the", ["mat", "moon", "sofa"]),
    ("Two plus two is", ["four", "five", "a fish"]),
    ("Water is", ["wet", "dry", "loud"]),
    ("Paris is in", ["France", "Peru", "space"]),
    ("Bees make", ["honey", "tea", "cars"]),
    ("Snow is", ["cold", "hot", "green"]),
]
SETTINGS = SamplerSettings(gen_length=8, block_length=4, steps=4)
MC_NUM = 8


def _task_yaml(path: Path, body: dict) -> None:
    path.write_text(json.dumps(body, indent=1, ensure_ascii=False))  # JSON is YAML


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def write_gen_task(folder: Path, answers: list[str], stop: str, name: str = "toy_gen") -> None:
    rows = [{"question": q, "answer": a} for q, a in zip(GEN_QUESTIONS, answers)]
    _jsonl(folder / f"{name}.jsonl", rows)
    _jsonl(folder / f"{name}_train.jsonl", [{"question": "Q: 1+1=", "answer": "2"}, {"question": "Q: 3+3=", "answer": "6"}])
    _task_yaml(
        folder / f"{name}.yaml",
        {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {
                "data_files": {"test": str(folder / f"{name}.jsonl"), "train": str(folder / f"{name}_train.jsonl")},
                "cache_dir": str(folder / "hf_cache"),
            },
            "output_type": "generate_until",
            "test_split": "test",
            "fewshot_split": "train",
            "doc_to_text": "{{question}}",
            "doc_to_target": "answer",
            "generation_kwargs": {"until": [stop], "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0},
        },
    )


def write_mc_task(folder: Path, labels: list[int], name: str = "toy_mc") -> None:
    rows = [{"question": q, "choices": c, "label": lab} for (q, c), lab in zip(MC_DOCS, labels)]
    _jsonl(folder / f"{name}.jsonl", rows)
    _task_yaml(
        folder / f"{name}.yaml",
        {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(folder / f"{name}.jsonl")}, "cache_dir": str(folder / "hf_cache")},
            "output_type": "multiple_choice",
            "test_split": "test",
            "doc_to_text": "{{question}}",
            "doc_to_choice": "choices",
            "doc_to_target": "label",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0},
        },
    )


# --------------------------------------------------------------------------- direct computations
def settings_for(mp) -> SamplerSettings:
    """SETTINGS, in the model's own blocks where it is a block-diffusion model (its sampler refuses others)."""
    b = getattr(mp, "block_size", None)
    return SETTINGS if not b else SETTINGS.replace(gen_length=b, block_length=b, steps=4)


def direct_texts(mp, questions, chat: bool, batch_size: int = 4) -> list[str]:
    tok = mp.tokenizer
    if chat:
        prompts = [encode_prompt(tok, [{"role": "user", "content": q}]) for q in questions]
    else:
        prompts = [list(tok(q, add_special_tokens=False)["input_ids"]) for q in questions]
    seeds = [row_seed(SETTINGS.seed, E.request_id(q)) for q in questions]
    return [c.text for c in generate(mp, prompts, settings_for(mp), seeds=seeds, batch_size=batch_size)]


def direct_elbo(mp, context: str, continuation: str, n_mc: int = MC_NUM, stratified: bool = True) -> torch.Tensor:
    """The K draws of one (context, continuation) pair, run alone (no batching, no padding)."""
    tok = mp.tokenizer
    ctx = list(tok(context, add_special_tokens=False)["input_ids"])
    cont = list(tok(continuation, add_special_tokens=False)["input_ids"])
    ids = torch.tensor([ctx + cont])
    cm = torch.zeros_like(ids, dtype=torch.bool)
    cm[0, len(ctx):] = True
    cfg = DrawConfig(n_mc=n_mc, seed=0, estimator="l", stratified=stratified)
    with torch.no_grad():
        return elbo_draws(mp, ids, torch.ones_like(ids), cm, [E.request_id(context, continuation)], cfg)[0]


def stop_and_answers(texts: list[str]) -> tuple[str, list[str]]:
    """A stop string that occurs inside the first output, and targets: right for even docs, wrong for odd."""
    t0 = texts[0]
    assert len(t0) >= 3, "the tiny model should emit a few characters"
    stop = t0[2]
    cut = [E.truncate_at_stops(t, [stop]) for t in texts]
    answers = [c if i % 2 == 0 else c + "#wrong" for i, c in enumerate(cut)]
    return stop, answers


def make_lm(mp, **kw) -> E.DiffusionLM:
    st = settings_for(mp)
    args = dict(mc_num=MC_NUM, batch_size=4, gen_length=st.gen_length, block_length=st.block_length, steps=st.steps)
    args.update(kw)
    return E.DiffusionLM(predictor=mp, **args)


def run_harness(lm, folder: Path, task: str, **kw) -> dict:
    tm = R.task_manager([task], str(folder))
    return lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=tm, bootstrap_iters=0, **kw)


# --------------------------------------------------------------------------- harness end to end
@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat_template"])
def test_generate_until_matches_direct_sampler(tiny, tmp_path, chat):
    texts = direct_texts(tiny, GEN_QUESTIONS, chat)
    stop, answers = stop_and_answers(texts)
    write_gen_task(tmp_path, answers, stop)
    res = run_harness(make_lm(tiny), tmp_path, "toy_gen", apply_chat_template=chat, log_samples=True)

    samples = sorted(res["samples"]["toy_gen"], key=lambda s: s["doc_id"])
    got = [s["filtered_resps"][0] for s in samples]
    want = [E.truncate_at_stops(t, [stop]) for t in texts]
    assert got == want  # same tokens, cut at the task's stop string
    if chat:  # the context is the chat template with the generation prompt
        assert samples[0]["arguments"][0][0].startswith("<|startoftext|><|start_header_id|>user")
    em = sum(g == a for g, a in zip(want, answers)) / len(answers)
    assert em == pytest.approx(0.5)  # even docs right by construction, odd docs wrong
    assert res["results"]["toy_gen"]["exact_match,none"] == pytest.approx(em)


def test_multiple_choice_matches_direct_elbo(tiny, tmp_path):
    direct = [[float(direct_elbo(tiny, q, " " + c).mean()) for c in choices] for q, choices in MC_DOCS]
    best = [max(range(len(v)), key=v.__getitem__) for v in direct]
    labels = [b if i % 3 else (b + 1) % 3 for i, b in enumerate(best)]  # a third of the docs wrong on purpose
    write_mc_task(tmp_path, labels)
    res = run_harness(make_lm(tiny), tmp_path, "toy_mc", log_samples=True)

    samples = sorted(res["samples"]["toy_mc"], key=lambda s: s["doc_id"])
    harness_ll = [[r[0][0] for r in s["resps"]] for s in samples]
    assert torch.allclose(torch.tensor(harness_ll), torch.tensor(direct), atol=1e-4)
    acc = sum(b == lab for b, lab in zip(best, labels)) / len(labels)
    assert acc == pytest.approx(4 / 6)
    assert res["results"]["toy_mc"]["acc,none"] == pytest.approx(acc)


def test_loglikelihood_is_reproducible_and_unbiased(tiny):
    lm = make_lm(tiny, mc_num=4, batch_size=3)
    Req = lm_eval.api.instance.Instance
    a = Req("loglikelihood", {}, ("The cat sat on the", " mat"), 0)
    b = Req("loglikelihood", {}, ("A much longer context, so that rows are padded:", " yes"), 1)
    ab = lm.loglikelihood([a, b])
    ba = lm.loglikelihood([b, a])
    alone = lm.loglikelihood([a])
    assert ab[0][0] == pytest.approx(ba[1][0], abs=1e-5) == pytest.approx(alone[0][0], abs=1e-5)
    assert ab[0][1] is False  # greedy_check off: reported False
    # Many draws of a 3-token continuation approach the exact ELBO (enumeration of all 7 masks).
    tok = tiny.tokenizer
    ctx, cont = "Hi there,", " yo"
    exact = exact_elbo(tiny, tok(ctx)["input_ids"], tok(cont)["input_ids"])
    lm.configure(mc_num=240, batch_size=240)
    est = lm.loglikelihood([Req("loglikelihood", {}, (ctx, cont), 0)])[0][0]
    draws = direct_elbo(tiny, ctx, cont, n_mc=240, stratified=False)
    se = float(draws.std()) / 240**0.5
    assert abs(est - exact) < 5 * se + 1e-4, (est, exact, se)


def test_loglikelihood_packed_equals_padded(tiny):
    """evaluate.packing (on by default): a forward's noisy sequences share rows of max_length, same values."""
    Req = lm_eval.api.instance.Instance
    reqs = [Req("loglikelihood", {}, (c, x), i) for i, (c, x) in enumerate(
        [("The cat sat on the", " mat"), ("A much longer context, so that rows are padded:", " yes"), ("Q:", " an answer")])]
    packed = make_lm(tiny, mc_num=4, batch_size=8, max_length=128)
    padded = make_lm(tiny, mc_num=4, batch_size=8, max_length=128, packing=False)
    assert packed.packing and not padded.packing
    a, b = packed.loglikelihood(reqs), padded.loglikelihood(reqs)
    assert [x[0] for x in a] == pytest.approx([x[0] for x in b], abs=5e-5)


def test_greedy_check_and_rolling(tiny):
    Req = lm_eval.api.instance.Instance
    lm = make_lm(tiny, greedy_check=True)
    # The model's own one-token-per-step greedy decode of 3 tokens is greedy by definition.
    ctx = "Hello"
    ids = list(tiny.tokenizer(ctx)["input_ids"])
    st = SamplerSettings(gen_length=3, block_length=3, steps=3)
    raw = generate(tiny, [ids], st, stop_early=False)[0].raw
    other = [raw[0], raw[1], (raw[2] + 1) % 256]
    out = lm.score_tokens([(ids, raw, "own"), (ids, other, "other")])
    assert out[0][1] is True and out[1][1] is False
    # Rolling: a text shorter than the context is one window conditioned on the prefix token.
    text = "rolling text"
    (v,) = lm.loglikelihood_rolling([Req("loglikelihood_rolling", {}, (text,), 0)])
    ctx_ids, cont_ids = [tiny.tokenizer.bos_token_id], list(tiny.tokenizer(text)["input_ids"])
    ids_t = torch.tensor([ctx_ids + cont_ids])
    cm = torch.zeros_like(ids_t, dtype=torch.bool)
    cm[0, 1:] = True
    with torch.no_grad():
        d = elbo_draws(tiny, ids_t, None, cm, [E.request_id("rolling", text, "0")], lm.draw_config())
    assert v == pytest.approx(float(d.mean()), abs=1e-4)


def test_unknown_model_argument_is_named(tiny):
    from dllm_align.core.errors import UserError

    with pytest.raises(UserError, match="unknown dllm_align model argument 'gen_lenght' \\(did you mean 'gen_length'\\?\\)"):
        E.DiffusionLM(predictor=tiny, gen_lenght=8)


def test_registered_with_the_harness(tiny, tmp_path):
    """The harness builds the model itself from its name and an argument string."""
    from lm_eval.api.registry import get_model

    assert get_model("dllm_align") is E.DiffusionLM
    direct = [[float(direct_elbo(tiny, q, " " + c, n_mc=4).mean()) for c in ch] for q, ch in MC_DOCS[:2]]
    write_mc_task(tmp_path, [max(range(3), key=v.__getitem__) for v in direct[:2]] + [0] * 4)
    res = lm_eval.simple_evaluate(
        model="dllm_align", model_args="pretrained=builtin:tiny,mc_num=4,gen_length=8,block_length=4,steps=4",
        tasks=["toy_mc"], task_manager=R.task_manager(["toy_mc"], str(tmp_path)), batch_size=4, limit=2, bootstrap_iters=0,
    )
    assert res["results"]["toy_mc"]["acc,none"] == 1.0
    assert res["config"]["mc_num"] == 4 and res["config"]["sampler"]["gen_length"] == 8


# --------------------------------------------------------------------------- the command
def _recipe(tmp_path: Path, tasks: dict, **evaluate) -> Path:
    body = {
        "name": "t",
        "output_dir": str(tmp_path / "run"),
        "generate": {"gen_length": 8, "block_length": 4, "steps": 4},
        "evaluate": {"mc_num": MC_NUM, "batch_size": 4, "bootstrap_iters": 0, "tasks": tasks, **evaluate},
    }
    p = tmp_path / "eval.yaml"
    p.write_text(json.dumps(body))
    return p


@pytest.fixture
def spy(monkeypatch):
    """Records the settings of every call of the generator (and still decodes)."""
    from dllm_align.generate.in_process import InProcessGenerator

    calls = []
    real = InProcessGenerator.generate

    def wrapped(self, prompts, settings, *a, **kw):
        calls.append(settings)
        return real(self, prompts, settings, *a, **kw)

    monkeypatch.setattr(InProcessGenerator, "generate", wrapped)
    return calls


def test_per_task_settings_reach_the_sampler(tiny, tmp_path, spy):
    texts = direct_texts(tiny, GEN_QUESTIONS, chat=False)
    stop, answers = stop_and_answers(texts)
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    write_gen_task(tasks_dir, answers, stop)
    recipe = _recipe(
        tmp_path,
        {
            "short": {"task": "toy_gen", "gen_length": 4, "block_length": 2, "steps": 4, "num_fewshot": 0},
            "long": {"task": "toy_gen", "gen_length": 12, "block_length": 4, "steps": 6, "num_fewshot": 2},
            "default": {"task": "toy_gen"},
        },
    )
    r = runner.invoke(app, ["evaluate", str(recipe), "--include-path", str(tasks_dir), "--json"])
    assert r.exit_code == 0, r.stderr
    seen = [(s.gen_length, s.block_length, s.steps) for s in spy]
    assert seen == [(4, 2, 4), (12, 4, 6), (8, 4, 4)]  # per task, in order; 'default' takes the generate section
    out = json.loads(r.stdout)
    run = tmp_path / "run" / "eval" / "builtin_tiny"
    merged = json.loads((run / "results.json").read_text())
    assert set(merged["dllm_align"]["scores"]) == {"short", "long", "default"}
    long_task = json.loads((run / "tasks" / "long.json").read_text())["results"]
    assert long_task["n-shot"]["toy_gen"] == 2
    # The default task decodes exactly as the direct computation: 3 of 6 right.
    assert out["models"]["builtin_tiny"]["scores"]["default"]["value"] == pytest.approx(0.5)
    assert (run / "samples_default.jsonl").is_file()

    # Same settings again: reused, the sampler is not called.
    spy.clear()
    r2 = runner.invoke(app, ["evaluate", str(recipe), "--include-path", str(tasks_dir), "--tasks", "default"])
    assert r2.exit_code == 0, r2.stderr
    assert spy == [] and "default: reusing" in r2.stderr
    assert "| default (0) | exact_match,none | 50.00 |" in r2.stdout


def test_compare_two_models_side_by_side(tiny, tmp_path):
    from dllm_align.models.load import TinySpec, save_tiny

    other = save_tiny(tmp_path / "other" / "model", TinySpec(seed=1))
    texts = direct_texts(tiny, GEN_QUESTIONS, chat=False)
    stop, answers = stop_and_answers(texts)
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    write_gen_task(tasks_dir, answers, stop)
    direct = [[float(direct_elbo(tiny, q, " " + c).mean()) for c in ch] for q, ch in MC_DOCS]
    write_mc_task(tasks_dir, [max(range(3), key=v.__getitem__) for v in direct])  # base model: acc 1
    recipe = _recipe(tmp_path, {"gen": {"task": "toy_gen"}, "mc": {"task": "toy_mc"}}, compare=str(other))
    r = runner.invoke(app, ["evaluate", str(recipe), "--include-path", str(tasks_dir), "--json"])
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    rows = {row["task"]: row for row in out["comparison"]["rows"]}
    assert rows["gen"]["a"] == pytest.approx(0.5) and rows["mc"]["a"] == pytest.approx(1.0)
    assert rows["mc"]["delta"] == pytest.approx(rows["mc"]["b"] - 1.0)
    md = (tmp_path / "run" / "eval" / "comparison.md").read_text()
    assert md.splitlines()[0] == "| Task (shots) | Metric | builtin_tiny | other__model | Δ |"
    assert "| mc (0) | acc,none | " in md and md.count("\n") == 4
    b_results = json.loads((tmp_path / "run" / "eval" / "other__model" / "results.json").read_text())
    assert b_results["dllm_align"]["model"] == str(other)
    assert "toy_mc" in b_results["results"] and "toy_gen" in b_results["results"]


def test_missing_harness_is_one_error_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now raises ImportError
    r = runner.invoke(app, ["evaluate", str(_recipe(tmp_path, {"x": {}}))])
    assert r.exit_code == 2
    lines = r.stderr.splitlines()
    assert lines[0] == "Error: lm-evaluation-harness (lm-eval) is not installed"
    assert lines[1] == "Hint: install the optional extra: pip install 'dllm-align[eval]'"
    assert r.stdout == ""


def test_code_tasks_need_consent(tmp_path):
    # A task marked unsafe_code is refused (exit 2) unless --allow-code-execution.
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    write_gen_task(tasks_dir, ["a"] * len(GEN_QUESTIONS), "\n")
    spec = json.loads((tasks_dir / "toy_gen.yaml").read_text())
    spec["unsafe_code"] = True
    _task_yaml(tasks_dir / "toy_gen.yaml", spec)
    recipe = _recipe(tmp_path, {"code": {"task": "toy_gen", "limit": 1}})
    r = runner.invoke(app, ["evaluate", str(recipe), "--include-path", str(tasks_dir)])
    assert r.exit_code == 2, r.stderr
    assert "Error: task 'code' runs model-written code to score it" in r.stderr


# --------------------------------------------------------------------------- recipes and bundled tasks
def test_table4_recipe_has_the_papers_settings():
    from dllm_align.config.recipe import load_recipe

    plans = {p.key: p for p in R.plan_tasks(load_recipe("table4_downstream"))}
    got = {k: (p.sampler.gen_length, p.sampler.block_length, p.sampler.steps, p.num_fewshot) for k, p in plans.items()}
    assert got == {  # the paper's eval-config table (docs/design.md#evaluation)
        "gsm8k": (256, 8, 256, 5),
        "mmlu": (3, 3, 3, 5),
        "hellaswag": (3, 3, 3, 0),
        "humaneval": (512, 512, 32, 0),
        "gpqa": (128, 128, 64, 5),
    }
    assert all(p.apply_chat_template and p.sampler.temperature == 0 and p.sampler.cfg == 0 for p in plans.values())
    assert plans["mmlu"].harness_task == "mmlu_generative"


def test_bad_task_settings_are_recipe_errors(tmp_path):
    from dllm_align.core.errors import UserError
    from dllm_align.config.recipe import load_recipe

    p = tmp_path / "r.yaml"
    p.write_text("evaluate:\n  tasks:\n    gsm8k: {gen_length: 10, block_length: 4}\n    mmlu:\n")
    with pytest.raises(UserError, match=r"evaluate.tasks.gsm8k: gen_length \(10\) must be a multiple of block_length \(4\)"):
        load_recipe(str(p))


def test_bundled_hellaswag_gen_renders_like_the_harness():
    import yaml
    from lm_eval.utils import apply_template

    spec = yaml.safe_load((E.bundled_task_dir() / "hellaswag_gen.yaml").read_text())
    doc = {
        "activity_label": "Making a cake",
        "ctx_a": "A woman mixes flour [step] in a bowl.",
        "ctx_b": "she",
        "endings": ["pours it [title] out.", "eats  it.", "sings.", "leaves."],
        "label": "2",
    }
    text = apply_template(spec["doc_to_text"], doc)
    assert text == (
        "Choose the most plausible continuation.\n"
        "Making a cake: A woman mixes flour in a bowl. She\n"
        "A. pours it. out.\nB. eats it.\nC. sings.\nD. leaves.\nAnswer:"
    )
    assert apply_template(spec["doc_to_target"], doc) == "C"


# --------------------------------------------------------------------------- data parallel
@pytest.mark.multiproc
def test_two_processes_give_the_single_process_result(tiny, tmp_path):
    """torchrun with 2 CPU processes (gloo): each takes half the documents; rank 0 merges."""
    texts = direct_texts(tiny, GEN_QUESTIONS, chat=False)
    stop, answers = stop_and_answers(texts)
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    write_gen_task(tasks_dir, answers, stop)
    direct = [[float(direct_elbo(tiny, q, " " + c).mean()) for c in ch] for q, ch in MC_DOCS]
    write_mc_task(tasks_dir, [max(range(3), key=v.__getitem__) for v in direct])
    recipe = _recipe(tmp_path, {"gen": {"task": "toy_gen"}, "mc": {"task": "toy_mc"}})
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "dllm_align", "evaluate", str(recipe), "--include-path", str(tasks_dir), "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    scores = json.loads(out.stdout)["models"]["builtin_tiny"]["scores"]
    assert scores["gen"]["value"] == pytest.approx(0.5)
    assert scores["mc"]["value"] == pytest.approx(1.0)
    run = tmp_path / "run" / "eval" / "builtin_tiny"
    assert json.loads((run / "results.json").read_text())["config"]["world_size"] == 2
    rows = [json.loads(x) for x in (run / "samples_mc.jsonl").read_text().splitlines()]
    assert sorted(r["doc_id"] for r in rows) == list(range(len(MC_DOCS)))  # both halves merged
    for r in rows:
        got = [x[0][0] for x in r["resps"]]
        assert got == pytest.approx(direct[r["doc_id"]], abs=1e-4)


# --------------------------------------------------------------------------- another family
@pytest.fixture(scope="module", params=["builtin:tiny-dream", "builtin:tiny-sdar", "builtin:tiny-llada2"])
def tiny_dream(request):
    from dllm_align.models.load import load_model

    return load_model(request.param)


def test_other_families_through_the_harness(tiny_dream, tmp_path):
    """`evaluate` on a Dream-format model (generation by Dream's rule, likelihoods through the shifted ELBO)
    and on a block-diffusion one (the block rule, the block ELBO): the harness returns what direct calls return."""
    texts = direct_texts(tiny_dream, GEN_QUESTIONS, chat=True)
    stop, answers = stop_and_answers(texts)
    (tmp_path / "gen").mkdir()
    (tmp_path / "mc").mkdir()
    write_gen_task(tmp_path / "gen", answers, stop)
    res = run_harness(make_lm(tiny_dream), tmp_path / "gen", "toy_gen", apply_chat_template=True, log_samples=True)
    got = [s["filtered_resps"][0] for s in sorted(res["samples"]["toy_gen"], key=lambda s: s["doc_id"])]
    assert got == [E.truncate_at_stops(t, [stop]) for t in texts]
    direct = [[float(direct_elbo(tiny_dream, q, " " + c).mean()) for c in choices] for q, choices in MC_DOCS]
    best = [max(range(len(v)), key=v.__getitem__) for v in direct]
    write_mc_task(tmp_path / "mc", best)
    res = run_harness(make_lm(tiny_dream), tmp_path / "mc", "toy_mc", log_samples=True)
    harness_ll = [[r[0][0] for r in s["resps"]] for s in sorted(res["samples"]["toy_mc"], key=lambda s: s["doc_id"])]
    assert torch.allclose(torch.tensor(harness_ll), torch.tensor(direct), atol=1e-4)
    assert res["results"]["toy_mc"]["acc,none"] == pytest.approx(1.0)
    # greedy_check: the model's own one-token-per-step decode is greedy (a block model decodes in its own
    # blocks, here 3 tokens of a longer block), a changed last token is not
    ids = list(tiny_dream.tokenizer("Hello", add_special_tokens=False)["input_ids"])
    b = getattr(tiny_dream, "block_size", None)
    n = b or 3
    st = SamplerSettings(gen_length=n, block_length=n, steps=n, threshold=None)
    raw = generate(tiny_dream, [ids], st, stop_early=False)[0].raw[:3]
    other = [raw[0], raw[1], (raw[2] + 1) % len(tiny_dream.tokenizer)]
    out = make_lm(tiny_dream, greedy_check=True).score_tokens([(ids, raw, "own"), (ids, other, "other")])
    assert out[0][1] is True and out[1][1] is False


# --------------------------------------------------------------------------- a likelihood the recipe chooses
def direct_draws(mp, context: str, continuation: str, cfg: DrawConfig, likelihood) -> torch.Tensor:
    """The K draws of one (context, continuation) pair from ``likelihood``'s own per-draw terms, run alone."""
    tok = mp.tokenizer
    ctx = list(tok(context, add_special_tokens=False)["input_ids"])
    cont = list(tok(continuation, add_special_tokens=False)["input_ids"])
    ids = torch.tensor([ctx + cont])
    cm = torch.zeros_like(ids, dtype=torch.bool)
    cm[0, len(ctx):] = True
    with torch.no_grad():
        return likelihood.draw_terms(mp, ids, torch.ones_like(ids), cm, [E.request_id(context, continuation)], cfg)[0]


def _llada21_recipe(tmp_path: Path, tasks: dict, *, likelihood: bool = True) -> Path:
    body = {"name": "t21", "output_dir": str(tmp_path / "run"), "model": {"name_or_path": "builtin:tiny-llada21"},
            "generate": {"gen_length": 8, "block_length": 8},
            "evaluate": {"mc_num": MC_NUM, "batch_size": 8, "bootstrap_iters": 0, "tasks": tasks}}
    if likelihood:
        body["reference"] = {"likelihood": "hybrid", "hybrid": {"mask_share": 0.25}}
    p = tmp_path / "eval21.yaml"
    p.write_text(json.dumps(body))
    return p


def test_the_recipes_likelihood_scores_loglikelihood_and_is_recorded(tmp_path):
    """`evaluate` on a LLaDA2.1 model with ``reference.likelihood: hybrid`` (what such a model was trained with)
    scores every loglikelihood request with the masked-plus-replaced bound at the recipe's mask share: the harness's
    values are the bound's per-draw terms called directly (not the family's block ELBO, which differs); results.json's
    config, each task's fingerprint and the stderr line name the choice; the same recipe without the key scores with
    the block ELBO as before."""
    from dllm_align.config.recipe import load_recipe
    from dllm_align.models.load import load_model
    from dllm_align.objective.block import BLOCK
    from dllm_align.objective.hybrid import HYBRID

    mp = load_model("builtin:tiny-llada21")
    recipe = _llada21_recipe(tmp_path, {"mc": {"task": "toy_mc"}})
    share = load_recipe(str(recipe)).reference.own_settings("hybrid")
    bound_cfg = DrawConfig(n_mc=MC_NUM, seed=0, estimator="l", stratified=True, likelihood="hybrid",
                           likelihood_settings=(("hybrid", share),))
    block_cfg = DrawConfig(n_mc=MC_NUM, seed=0, estimator="l", stratified=True)
    bound = [[float(direct_draws(mp, q, " " + c, bound_cfg, HYBRID).mean()) for c in ch] for q, ch in MC_DOCS]
    block = [[float(direct_draws(mp, q, " " + c, block_cfg, BLOCK).mean()) for c in ch] for q, ch in MC_DOCS]
    assert max(abs(a - b) for x, y in zip(bound, block) for a, b in zip(x, y)) > 0.1  # the check below can fail
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    write_mc_task(tasks_dir, [max(range(3), key=v.__getitem__) for v in bound])
    r = runner.invoke(app, ["evaluate", str(recipe), "--include-path", str(tasks_dir)])
    assert r.exit_code == 0, r.stderr
    assert "loglikelihood: 8 ELBO draws of the hybrid likelihood, reference.likelihood)" in r.stderr
    run = tmp_path / "run" / "eval" / "builtin_tiny-llada21"
    samples = sorted((json.loads(x) for x in (run / "samples_mc.jsonl").read_text().splitlines()),
                     key=lambda s: s["doc_id"])
    got = [[resp[0][0] for resp in s["resps"]] for s in samples]
    assert torch.allclose(torch.tensor(got, dtype=torch.float64), torch.tensor(bound, dtype=torch.float64), atol=1e-4)
    merged = json.loads((run / "results.json").read_text())
    assert merged["results"]["toy_mc"]["acc,none"] == pytest.approx(1.0)
    config = merged["config"]
    assert config["likelihood"] == "hybrid" and config["likelihood_settings"] == {"mask_share": 0.25}
    assert config["packing"] is False  # the bound scores unpacked rows (evaluate.packing is on)
    fp = json.loads((run / "tasks" / "mc.json").read_text())["fingerprint"]
    assert fp["likelihood"] == "hybrid" and fp["likelihood_settings"] == {"mask_share": 0.25}

    # the family's own likelihood without the key: the block ELBO, recorded by name, tasks not reused
    plain = _llada21_recipe(tmp_path, {"mc": {"task": "toy_mc"}}, likelihood=False)
    r = runner.invoke(app, ["evaluate", str(plain), "--include-path", str(tasks_dir)])
    assert r.exit_code == 0, r.stderr
    assert "reusing" not in r.stderr and "of the hybrid likelihood" not in r.stderr
    samples = sorted((json.loads(x) for x in (run / "samples_mc.jsonl").read_text().splitlines()),
                     key=lambda s: s["doc_id"])
    got = [[resp[0][0] for resp in s["resps"]] for s in samples]
    assert torch.allclose(torch.tensor(got, dtype=torch.float64), torch.tensor(block, dtype=torch.float64), atol=1e-4)
    config = json.loads((run / "results.json").read_text())["config"]
    assert config["likelihood"] == "block" and "likelihood_settings" not in config and config["packing"] is True


def test_a_likelihood_the_family_does_not_take_is_refused_by_name(tmp_path):
    """``reference.likelihood: hybrid`` with a LLaDA2.0 model (to evaluate, or to compare with): one error line
    naming the key, exit 2, before eval/ is written; the harness class refuses it too (a hub model, checked once
    loaded), and from the harness's model arguments alone the bound takes its declared mask share."""
    from dllm_align.core.errors import UserError
    from dllm_align.models.load import load_model

    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    write_mc_task(tasks_dir, [0] * len(MC_DOCS))
    recipe = _llada21_recipe(tmp_path, {"mc": {"task": "toy_mc"}})
    for args in (["-m", "builtin:tiny-llada2"], ["--compare", "builtin:tiny-llada2"]):
        r = runner.invoke(app, ["evaluate", str(recipe), "--include-path", str(tasks_dir), *args])
        errors = [x for x in r.stderr.splitlines() if x.startswith("Error")]
        assert r.exit_code == 2 and len(errors) == 1, r.stderr
        assert "reference.likelihood: 'hybrid' does not fit llada2 models" in errors[0]
        assert not (tmp_path / "run" / "eval").exists()
    with pytest.raises(UserError, match="'hybrid' does not fit llada2 models"):
        E.DiffusionLM(predictor=load_model("builtin:tiny-llada2"), likelihood="hybrid", gen_length=8, block_length=8)
    lm = E.DiffusionLM(predictor=load_model("builtin:tiny-llada21"), likelihood="hybrid", gen_length=8, block_length=8)
    info = lm.get_model_info()
    assert info["likelihood"] == "hybrid" and info["likelihood_settings"] == {"mask_share": 0.5}


def test_packing_is_left_to_likelihoods_that_pack():
    """evaluate.packing (on by default) packs only where the likelihood packs: a DiffusionGemma model (the uniform
    likelihood, which scores against each example's own clean context and has nothing to pack) is scored, with the
    values packing off gives, instead of refused with a training key's message; ``config.packing`` says what ran."""
    from dllm_align.models.load import load_model

    mp = load_model("builtin:tiny-diffusiongemma")
    Req = lm_eval.api.instance.Instance
    reqs = [Req("loglikelihood", {}, ("The cat sat on the", " mat"), 0), Req("loglikelihood", {}, ("Q:", " an answer"), 1)]
    on = make_lm(mp, mc_num=4, batch_size=8, max_length=128)
    off = make_lm(mp, mc_num=4, batch_size=8, max_length=128, packing=False)
    assert on.packing and not on.packs and on.get_model_info()["packing"] is False
    assert [x[0] for x in on.loglikelihood(reqs)] == [x[0] for x in off.loglikelihood(reqs)]
