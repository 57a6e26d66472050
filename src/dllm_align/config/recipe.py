"""Typed recipes: YAML bundles validated into pydantic models.

A recipe has one section per stage of the pipeline (model, data, reference,
train, generate, judge, ablate, evaluate). Loading reports *every* problem at
once, each with its dotted path: unknown keys (with a "did you mean"), wrong
types, out-of-range values and contradictory fields. ``--set a.b=value``
overrides go through the same validation.

The schema is in :mod:`dllm_align.config.schema`; this module finds, reads (`extends`), overrides and
validates recipes, and writes the provenance of a run (resolved recipe, versions, git revision).
"""

from __future__ import annotations

import difflib
import json
import os
import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from importlib.resources import files
from pathlib import Path
from typing import Any, Callable, Optional

import yaml
from pydantic import BaseModel, ValidationError

from dllm_align.core.errors import UserError
from dllm_align.config.schema import KeyedError, Recipe, rule_problems
from dllm_align.core.io import atomic_write_text, note_input
from dllm_align.core.runfolder import recipe_record


# --------------------------------------------------------------------------- loading
def bundled_dir() -> Path:
    """Folder of the recipes shipped with the package (falls back to the source tree)."""
    try:
        p = Path(str(files("dllm_align.recipes")))
        if p.is_dir() and any(p.glob("*.yaml")):
            return p
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parents[3] / "recipes"


def bundled_names() -> list[str]:
    return sorted(p.stem for p in bundled_dir().glob("*.yaml"))


def locate(name_or_path: str) -> Path:
    """A bundled recipe name or a path to a YAML file.

    A bare name is a bundled recipe. A local *folder* of the same name (a run
    folder called ``demo``) never hides it; a local *file* of that name is
    ambiguous and refused, so the recipe used is never a silent guess.
    """
    p = Path(name_or_path)
    cand = bundled_dir() / f"{name_or_path}.yaml"
    bare = p.suffix not in (".yaml", ".yml") and os.sep not in name_or_path and "/" not in name_or_path
    if bare and cand.is_file():
        if p.is_file():
            raise UserError(
                f"'{name_or_path}' is both a bundled recipe and a file here",
                hint=f"write ./{name_or_path} for the file, or move it, to use the bundled recipe",
            )
        return cand
    if p.suffix in (".yaml", ".yml") or os.sep in name_or_path or p.exists():
        if not p.is_file():
            what = "is a folder, not a recipe file" if p.is_dir() else "not found"
            raise UserError(f"recipe file {what}: {name_or_path}", hint="`dllm-align recipes list` shows the bundled recipes")
        return p
    names = bundled_names()
    close = difflib.get_close_matches(name_or_path, names, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"bundled recipes: {', '.join(names)}"
    raise UserError(f"no bundled recipe named '{name_or_path}' and no such file", hint=hint)


def _fields_at(model_cls: type[BaseModel], path: tuple) -> list[str]:
    """Field names of the section addressed by ``path`` (for did-you-mean)."""
    cls: Any = model_cls
    for part in path:
        if isinstance(part, int):
            continue
        f = getattr(cls, "model_fields", {}).get(part)
        if f is None:
            return []
        ann = f.annotation
        cls = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if cls is None:
            return []
    return list(getattr(cls, "model_fields", {}).keys())


def _short(label: str, limit: int = 80) -> str:
    """A flag as given, cut to ``limit`` characters (an error line names a value, it does not repeat a long one)."""
    return label if len(label) <= limit else label[: limit - 3] + "..."


def _blame(dotted: str, source: str, given: dict[str, str], section: Optional[str] = None) -> str:
    """Who set the value an error is about: a flag or ``--set`` (``given``: dotted key ->
    how the user gave it) rather than the recipe file, which may not even hold that key. ``section``: the
    section whose check found the problem, when it names one key (``dotted``) but looked at others too."""
    given = {key: _short(label) for key, label in given.items()}
    for key, label in given.items():
        if dotted == key or dotted.startswith(key + "."):
            return label
    near = [label for key, label in given.items() if key.startswith((section or dotted) + ".")]
    if near:  # a check across a section's fields, one of which came from the command line
        return f"{source} with {', '.join(near)}"
    return source


def format_errors(err: ValidationError, source: str, given: Optional[dict[str, str]] = None) -> list[str]:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        section = None
        keyed = (e.get("ctx") or {}).get("error")
        if isinstance(keyed, KeyedError):
            # a section's check about one key below it (a component's setting, a key it ignores): name that key,
            # and blame whoever set a key of the section (the check may have read several, as a cross-key one does)
            section = ".".join(str(x) for x in loc)
            loc = loc + tuple(keyed.key.split("."))
            e = {**e, "loc": loc, "msg": keyed.message}
            if keyed.message.startswith("unknown key"):
                dotted = ".".join(str(x) for x in loc)
                lines.append(f"{_blame(dotted, source, given or {})}: {keyed.message.replace('unknown key', f'unknown key {dotted!r}', 1)}")
                continue
        dotted = ".".join(str(x) for x in loc) or "(top level)"
        where = _blame(dotted, source, given or {}, section)
        if e["type"] == "extra_forbidden":
            known = _fields_at(Recipe, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
            msg = f"unknown key '{dotted}'"
            if close:
                parent = ".".join(str(x) for x in loc[:-1])
                msg += f" (did you mean '{parent + '.' if parent else ''}{close[0]}'?)"
        elif e["type"] in ("value_error", "assertion_error"):
            msg = f"{dotted}: {str(e['msg']).removeprefix('Value error, ')}" if loc else str(e["msg"]).removeprefix("Value error, ")
        else:
            got = e.get("input")
            got_s = "" if isinstance(got, dict) else f" (got {json.dumps(got, default=str)[:60]})"
            msg = f"{dotted}: {e['msg']}{got_s}"
        lines.append(f"{where}: {msg}")
    return lines


# Recipe values nest a few levels (section.key.list.item); anything this deep is a mistake or an attack
# (Python's recursion limit would otherwise surface as a raw RecursionError).
MAX_DEPTH = 32
# Bounded work for any YAML a command reads (the bundled recipes are under 3 KB, with a handful of
# aliases at most): a file past MAX_YAML_BYTES is refused before it is parsed (the pure-Python parser
# takes seconds per megabyte), and aliases are counted and their expansion sized on the parsed node
# graph, so an alias bomb ("billion laughs": nested anchors, each used many times) is refused at
# once instead of being expanded by whatever walks the values next.
MAX_YAML_BYTES = 64 << 10
MAX_ALIASES = 100
MAX_YAML_VALUES = 100_000


def _depth(obj: Any, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of plain data, walked without recursion (stops counting past ``limit``)."""
    best, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        best = max(best, d)
        if d > limit:
            return d
        if isinstance(o, dict):
            stack += [(v, d + 1) for v in o.values()]
        elif isinstance(o, (list, tuple)):
            stack += [(v, d + 1) for v in o]
    return best


def _load_text(text: str) -> Any:
    """Parse YAML text with the recipe loader (safe, no duplicate keys, merge keys, text-only tags),
    refusing values nested deeper than :data:`MAX_DEPTH`. Raises yaml.YAMLError or ValueError."""
    if len(text) > MAX_YAML_BYTES:  # a --set value, or text that was not read through read_yaml_text
        raise ValueError(f"{len(text):,} characters, more than the {MAX_YAML_BYTES >> 10} KiB a recipe may hold")
    loader = _UniqueKeyLoader(text)  # a SafeLoader: plain data only
    try:
        try:
            data = loader.get_single_data()
        except RecursionError:
            raise ValueError(f"values nested deeper than {MAX_DEPTH} levels") from None
    finally:
        loader.dispose()
    if _depth(data) > MAX_DEPTH:
        raise ValueError(f"values nested deeper than {MAX_DEPTH} levels")
    return data


def _parse_value(text: str) -> Any:
    """A --set value: YAML when it parses (so numbers, booleans and lists keep their type), else the text."""
    try:
        return _load_text(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict, overrides: list[str]) -> list[str]:
    """Apply ``a.b=value`` overrides in place; returns problems (bad syntax)."""
    problems = []
    for ov in overrides or []:
        if "=" not in ov:
            problems.append(f"--set {ov!r}: expected section.key=value")
            continue
        key, _, val = ov.partition("=")
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            problems.append(f"--set {ov!r}: empty key")
            continue
        try:
            _set_path(raw, parts, _parse_value(val))
        except ValueError as e:
            problems.append(f"--set {key.strip()}: {e}")
    return problems


def _set_path(raw: dict, parts: list[str], value: Any) -> None:
    node = raw
    for p in parts[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = {}
            node[p] = nxt
        node = nxt
    node[parts[-1]] = value


def _shown(flag: str, value: Any) -> str:
    """A flag as the user gave it, for error messages."""
    if isinstance(value, bool):
        return flag
    return f"{flag} {', '.join(map(str, value)) if isinstance(value, (list, tuple)) else value}"


class YamlTooLarge(yaml.composer.ComposerError):
    """YAML refused for the work it would take (too many aliases, or aliases that expand too far)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last one,
    so a second `train:` section would silently replace the first). Standard merge keys
    (``<<: *defaults``) work, keys written beside them override the merged ones, and values
    tagged as something other than text, numbers, booleans, lists or mappings (``!!binary``,
    ``!!set``) are refused."""

    aliases = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.events.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise YamlTooLarge(
                    None, None, f"more than {MAX_ALIASES} aliases (*name); a recipe needs a few at most", self.peek_event().start_mark)
        return super().compose_node(parent, index)

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None and self.aliases:
            size = _expanded_size(node, MAX_YAML_VALUES)
            if size > MAX_YAML_VALUES:
                raise YamlTooLarge(
                    None, None, f"its aliases expand to more than {MAX_YAML_VALUES:,} values (an alias bomb?)", None)
        return node

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<`: merged by SafeLoader, not a key of its own
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                dup = key in seen
            except TypeError:  # an unhashable key: SafeLoader reports it
                break
            if dup:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (first on line {seen[key] + 1})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _expanded_size(root, limit: int) -> int:
    """How many values a YAML node graph holds once every alias is expanded (an alias is the same node
    object as its anchor, so the graph is shared): each node's size is computed once, without recursion,
    and the count stops past ``limit``."""
    sizes: dict[int, int] = {}
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        if isinstance(node, yaml.MappingNode):
            kids = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            kids = list(node.value)
        else:
            kids = []
        if not children_done and any(id(k) not in sizes for k in kids):
            stack.append((node, True))
            stack += [(k, False) for k in kids if id(k) not in sizes]
            continue
        sizes[id(node)] = min(limit + 1, 1 + sum(sizes.get(id(k), 0) for k in kids))
    return sizes[id(root)]


def read_yaml_text(path: Path, what: str = "recipe") -> str:
    """A YAML file's text, read only up to :data:`MAX_YAML_BYTES` (a bigger file, or a device that never
    ends, is refused by its size before any of it is parsed)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_YAML_BYTES + 1)
    except IsADirectoryError:
        raise UserError(f"{path}: is a folder, not a {what} file") from None
    if len(data) > MAX_YAML_BYTES:
        try:
            size = f"{path.stat().st_size:,} bytes"
        except OSError:
            size = "more"
        raise UserError(f"{path}: {size}, more than the {MAX_YAML_BYTES >> 10} KiB a {what} file may hold",
                        hint=f"a {what} holds settings, not data: point at data files from it")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _refuse_tag(loader, node):
    raise yaml.constructor.ConstructorError(
        None, None, f"a value tagged {node.tag.replace('tag:yaml.org,2002:', '!!')} is not allowed in a recipe "
        "(recipes hold text, numbers, booleans, lists and mappings)", node.start_mark)


for _tag in ("binary", "set", "omap", "pairs"):
    _UniqueKeyLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _refuse_tag)


class TooManyDigits:
    """An integer written with more digits than Python converts (``sys.get_int_max_str_digits``): kept as this
    value, which no setting accepts, so the schema refuses it naming the key instead of the parser failing with
    Python's own conversion message."""

    def __init__(self, digits: int):
        self.digits = digits

    def __str__(self) -> str:
        return f"an integer of {self.digits:,} digits"

    __repr__ = __str__


def _construct_int(loader, node):
    try:
        return yaml.constructor.SafeConstructor.construct_yaml_int(loader, node)
    except ValueError:
        return TooManyDigits(sum(c.isdigit() for c in str(node.value)))


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def load_yaml_file(path: Path, what: str = "recipe") -> Any:
    """A YAML file (a recipe, an accelerate config) read with bounded work: its size, its nesting and its
    aliases are limited; every problem is one UserError naming the file (and the line)."""
    text = read_yaml_text(path, what)
    try:
        return _load_text(text)
    except ValueError as e:
        raise UserError(f"{path}: {e}", hint=f"a {what} nests a few levels (section.key); flatten the value")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if isinstance(e, YamlTooLarge):
            raise UserError(f"{path}{where}: refused: {problem}", hint="write the values out, or use a few anchors")
        raise UserError(f"{path}{where}: invalid YAML: {problem}")


def read_yaml(path: Path) -> dict:
    note_input(path, "recipe")
    raw = load_yaml_file(path)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a recipe must be a mapping of sections, got {type(raw).__name__}")
    return raw


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_with_extends(path: Path, _seen: tuple = ()) -> dict:
    """Read a recipe; ``extends: NAME_OR_PATH`` starts from another recipe and overrides it section by section."""
    raw = read_yaml(path)
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise UserError(f"{path}: 'extends' must be a recipe name or path, got {type(parent).__name__}")
    ppath = Path(parent)
    if not ppath.is_absolute() and (path.parent / ppath).is_file():
        ppath = path.parent / ppath
    else:
        ppath = locate(parent)
    key = str(ppath.resolve())
    if key in _seen or key == str(path.resolve()):
        raise UserError(f"{path}: 'extends' makes a cycle through {ppath}")
    return _deep_merge(read_with_extends(ppath, _seen + (str(path.resolve()),)), raw)


def load_recipe(
    name_or_path: str | None,
    overrides: list[str] | None = None,
    output_dir: str | None = None,
    flags: Optional[dict[str, tuple[str, Any]]] = None,
    auto_rule: Optional[Callable[[Recipe], Optional[str]]] = None,
) -> Recipe:
    """Load, override and validate a recipe; every problem is reported at once (UserError, exit 2).

    ``flags`` is how a command's flags reach the recipe: dotted key -> (the flag, its value), e.g.
    ``{"generate.gen_length": ("--gen-length", 64)}``. Each value is set as it is (0, False, "" and None
    included: pass only the flags given), after the ``--set`` overrides, and validated with the recipe;
    its errors name the flag. Errors in ``--set`` overrides are named as ``--set key=value``.
    ``auto_rule``: the decoding rule a recipe's ``sampler: auto`` stands for (None when none applies or the model
    cannot be read, as ``generate.rules.auto_rule``): its checks run here too, so that their errors name the flags.
    """
    if name_or_path is None:
        raw, source = {}, "(defaults)"
    else:
        path = locate(name_or_path)
        raw, source = read_with_extends(path), str(path)
    problems = apply_overrides(raw, overrides or [])
    given: dict[str, str] = {}
    for ov in overrides or []:
        key = ov.partition("=")[0]
        given[".".join(p for p in key.strip().split(".") if p)] = f"--set {ov}"
    for key, (flag, value) in (flags or {}).items():
        if key in given:  # the flag would silently win over the --set of the same key
            problems.append(f"{_short(given[key])} and {_short(_shown(flag, value))} both set {key}: give one")
        _set_path(raw, key.split("."), value)
        given[key] = _shown(flag, value)
    if output_dir is not None:
        if "output_dir" in given:
            problems.append(f"{_short(given['output_dir'])} and -o {_short(str(output_dir))} both set output_dir: give one")
        raw["output_dir"] = output_dir
        given["output_dir"] = f"-o {output_dir}"
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as e:
        problems += format_errors(e, source, given)
        recipe = None
    hint = None
    if recipe is not None and auto_rule is not None:
        rule = auto_rule(recipe)
        found = rule_problems(recipe.generate, rule) if rule is not None else []
        problems += [f"{_blame(f'generate.{key}', source, given, 'generate')}: generate.{key}: {msg}" for key, msg in found[:1]]
        hint = f"generate.sampler is auto: the model decodes with the {rule} rule" if found else None
    if problems:
        n = len(problems)
        head = f"{n} problem{'s' if n > 1 else ''} in recipe {source}:\n  " if n > 1 else ""
        raise UserError(head + "\n  ".join(problems) if n > 1 else problems[0], hint=hint)
    return recipe


def to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


# --------------------------------------------------------------------------- provenance
def git_revision() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        if out.returncode == 0:
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=here, capture_output=True, text=True, timeout=5,
            ).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def library_versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for pkg in ("dllm-align", "torch", "transformers", "accelerate", "datasets", "tokenizers", "safetensors", "peft", "lm-eval"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def write_run_info(recipe: Recipe, out_dir: str | Path, command: str, changes: Optional[list] = None) -> Path:
    """Write the fully resolved recipe plus versions and git revision into the run folder.

    Each command has its own record (``recipe.<command>.yaml``, ``run_info.<command>.json``),
    so one command never replaces another's. ``changes`` (settings let through on a
    resume) are added to those recorded before, so the record keeps the run's history.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(recipe_record(out, command), to_yaml(recipe))
    info_path = out / f"run_info.{command}.json"
    history: list = []
    if info_path.is_file():
        try:
            history = list(json.loads(info_path.read_text(encoding="utf-8")).get("changes") or [])
        except (ValueError, UnicodeDecodeError, AttributeError, TypeError):
            history = []
    info = {
        "command": command,
        "argv": sys.argv,
        "versions": library_versions(),
        "git_revision": git_revision(),
    }
    if history or changes:
        info["changes"] = history + list(changes or [])
    atomic_write_text(info_path, json.dumps(info, indent=2))
    return out

