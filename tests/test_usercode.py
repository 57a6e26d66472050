"""Code the user names (``module:function``) is contained: its printing goes to stderr, its exits and hangs
become one error, its import failures are bad input (core/usercode.py, used by verifiers and rule judges)."""

from __future__ import annotations

import sys

import pytest

from dllm_align.core.errors import RunFailure, UserError
from dllm_align.core.usercode import call, check_spec, load_function


@pytest.fixture
def module(tmp_path, monkeypatch):
    """Write a module into a folder on sys.path; returns a writer (name, body) -> 'name'."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, body: str) -> str:
        (tmp_path / f"{name}.py").write_text(body)
        sys.modules.pop(name, None)
        monkeypatch.delitem(sys.modules, name, raising=False)
        return name

    return write


@pytest.mark.parametrize("spec", ["../../etc/passwd:f", "/etc/passwd:f", ":f", "json:", "a:b:c", "a-b:f", "a:f()", 42])
def test_a_spec_that_is_not_module_function_is_named_without_importing(spec):
    with pytest.raises(UserError) as e:
        check_spec(spec, f"--rule {spec}")
    assert e.value.message.startswith(f"--rule {spec}:") and "package.module:function" in e.value.message


@pytest.mark.parametrize("body, words", [
    ("import sys\nsys.exit(0)\n", "sys.exit(0)"),
    ("import sys\nsys.exit(3)\n", "sys.exit(3)"),
    ("raise RuntimeError('cannot start')\n", "RuntimeError: cannot start"),
    ("def f(p, c, r)\n    return True\n", "SyntaxError"),
])
def test_an_import_that_exits_or_fails_is_bad_input_naming_the_module(module, body, words):
    name = module("ucx_" + str(abs(hash(body)) % 10 ** 6), body)
    with pytest.raises(UserError) as e:
        load_function(f"{name}:f", "--rule x")
    assert name in e.value.message and words in e.value.message


def test_wrong_arity_is_refused_before_the_function_runs(module):
    name = module("uc_arity", "RAN = []\ndef f(p):\n    RAN.append(1)\n    return True\n")
    with pytest.raises(UserError, match=r"f\(\) must take \(prompt, completion, row\)"):
        load_function(f"{name}:f", "--rule x", args=("", "", {}), what="(prompt, completion, row)")
    assert sys.modules[name].RAN == []


def test_printing_goes_to_stderr_at_import_and_in_each_call(module, capsys):
    name = module("uc_print", "print('hello from import')\ndef f(x):\n    print('debug', x)\n    return True\n")
    fn, _ = load_function(f"{name}:f", "--rule x", args=(1,))
    assert call(fn, (7,), "rule x", "row 1") is True
    out, err = capsys.readouterr()
    assert out == "" and "hello from import" in err and "debug 7" in err


@pytest.mark.parametrize("code", [0, 3, None])
def test_an_exit_inside_the_function_is_one_run_time_failure(module, code):
    name = module(f"uc_exit_{code}", f"import sys\ndef f():\n    sys.exit({code!r})\n")
    fn, _ = load_function(f"{name}:f", "--rule x")
    with pytest.raises(RunFailure, match=r"rule x called sys\.exit.* on p\.jsonl:2"):
        call(fn, (), "rule x", "p.jsonl:2")


def test_a_hanging_function_is_stopped_at_its_bound(module):
    # An Event that is never set: the bound, not the function, ends the wait (no clock is asserted).
    name = module("uc_hang", "import threading\ndef f():\n    threading.Event().wait()\n")
    fn, _ = load_function(f"{name}:f", "--rule x")
    with pytest.raises(RunFailure, match="did not return within 0.2 s on row 3"):
        call(fn, (), "rule x", "row 3", seconds=0.2)


def test_a_function_that_swallows_exceptions_cannot_swallow_its_bound(module):
    name = module("uc_swallow", "import time\ndef f():\n    while True:\n        try:\n            time.sleep(10)\n"
                                "        except Exception:\n            pass\n")
    fn, _ = load_function(f"{name}:f", "--rule x")
    with pytest.raises(RunFailure, match="did not return"):
        call(fn, (), "rule x", "row 1", seconds=0.2)


def test_catastrophic_backtracking_in_a_regex_is_bounded():
    import re

    rx = re.compile(r"^(\S?\s?\S?\s?)*!$")
    with pytest.raises(RunFailure, match="did not return"):
        call(lambda c: rx.search(c), ("ab cd " * 12 + "x",), "rule regex", "row 1", seconds=0.2)


def test_the_bound_is_read_from_the_environment(monkeypatch):
    from dllm_align.core.usercode import call_seconds

    monkeypatch.setenv("DLLM_ALIGN_RULE_TIMEOUT", "2.5")
    assert call_seconds() == 2.5
    for bad in ("0", "-1", "soon", "1e9"):
        monkeypatch.setenv("DLLM_ALIGN_RULE_TIMEOUT", bad)
        with pytest.raises(UserError, match="DLLM_ALIGN_RULE_TIMEOUT"):
            call_seconds()
