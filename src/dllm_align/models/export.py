"""The published on-disk layout of each family's checkpoint: the ``config.json`` fields its own code and the
serving engines key on, and the remote-code files beside it (docs/serving.md has the table and its sources).

dllm-align loads every family natively into a transformers class (SDAR into ``Qwen3ForCausalLM``, LLaDA into a
Llama body, LLaDA-MoE into ``Qwen3MoeForCausalLM``), so the config a trained model carries is that class's, not
the published one: an SDAR folder saved as it is says ``model_type: qwen3`` with no ``architectures`` and no
``auto_map``, and SDAR's own loading path then builds a causal ``Qwen3ForCausalLM``. :func:`published_config`
gives the fields the published layout needs (a family's ``published_fields`` translates a native config back);
:func:`published_state` gives the published weight names (a family's ``published_state``: LLaDA's
``model.transformer.*``, LLaDA-MoE's per-expert matrices); :func:`copy_remote_code` copies the modeling files the
source checkpoint had; :func:`write_published_layout` does all of it to a saved folder. Both are pure apart from the copy (the caller writes the folder atomically).

The source checkpoint's own ``config.json`` is the authority when there is one (training does not change the
architecture): its ``model_type``, ``architectures``, ``auto_map`` and every other field are kept, and only
what training changed (the dtype) is taken from the trained config. A model with no published source (the
built-in ones) gets the family's published fields from its record (``Family.published``, ``block_size``,
``mask_token_id``).
"""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path
from typing import Optional

from dllm_align.core.errors import UserError
from dllm_align.models.families import get_family


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


def _regular_text(folder: Path, path: Path) -> str:
    """The UTF-8 text of ``path``, a regular file inside ``folder`` (a link may point only inside it): anything
    else (a link out of the folder, a folder, a FIFO, undecodable bytes) is refused naming the file."""
    try:
        real, root = path.resolve(strict=True), folder.resolve(strict=True)
    except (OSError, RuntimeError) as e:
        raise UserError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    if root != real.parent and root not in real.parents:
        raise UserError(f"{path}: a link out of its folder (to {real}); the export copies files from inside {folder} only")
    if not stat.S_ISREG(real.stat().st_mode):
        raise UserError(f"{path}: not a regular file; the export copies regular files only")
    try:
        return real.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror or e})") from None


def remote_code_files(folder: Path, cfg: dict) -> list[Path]:
    """The Python files of ``folder`` a published config (and tokenizer config) points at through ``auto_map``,
    with the sibling modules they import from the same folder (``from .x import``), sorted. Only regular UTF-8
    files inside ``folder`` under plain module names are taken; anything else is refused naming it
    (:func:`check_remote_code` runs this before training, so a refusal never comes after the work)."""
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
        todo += re.findall(r"^\s*from \.(\w+) import", text, flags=re.M)
    return sorted(found)


def check_remote_code(folder: Optional[Path], cfg: Optional[dict], family: Optional[str] = None) -> None:
    """Refuse, before the first step, what an export of a model from ``folder`` (its config ``cfg``; the
    family's published ``auto_map`` too) would copy but cannot: the remote-code files and
    generation_config.json (:func:`remote_code_files`). None: no folder, nothing to check."""
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
