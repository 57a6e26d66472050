"""The published on-disk layout of each family's checkpoint: the ``config.json`` fields its own code and the
serving engines key on, and the remote-code files beside it (docs/serving.md has the table and its sources).

dllm-align loads every family natively into a transformers class (SDAR into ``Qwen3ForCausalLM``, LLaDA into a
Llama body, LLaDA-MoE into ``Qwen3MoeForCausalLM``), so the config a trained model carries is that class's, not
the published one: an SDAR folder saved as it is says ``model_type: qwen3`` with no ``architectures`` and no
``auto_map``, and SDAR's own loading path then builds a causal ``Qwen3ForCausalLM``. :func:`published_config`
gives the fields the published layout needs (a family's ``published_fields`` translates a native config back);
:func:`published_state` gives the published weight names (a family's ``published_state``: LLaDA's
``model.transformer.*``, LLaDA-MoE's per-expert matrices); :func:`copy_remote_code` copies the modeling files the
source checkpoint had (and the modules they import, read with ``ast``); :func:`write_published_layout` does all of
it to a saved folder; :func:`write_published_tokenizer` makes the saved tokenizer one the published stacks'
transformers 4 reads (the source's own files where the tokenizer is unchanged). They write into a folder the caller
renames into place whole (``final/`` is written as ``.tmp-final``).

The source checkpoint's own ``config.json`` is the authority when there is one (training does not change the
architecture): its ``model_type``, ``architectures``, ``auto_map`` and every other field are kept, and only
what training changed (the dtype) is taken from the trained config. A model with no published source (the
built-in ones) gets the family's published fields from its record (``Family.published``, ``block_size``,
``mask_token_id``).
"""

from __future__ import annotations

import ast
import json
import stat
from pathlib import Path
from typing import Optional

from dllm_align.core.errors import UserError
from dllm_align.models.families import family_for_config, get_family


# Keys dllm-align adds to a config for its own loading; the published code has no use for them.
_OWN_KEYS = ("dllm_align_family", "is_causal")


def _rope_as_published(cfg: dict) -> dict:
    """transformers 5 writes ``rope_parameters``; the published (4.x-era) configuration classes read ``rope_theta``
    and ``rope_scaling``."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" not in cfg:
        cfg["rope_theta"] = rp.get("rope_theta")
        kind = rp.get("rope_type", "default")
        if kind != "default":
            cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
        else:
            cfg.setdefault("rope_scaling", None)
    return cfg


def published_config(family: str, trained: dict, source: Optional[dict] = None) -> dict:
    """The ``config.json`` of an exported ``family`` checkpoint in its published layout.

    ``trained``: the config the trained model carries (``config.to_dict()``); ``source``: the source checkpoint's
    own ``config.json`` (None for a model with no published source). Raises KeyError for an unknown family.
    """
    fam = get_family(family)
    layout = fam.published
    if layout is None:
        raise KeyError(family)
    if source is not None and (source.get("architectures") or source.get("auto_map")):
        out = {k: v for k, v in source.items() if k not in _OWN_KEYS}
        for key in ("torch_dtype", "dtype"):
            if key in trained:
                out["torch_dtype"] = str(trained[key]).replace("torch.", "")
        out.pop("dtype", None)
    else:
        inverse = fam.published_fields
        out = inverse(trained) if inverse else {k: v for k, v in trained.items() if k not in _OWN_KEYS}
        out = _rope_as_published(out)
        out.pop("rope_parameters", None)
        if "dtype" in trained:
            out["dtype"] = trained["dtype"]
        out["model_type"] = layout.model_type
        out["architectures"] = list(layout.architectures)
        out["auto_map"] = dict(layout.auto_map)
        if "dtype" in out:
            out["torch_dtype"] = str(out.pop("dtype")).replace("torch.", "")
    for key, value in layout.defaults.items():
        out.setdefault(key, value)
    if fam.block_size is not None and "block_size" not in out:
        out["block_size"] = int(trained.get("block_size") or fam.block_size)
    if "mask_token_id" not in out:
        out["mask_token_id"] = int(trained.get("mask_token_id") or fam.mask_token_id)
    return out


def _module_names(maps: list) -> set[str]:
    """The module names ``auto_map`` entries point at (``modeling_sdar`` for ``modeling_sdar.SDARForCausalLM``, the
    part after ``--`` for a hub reference)."""
    modules = set()
    for m in maps:
        for ref in (m.values() if isinstance(m, dict) else ()):
            for r in ref if isinstance(ref, (list, tuple)) else [ref]:
                if isinstance(r, str) and "." in r:
                    modules.add(r.rsplit(".", 1)[0].split("--")[-1])
    return modules


def _tokenizer_auto_map(folder: Path) -> dict:
    """The ``auto_map`` of ``folder``'s tokenizer_config.json ({} without one); a file that is not a JSON object is
    refused naming it (it would be read only at export, after training)."""
    tok_cfg = folder / "tokenizer_config.json"
    if not tok_cfg.exists() and not tok_cfg.is_symlink():
        return {}
    text = _regular_text(folder, tok_cfg)
    try:
        data = json.loads(text)
    except ValueError as e:
        raise UserError(f"{tok_cfg}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{tok_cfg}: not a JSON object")
    return data.get("auto_map") or {}


def hub_blobs_of(root: Path) -> Optional[Path]:
    """The blobs folder a Hugging Face cache snapshot's files link into (``models--org--name/snapshots/<rev>/x`` ->
    ``../../blobs/<hash>``: how the hub client stores every download), or None for any other folder. A link from a
    snapshot into its own repository's blobs is the cache's layout, not a file pulled from elsewhere."""
    repo = root.parent.parent
    if root.parent.name != "snapshots" or not repo.name.startswith(("models--", "datasets--", "spaces--")):
        return None
    blobs = repo / "blobs"
    return blobs if blobs.is_dir() else None


def _regular_bytes(folder: Path, path: Path) -> bytes:
    """The bytes of ``path``, a regular file inside ``folder`` (a link may point only inside it): anything else (a
    link out of the folder, a folder, a FIFO) is refused naming the file."""
    try:
        real, root = path.resolve(strict=True), folder.resolve(strict=True)
    except (OSError, RuntimeError) as e:
        raise UserError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    if root != real.parent and root not in real.parents and real.parent != hub_blobs_of(root):
        raise UserError(f"{path}: a link out of its folder (to {real}); the export copies files from inside {folder} only")
    if not stat.S_ISREG(real.stat().st_mode):
        raise UserError(f"{path}: not a regular file; the export copies regular files only")
    try:
        return real.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror or e})") from None


def _regular_text(folder: Path, path: Path) -> str:
    """The UTF-8 text of ``path`` (:func:`_regular_bytes`); undecodable bytes are refused naming the file."""
    data = _regular_bytes(folder, path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def local_imports(folder: Path, path: Path, text: str) -> set[str]:
    """The modules of ``folder`` that the Python source ``text`` (of ``path``) imports, read with ``ast`` (nothing is
    run): every relative import (``from .x import``, ``from . import x``), which the published loader
    (transformers' dynamic modules) copies beside the file and so must be there, refused by name when it is not;
    and an absolute import whose top name is a file of ``folder`` (``import x`` beside ``x.py``)."""
    try:
        tree = ast.parse(text, filename=str(path))
    except SyntaxError as e:
        raise UserError(f"{path}: not Python the published code can import (line {e.lineno}: {e.msg})") from None
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            if node.level > 1 or (node.module and "." in node.module):
                raise UserError(f"{path}: imports {'.' * node.level}{node.module or ''} (line {node.lineno}), outside "
                                "its folder; the export copies the files of one folder only")
            wanted = [node.module] if node.module else [a.name for a in node.names]
            for name in wanted:
                if not (folder / f"{name}.py").exists() and not (folder / f"{name}.py").is_symlink():
                    raise UserError(f"{path}: imports .{name} (line {node.lineno}), but {folder} has no {name}.py; "
                                    "the published code cannot be loaded without it")
                names.add(name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            tops = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            names |= {t.split(".")[0] for t in tops if (folder / f"{t.split('.')[0]}.py").is_file()}
    return names


def remote_code_files(folder: Path, cfg: dict) -> list[Path]:
    """The Python files of ``folder`` a published config (and tokenizer config) points at through ``auto_map``,
    with the modules of the folder they import, and what those import (:func:`local_imports`), sorted. A module
    ``auto_map`` names that the folder lacks is left out (the export then names no ``auto_map``), but one that a
    present file imports is refused by name. Only regular UTF-8 files inside ``folder`` under plain module names are
    taken; anything else is refused naming it (:func:`check_remote_code` runs this before training, so a refusal
    never comes after the work)."""
    folder = Path(folder)
    modules = _module_names([cfg.get("auto_map") or {}, _tokenizer_auto_map(folder)])
    found: set[Path] = set()
    todo = sorted(modules)
    while todo:
        name = todo.pop()
        if not name.isidentifier():
            raise UserError(f"{folder}: auto_map names the module {name[:80]!r}, not a module of this folder "
                            "(a plain name, no '..' or '/')")
        path = folder / f"{name}.py"
        if path in found or not (path.exists() or path.is_symlink()):
            continue
        text = _regular_text(folder, path)
        found.add(path)
        todo += sorted(local_imports(folder, path, text))
    return sorted(found)


def check_remote_code(folder: Optional[Path], cfg: Optional[dict], family: Optional[str] = None) -> None:
    """Refuse, before the first step, what an export of a model from ``folder`` (its config ``cfg``; the
    family's published ``auto_map`` too) would copy but cannot: the remote-code files (:func:`remote_code_files`)
    and generation_config.json (the tokenizer's files: :func:`tokenizer_files`). None: no folder, nothing to check."""
    if folder is None or not Path(folder).is_dir():
        return
    folder = Path(folder)
    maps = dict((cfg or {}).get("auto_map") or {})
    if family is not None:

        layout = get_family(family).published
        if layout is not None:
            maps.update(layout.auto_map)
    remote_code_files(folder, {"auto_map": maps})
    gen = folder / "generation_config.json"
    if gen.exists() or gen.is_symlink():
        _regular_text(folder, gen)


def copy_remote_code(source: Path, dest: Path, cfg: dict) -> list[str]:
    """Copy the remote-code files of ``source`` (:func:`remote_code_files`) into ``dest``; their names."""
    names = []
    for path in remote_code_files(source, cfg):
        (dest / path.name).write_text(_regular_text(Path(source), path), encoding="utf-8")
        names.append(path.name)
    return names


def published_state(family: str, state: dict) -> dict:
    """The trained (native) state dict under the family's published weight names."""
    inverse = get_family(family).published_state
    return inverse(state) if inverse else dict(state)


def missing_remote_code(folder: Path, cfg: dict) -> list[str]:
    """The modules ``cfg``'s ``auto_map`` names that ``folder`` has no file for (``modeling_sdar`` for
    ``modeling_sdar.SDARForCausalLM``), sorted."""
    mods = {r.rsplit(".", 1)[0].split("--")[-1] for r in (cfg.get("auto_map") or {}).values()
            if isinstance(r, str) and "." in r}
    return sorted(m for m in mods if not (Path(folder) / f"{m}.py").is_file())


def write_published_layout(folder: Path, family: str, source: Optional[Path], code: Optional[Path] = None,
                           source_config: Optional[dict] = None) -> dict:
    """Turn a model folder saved with the trained (native) config into the family's published layout, in place:
    ``config.json`` from :func:`published_config`, and from the ``source`` checkpoint folder (None: a model with no
    published source) its remote-code files and ``generation_config.json``. ``code``: a folder holding the family's
    published modeling files, copied in when the source has none (a built-in model).

    A folder whose ``auto_map`` names modules it does not carry cannot be loaded through it (transformers looks
    for the files beside config.json), so when neither ``source`` nor ``code`` supplies them, ``auto_map`` is left
    out: ``model_type`` and ``architectures`` (what the serving engines key on) stay, and the code can be added later
    together with the ``auto_map`` of the family's ``published`` layout. ``source_config``: the source's config.json
    as the caller read it already (a training run reads it once). Returns the written config."""
    folder = Path(folder)
    trained = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    src_cfg = source_config
    if src_cfg is None and source is not None and (Path(source) / "config.json").is_file():
        src_cfg = json.loads((Path(source) / "config.json").read_text(encoding="utf-8"))
    cfg = published_config(family, trained, src_cfg)
    layout = get_family(family).published
    if "auto_map" not in cfg and layout is not None and layout.auto_map:
        # a source that names its architecture but ships no auto_map (the packaged SDAR base): the published one,
        # kept below only if the source folder or ``code`` supplies every file it names
        cfg["auto_map"] = dict(layout.auto_map)
    if source is not None and Path(source).is_dir():
        copy_remote_code(Path(source), folder, cfg)
        gen = Path(source) / "generation_config.json"
        if gen.exists() or gen.is_symlink():
            (folder / gen.name).write_text(_regular_text(Path(source), gen), encoding="utf-8")
    if code is not None and missing_remote_code(folder, cfg):
        copy_remote_code(Path(code), folder, cfg)
    if missing_remote_code(folder, cfg):
        cfg.pop("auto_map", None)
    fam = get_family(family)
    if (fam.folder_claim is not None and src_cfg is not None and "dllm_align_family" in src_cfg
            and not fam.folder_claim(folder, cfg)):
        # a family told from another sharing its model_type only by evidence (LLaDA2.1: the key or its remote code),
        # exported without that code: the source's key stays, or the folder would read back as the other family
        cfg["dllm_align_family"] = src_cfg["dllm_align_family"]
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return cfg


# The files a tokenizer is saved in, by transformers 4 and 5 (which writes only tokenizer.json, tokenizer_config.json
# and chat_template.jinja, dropping the slow tokenizer's vocabulary files).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json")
# The vocabulary files that added tokens never change: a slow tokenizer class (the ``auto_map`` of SDAR's and Dream's
# tokenizers) reads them, so they stay even when the rest of the tokenizer is written anew.
BASE_VOCABULARY = ("vocab.json", "merges.txt", "vocab.txt", "tokenizer.model")
# transformers 5's class for any tokenizer.json; the published stacks' transformers (4.52, 4.57) do not have it.
_V5_CLASS = "TokenizersBackend"
# The transformers 4 class that reads a tokenizer.json alone (and transformers 5 still reads).
_FAST_CLASS = "PreTrainedTokenizerFast"
# Keys transformers 5 writes into tokenizer_config.json that are not tokenizer settings: its backend's name and the
# arguments the tokenizer was loaded with (transformers 4 would pass them on to the tokenizer's constructor).
_V5_ONLY = ("backend", "is_local", "local_files_only")


def tokenizer_files(folder: Optional[Path]) -> list[Path]:
    """The tokenizer files of ``folder`` (:data:`TOKENIZER_FILES` present), each checked to be a regular file inside
    it (refused by name otherwise, before training: the export copies them)."""
    if folder is None or not Path(folder).is_dir():
        return []
    found = [Path(folder) / n for n in TOKENIZER_FILES if (Path(folder) / n).exists() or (Path(folder) / n).is_symlink()]
    for path in found:
        _regular_bytes(Path(folder), path)
    return found


def published_tokenizer_config(cfg: dict, tokenizer_class: str = _FAST_CLASS) -> dict:
    """``tokenizer_config.json`` in the form the published stacks' transformers 4 reads: transformers 5's
    ``TokenizersBackend`` class becomes ``tokenizer_class`` (the source's own class where it had one, else
    :data:`_FAST_CLASS`), its ``extra_special_tokens`` list becomes ``additional_special_tokens`` (transformers 4 reads
    ``extra_special_tokens`` as a mapping of named tokens), and the keys it writes that are no tokenizer setting
    (:data:`_V5_ONLY`) go. Anything else is kept."""
    out = dict(cfg)
    if out.get("tokenizer_class") in (None, _V5_CLASS):
        out["tokenizer_class"] = tokenizer_class
    for key in _V5_ONLY:
        out.pop(key, None)
    extra = out.get("extra_special_tokens")
    if isinstance(extra, list):
        del out["extra_special_tokens"]
        known = list(out.get("additional_special_tokens") or [])
        out["additional_special_tokens"] = known + [t for t in extra if t not in known]
    return out


def write_published_tokenizer(folder: Path, source: Optional[Path], unchanged: bool) -> list[str]:
    """Make the tokenizer saved in ``folder`` one that the family's published stack loads
    (``AutoTokenizer.from_pretrained(folder, trust_remote_code=True)`` under the transformers it pins): where the
    tokenizer is the ``source`` folder's ``unchanged``, the source's tokenizer files replace the saved ones byte for
    byte; else the saved ones stay with the source's vocabulary files (:data:`BASE_VOCABULARY`) beside them. Either
    way a ``tokenizer_config.json`` in transformers 5's form is rewritten (:func:`published_tokenizer_config`), the
    only file changed then. Returns the names of the files taken from the source."""
    folder = Path(folder)
    src = tokenizer_files(source)
    # without its tokenizer_config.json the source's files alone name no class: the saved ones stay
    unchanged = unchanged and any(p.name == "tokenizer_config.json" for p in src)
    taken = [p for p in src if unchanged or p.name in BASE_VOCABULARY]
    if unchanged and src:
        for name in TOKENIZER_FILES:
            (folder / name).unlink(missing_ok=True)
    for path in taken:
        if unchanged or not (folder / path.name).exists():
            (folder / path.name).write_bytes(_regular_bytes(Path(source), path))
    cfg_path = folder / "tokenizer_config.json"
    if cfg_path.is_file():
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        source_class = None
        if source is not None and (Path(source) / "tokenizer_config.json") in src:
            source_class = json.loads(_regular_text(Path(source), Path(source) / "tokenizer_config.json")).get("tokenizer_class")
        fixed = published_tokenizer_config(cfg, source_class if source_class not in (None, _V5_CLASS) else _FAST_CLASS)
        if fixed != cfg:
            cfg_path.write_text(json.dumps(fixed, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return [p.name for p in taken]


def tokenizer_signature(tok) -> tuple:
    """What decides a tokenizer's ids and turns: its vocabulary with added tokens, its special tokens and its chat
    template (two tokenizers with the same signature encode and decode alike)."""
    specials = {k: str(v) for k, v in tok.special_tokens_map.items()}
    return (sorted(tok.get_vocab().items()), sorted(specials.items()), sorted(map(str, tok.all_special_tokens)),
            tok.chat_template)


def drop_own_keys(folder: Path) -> dict:
    """``folder``'s config.json without dllm-align's own keys (:data:`_OWN_KEYS`), as the published layouts write
    it: for a family whose published layout is transformers' own (DiffusionGemma), known again by its
    ``model_type`` and ``architectures``. A config that only the key tells apart (a plugin family's toy) keeps it,
    or the folder would read back as another family. Returns the written config."""
    path = Path(folder) / "config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    out = {k: v for k, v in cfg.items() if k not in _OWN_KEYS}
    if out == cfg or family_for_config(out).name != family_for_config(cfg).name:
        return cfg
    path.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out
