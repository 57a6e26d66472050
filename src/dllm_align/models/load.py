"""Model loading and the mask-predictor interface.

Three kinds of model load the same way (:func:`load_model`):

* ``builtin:tiny`` and the other ``BUILTIN_SPECS`` - a tiny random model of a
  family's layout (``builtin:tiny``: LLaDA's, a Llama body with ``is_causal = False``)
  and a byte-level tokenizer, both built from code by the family
  (``Family.build_tiny``) with no network. Used by tests, the demo and CI.
* Checkpoints of a known family (LLaDA, Dream, LLaDA-MoE: ``dllm_align.models.families``)
  - mapped onto a native bidirectional transformers model; no
  ``trust_remote_code`` needed, and the result supports gradient checkpointing,
  SDPA / flash attention and KV caches (docs/design.md#model-families).
* Anything transformers can load (``AutoModelForCausalLM``, or ``AutoModel``
  with ``trust_remote_code`` when the user turns it on).

Local folders and hub ids go through the same path; an unreachable hub is a
one-line error.


The interface every stage calls is :class:`dllm_align.models.predictor.MaskPredictor`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from packaging.version import Version

from dllm_align.config import components as registry
from dllm_align.core.console import warn
from dllm_align.core.errors import RunFailure, UserError
from dllm_align.core.io import fsync_tree, verify_checksums, waiting_lock
from dllm_align.data.read import hub_reachable
from dllm_align.models.block_attention import VARIANTS, use_streams_attention
from dllm_align.models.families import (
    FAMILIES,
    describe_config,
    family_for_config,
    family_of,
    get_family,
    native_family,
    with_folder_evidence,
)
from dllm_align.models.families.base import (Family, WeightSources, check_finite, check_weight_files, empty_weights,
                                             from_pretrained_checked, refuse_oversized)
from dllm_align.models.precision import keep_fp32_buffers

if TYPE_CHECKING:
    pass
from dllm_align.models.predictor import MaskPredictor
from dllm_align.models.shards import empty_transformers_model

# lazy imports: transformers, huggingface_hub: imported inside the functions that build a model or reach the Hub: the
# memory estimate (`doctor`) imports this module to read a config.json only, and transformers takes longer to import than torch



BUILTIN_TINY = "builtin:tiny"

# How long a process waits for another process of its node to download a model (the largest take hours).
DOWNLOAD_WAIT_S = 4 * 3600.0


@dataclass(frozen=True)
class TinySpec:
    hidden_size: int = 64
    layers: int = 2
    heads: int = 4
    intermediate_size: int = 128
    max_position_embeddings: int = 4096
    seed: int = 0
    family: str = "llada"  # the family that builds it (its Family's tiny_tokenizer and build_tiny)


class _BuiltinSpecs(Mapping):
    """The built-in tiny models by ``builtin:`` name: each declared family's ``builtin_models`` trait
    (``dllm_align.models.components``), read live so that a family declared later brings its own."""

    def _table(self) -> dict[str, TinySpec]:
        return {name: TinySpec(**shape, family=comp.name)
                for comp in registry.components("family").values() if "builtin_models" in comp.traits
                for name, shape in comp.traits["builtin_models"].items()}

    def __getitem__(self, name: str) -> TinySpec:
        return self._table()[name]

    def __iter__(self):
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


# Random-init models built from code (no files), deterministic by spec.
BUILTIN_SPECS: Mapping[str, TinySpec] = _BuiltinSpecs()


def add_builtin_model(name: str, spec: TinySpec) -> None:
    """Make ``name`` a built-in model of ``spec.family`` for this process (the GPU checks' published-size bodies):
    the family's declaration is replaced by one with the model in its ``builtin_models``."""
    comp = registry.get("family", spec.family)
    shape = {k: v for k, v in asdict(spec).items() if k != "family"}
    models = {**(comp.traits["builtin_models"] if "builtin_models" in comp.traits else {}), name: shape}
    registry.redeclare(replace(comp, traits={**comp.traits, "builtin_models": models}))


# Trained models shipped inside the package: name -> folder under dllm_align/assets.
BUILTIN_ASSETS = {"builtin:toy-sort-base": "toy_sort_base", "builtin:toy-sort-base-dream": "toy_sort_base_dream",
                  "builtin:toy-sort-base-sdar": "toy_sort_base_sdar", "builtin:toy-sort-base-gemma": "toy_sort_base_gemma",
                  "builtin:toy-sort-base-llada21": "toy_sort_base_llada21"}


# The oldest transformers whose attention masks honour ``config.is_causal = False``: 5.0 and 5.1 build a
# causal mask regardless, so every body here would silently attend left to right (found by running the
# suite on 5.0.0; it passes whole on 5.2.0 and on the newest release).
MIN_TRANSFORMERS = "5.2"


def require_transformers(version: str) -> None:
    """Refuse a transformers release that would make the bidirectional bodies causal."""
    if Version(version) < Version(MIN_TRANSFORMERS):
        raise UserError(f"transformers {version} is too old: before {MIN_TRANSFORMERS} it ignores is_causal=False, "
                        "so a diffusion model's attention would be causal",
                        hint=f"pip install 'transformers>={MIN_TRANSFORMERS},<6'")


def _ready_transformers() -> None:
    """Before any model or tokenizer is made: refuse a transformers that would make the bodies causal,
    and quiet its logging and progress bars."""
    import transformers

    require_transformers(transformers.__version__)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:
        pass


# --------------------------------------------------------------------------- tiny model
def _tiny_family(family: str):
    """The family that makes a built-in model (its ``tiny_tokenizer`` and ``build_tiny``); one without them is refused."""
    fam = get_family(family)
    if fam.build_tiny is None or fam.tiny_tokenizer is None:
        have = ", ".join(f.name for f in FAMILIES.values() if f.build_tiny is not None)
        raise UserError(f"model family '{fam.name}' has no built-in model", hint=f"families with one: {have}")
    return fam


def build_tiny_tokenizer(family: str = "llada"):
    """The byte-level tokenizer of a family's built-in models: its special tokens and chat template.

    Every string round-trips exactly, so any real text (the kto-mix rows) can be
    fed to a tiny model; one token is one UTF-8 byte.
    """
    return _tiny_family(family).tiny_tokenizer()


def build_tiny_model(tokenizer=None, spec: TinySpec = TinySpec()):
    """A randomly initialised built-in model of ``spec.family``'s layout; deterministic for a given spec."""
    _ready_transformers()
    fam = _tiny_family(spec.family)
    tokenizer = tokenizer or fam.tiny_tokenizer()
    return fam.build_tiny(tokenizer, spec.hidden_size, spec.layers, spec.heads, spec.intermediate_size,
                          spec.max_position_embeddings, spec.seed)


def save_tiny(path: str | Path, spec: TinySpec = TinySpec()) -> Path:
    """Write the tiny model and tokenizer as a model folder (built beside ``path``, then renamed into place)."""
    tok = build_tiny_tokenizer(spec.family)
    model = build_tiny_model(tok, spec)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        fsync_tree(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


# --------------------------------------------------------------------------- resolving and loading
def _hub_snapshot(repo_id: str, revision: Optional[str]) -> Path:
    """Download (or find in the local cache) a hub repo's config, tokenizer and safetensors."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.py"]
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_files_only=True))
    except Exception:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        raise UserError(
            f"model '{repo_id}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set",
            hint="pass a local folder (model.name_or_path: /path/to/model) or unset HF_HUB_OFFLINE",
        )

    if not hub_reachable():
        raise UserError(f"model '{repo_id}' is not in the local Hugging Face cache and the Hugging Face Hub cannot be reached",
                        hint="pass a local folder (model.name_or_path: /path/to/model), or run where the hub is reachable")
    # One process per node downloads (the node's processes share its Hugging Face cache): the first to take the
    # lock fetches the files, the others wait for it (bounded) and then read them from the cache.
    lock = Path(HF_HUB_CACHE) / ".locks" / "dllm-align" / f"{repo_id.replace('/', '--')}@{revision or 'main'}.lock"
    try:
        with waiting_lock(lock, DOWNLOAD_WAIT_S, f"download of '{repo_id}'"):
            try:
                return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_files_only=True))
            except Exception:
                pass  # not there yet: this process downloads
            return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, etag_timeout=10))
    except RunFailure:
        raise
    except Exception as e:  # network down, no such repo, gated repo
        reason = type(e).__name__
        raise UserError(
            f"could not fetch model '{repo_id}' from the Hugging Face Hub ({reason})",
            hint="check the name and your network, or pass a local folder",
        ) from None


def resolve_model_path(name_or_path: str, revision: Optional[str] = None) -> Path | str:
    if name_or_path.startswith("builtin:"):
        if name_or_path in BUILTIN_SPECS:
            return name_or_path
        if name_or_path in BUILTIN_ASSETS:
            folder = Path(__file__).resolve().parents[1] / "assets" / BUILTIN_ASSETS[name_or_path]
            if not (folder / "config.json").is_file():
                raise UserError(
                    f"the packaged model '{name_or_path}' is missing from {folder}",
                    hint="rebuild it: dllm-align train toy_sort_base -o runs/toy_sort_base (see the recipe's header)",
                )
            return folder
        known = ", ".join(sorted([*BUILTIN_SPECS, *BUILTIN_ASSETS]))
        raise UserError(f"unknown built-in model '{name_or_path}'", hint=f"built-in models: {known}")
    p = Path(name_or_path).expanduser()
    if p.exists():
        if not (p / "config.json").is_file():
            raise UserError(f"{p}: not a model folder (no config.json)")
        return p
    looks_like_path = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_like_path:
        raise UserError(f"model folder not found: {name_or_path}")
    return _hub_snapshot(name_or_path, revision)


def resolve_config_file(name_or_path: str, revision: Optional[str] = None) -> Path:
    """A model's config.json without fetching its weights (``doctor`` estimates before any download)."""
    p = Path(name_or_path).expanduser()
    if name_or_path.startswith("builtin:") or p.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        return Path(resolve_model_path(name_or_path, revision)) / "config.json"
    from huggingface_hub import hf_hub_download

    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    _ready_transformers()  # no stray huggingface_hub log line before the one Error line
    try:
        return Path(hf_hub_download(name_or_path, "config.json", revision=revision, local_files_only=True))
    except Exception:
        pass  # not cached: fetch it, if the hub can be reached at all
    if not offline and not hub_reachable():
        # A quick probe rather than the client's retries (about 28 s on a machine without a network).
        raise UserError(f"could not read the config.json of '{name_or_path}': it is not cached and the Hugging Face Hub "
                        "cannot be reached", hint="pass a local model folder, or run where the hub is reachable")
    try:
        return Path(hf_hub_download(name_or_path, "config.json", revision=revision, local_files_only=offline, etag_timeout=10))
    except Exception as e:
        raise UserError(
            f"could not read the config.json of '{name_or_path}' ({type(e).__name__})",
            hint="pass a local model folder, or check the name and your network (only config.json is fetched)",
        ) from None


def pick_dtype(name: str, device: torch.device | str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_tokenizer(path: Path | str, trust_remote_code: bool = False, family=None):
    """The tokenizer of a model folder (``family``: its fix-ups, e.g. a native twin of a remote-code class)."""
    from transformers import AutoTokenizer

    _ready_transformers()
    if str(path) in BUILTIN_SPECS:
        return build_tiny_tokenizer(BUILTIN_SPECS[str(path)].family)
    fix = None if (family is None or trust_remote_code) else family.fix_tokenizer
    try:
        if fix is not None and _names_remote_tokenizer(Path(path)):
            # Asking AutoTokenizer would prompt for remote code on a terminal: go to the native twin.
            tok = fix(None, Path(path))
        else:
            try:
                with warnings.catch_warnings():
                    # The tokenizer reads config.json too: a published `rope_scaling: null` (SDAR's) warns
                    # there, though the model is built from our own translation (rope_parameters).
                    warnings.filterwarnings("ignore", message="`rope_scaling` is deprecated", category=FutureWarning)
                    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
            except Exception:
                if fix is None:
                    raise
                tok = fix(None, Path(path))
    except Exception as e:
        raise UserError(f"{path}: could not load the tokenizer ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def _names_remote_tokenizer(folder: Path) -> bool:
    """Whether the folder's tokenizer_config.json points AutoTokenizer at shipped code."""
    try:
        cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "AutoTokenizer" in (cfg.get("auto_map") or {})


def load_model(
    name_or_path: str,
    *,
    revision: Optional[str] = None,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    mask_token_id: Optional[int] = None,
    attn_implementation: Optional[str] = None,
    tokenizer: Optional[str] = None,
    config: Optional[dict] = None,
    empty: bool = False,
) -> "MaskPredictor":
    """Load a model and its tokenizer and wrap them as a :class:`MaskPredictor`. ``config``: the folder's
    config.json as the caller read it already (:func:`model_source`), so that a run reads it once. ``empty``: read no
    weight where the folder's names say where each lies (``mp.weight_sources``, for :func:`read_weight_shards`;
    None where the weights were read as usual: a built-in model, remote code, a family that transforms them)."""
    _ready_transformers()
    path = resolve_model_path(name_or_path, revision)
    torch_dtype = pick_dtype(dtype, device)
    family = native = None
    sources: Optional[WeightSources] = None
    if isinstance(path, str) and path in BUILTIN_SPECS:
        tok = build_tiny_tokenizer(BUILTIN_SPECS[path].family)
        model = build_tiny_model(tok, BUILTIN_SPECS[path]).to(torch_dtype)
    else:
        path = Path(path)
        cfg = config if config is not None else _read_config(path)
        if not isinstance(cfg, dict):
            raise UserError(f"{path / 'config.json'}: expected a JSON object")
        # Folders written by dllm-align (checkpoints, final/) carry checksums: a
        # truncated or modified weight file is refused before it is read.
        verify_checksums(path, what="model folder", required=False,
                         hint="the folder was damaged after it was written; use an earlier checkpoint")
        if trust_remote_code:
            warn(f"trust_remote_code is on: running Python code shipped with {name_or_path}")

        cfg = with_folder_evidence(cfg, path)  # the hub's LLaDA2.1 says llada2_moe: its shipped code tells it apart
        family = family_for_config(cfg)
        if family.refuse_reason:
            raise UserError(f"{path}: {family.name} checkpoint: {family.refuse_reason}")
        block_problem = family.block_size_problem(cfg)
        if block_problem:
            raise UserError(f"{path / 'config.json'}: {block_problem}", hint="the block size the model was trained with")
        native = None if trust_remote_code else native_family(cfg)
        if native is not None:
            check_weight_files(path, cfg)  # each file opens and holds weights, before any loader reads them
            try:
                with empty_weights() if empty else contextlib.nullcontext() as found:
                    model = native.load_native(path, cfg, torch_dtype)
                sources = found or None
            except UserError:
                raise
            except Exception as e:  # a truncated or damaged safetensors file
                raise UserError(f"{path}: could not read the model weights ({_one_line(e)})") from e
        else:
            model, sources = _load_transformers(path, cfg, torch_dtype, trust_remote_code, attn_implementation, empty)
        tok = load_tokenizer(tokenizer or path, trust_remote_code, family)
        if not sources:  # empty storage is read shard by shard later (each shard's values checked there)
            check_finite(model, path)

    if family_of(model).block_size:
        _block_attention(model, attn_implementation)
    elif attn_implementation and (isinstance(path, str) or native is not None):
        _set_attention(model, attn_implementation)  # the other loads passed it to from_pretrained
    model.to(device)

    keep_fp32_buffers(model)  # a bf16 load rounds the rotary frequencies: rebuild them in fp32
    model.eval()
    mp = MaskPredictor(model, tok, mask_token_id=mask_token_id)
    mp.weight_sources = sources
    return mp


def _load_transformers(path: Path, cfg: dict, torch_dtype, trust_remote_code: bool, attn_implementation: Optional[str],
                       empty: bool) -> tuple[Any, Optional[WeightSources]]:
    """A model no family reads natively, through transformers (``from_pretrained``; with ``empty``, its weights left
    to :func:`dllm_align.models.shards.read_weight_shards` where the files name them in its layout)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    sources = None
    # use_safetensors: never unpickle a .bin checkpoint, even with weights_only.
    kw: dict[str, Any] = dict(dtype=torch_dtype, trust_remote_code=trust_remote_code, use_safetensors=True)
    if attn_implementation:
        kw["attn_implementation"] = attn_implementation
    try:
        conf = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise UserError(
            f"{path}: no model family claims this config.json ({describe_config(cfg)}) and transformers "
            f"does not know it ({str(e).splitlines()[0][:120]})",
            hint=f"families read natively: {', '.join(FAMILIES)}; if the model ships its own code, set "
                 "model.trust_remote_code: true",
        ) from None
    if any(path.glob("*.safetensors")) and not trust_remote_code:
        elements = check_weight_files(path, cfg)
        refuse_oversized(path, elements, lambda: AutoModelForCausalLM.from_config(conf))
    try:
        model = None
        if empty and not trust_remote_code:
            model, sources = empty_transformers_model(path, AutoModelForCausalLM, conf, kw)
        if model is None:
            try:
                model = from_pretrained_checked(AutoModelForCausalLM.from_pretrained, path, family_for_config(cfg).name,
                                                config=conf, **kw)
            except ValueError:
                if not trust_remote_code:
                    raise
                model = from_pretrained_checked(AutoModel.from_pretrained, path, family_for_config(cfg).name, config=conf, **kw)
    except UserError:
        raise
    except Exception as e:
        # A truncated safetensors file, a .bin-only folder, weights of another shape
        # (the cause stays chained for DLLM_ALIGN_DEBUG=1).
        if not any(path.glob("*.safetensors")):
            raise UserError(
                f"{path}: no safetensors weights found",
                hint="dllm-align never unpickles .bin checkpoints; convert them to safetensors first",
            ) from None
        raise UserError(f"{path}: could not load the model weights ({_one_line(e)})") from e
    return model, sources


def _read_config(folder: Path) -> Any:
    try:
        return json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        why = f"{e.msg} at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        raise UserError(f"{folder / 'config.json'}: invalid JSON ({why})") from None


def _set_attention(model, impl: str) -> None:
    """Switch a loaded model's attention kernel, or refuse the setting by name."""
    try:
        model.set_attn_implementation(impl)
    except (ImportError, ValueError) as e:
        raise UserError(
            f"model.attn_implementation: {impl} is not available here ({_one_line(e, 120)})",
            hint="use sdpa (always available), or install the kernel's package on a CUDA machine",
        ) from None


def _block_attention(model, impl: Optional[str]) -> None:
    """A block-diffusion model runs the streams attention (``models.block_attention``) on sdpa (default),
    eager or FlexAttention; flash has no kernel for its layout and is refused by name."""
    if impl not in VARIANTS and impl not in VARIANTS.values():
        raise UserError(
            f"model.attn_implementation: {impl} is not available for block-diffusion models",
            hint="use sdpa (the default), flex_attention (CUDA) or eager: their training attention (K noisy streams "
                 "over one clean stream) has no flash kernel",
        )
    if not type(model).__module__.startswith(("transformers.", "dllm_align.")):
        raise UserError(
            f"{type(model).__name__}: a block-diffusion model must load natively (its attention is dllm-align's)",
            hint="set model.trust_remote_code: false; the checkpoint's own code cannot run the shared clean stream",
        )
    use_streams_attention(model, next((k for k, v in VARIANTS.items() if v == impl), impl))


def _one_line(e: BaseException, n: int = 200) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:n]}" if text else type(e).__name__


def check_max_length(mp: "MaskPredictor", max_length: int, key: str = "data.max_length") -> None:
    """Refuse a length setting beyond the model's positions (as generation refuses prompt + gen_length):
    past them a rotary model gives garbage, and ``padding: paper`` would allocate that width per row."""
    max_pos = getattr(getattr(mp.model, "config", None), "max_position_embeddings", None)
    if isinstance(max_pos, int) and max_pos > 0 and max_length > max_pos:
        raise UserError(f"{key} {max_length} is beyond the model's {max_pos} positions",
                        hint=f"set {key} to at most {max_pos}")


@dataclass(frozen=True)
class ModelSource:
    """A recipe's model as read before any weights load: its family and its config.json as read, with the folder
    that holds it (a built-in model: its spec's family, no file). ``family`` and ``config`` are None when the
    config cannot be read here: the load itself then says why."""

    name_or_path: str
    revision: Optional[str]
    family: Optional[Family]
    config: Optional[dict] = None
    folder: Optional[Path] = None


def model_source(name_or_path: str, revision: Optional[str] = None) -> ModelSource:
    """The family and config.json of a model (one read of the file), before any weights load."""
    if name_or_path in BUILTIN_SPECS:
        return ModelSource(name_or_path, revision, get_family(BUILTIN_SPECS[name_or_path].family))
    try:
        path = resolve_config_file(name_or_path, revision)
        cfg = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(cfg, dict):
            return ModelSource(name_or_path, revision, None)
        cfg = with_folder_evidence(cfg, path.parent)  # the hub's LLaDA2.1 says llada2_moe: its shipped code tells it apart
        return ModelSource(name_or_path, revision, family_for_config(cfg), cfg, path.parent)
    except (UserError, OSError, ValueError):
        return ModelSource(name_or_path, revision, None)


def check_device(device: Optional[str]):
    """The torch device for ``--device``, refused in one line when it does not exist here."""
    if not device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {device}: not a device name", hint="use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {device}: CUDA is not available on this machine", hint="use --device cpu, or leave --device out")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UserError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type not in ("cpu", "mps", "xpu"):
        raise UserError(f"--device {device}: not supported", hint="use cpu, cuda or cuda:N")
    return dev


def load_from_section(section, device: str | torch.device = "cpu", name_or_path: Optional[str] = None,
                      config: Optional[dict] = None, empty: bool = False) -> "MaskPredictor":
    """Load the model described by a recipe's ``model`` section (``config``: its config.json as already read;
    ``empty``: :func:`load_model`'s)."""
    if isinstance(device, str):
        check_device(device)
    mp = load_model(
        name_or_path or section.name_or_path,
        revision=section.revision,
        dtype=section.dtype,
        device=device,
        trust_remote_code=section.trust_remote_code,
        mask_token_id=section.mask_token_id,
        attn_implementation=section.attn_implementation,
        tokenizer=section.tokenizer,
        config=config,
        empty=empty,
    )
    if section.gradient_checkpointing:
        mp.enable_gradient_checkpointing()
    return mp


