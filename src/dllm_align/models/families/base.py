"""What a model family declares, and the loading machinery every family shares.

A :class:`Family` is a plain record: how a checkpoint of that family loads
natively (a config translation and a weight-name mapping onto a transformers
architecture), its special tokens, how its logits line up with positions, its
end-of-turn tokens, the decoder layer class that FSDP wraps, the decoding
rule its authors publish, by name the likelihood (noise process) its ELBO uses, and how its built-in tiny model
is made. The rest of dllm-align asks the family; it never branches on a family's name. Adding a family is one module in this package
(plus its tests) and one line in ``families/__init__.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors import safe_open

from dllm_align.core.errors import UserError

# lazy imports: tokenizers, transformers: imported inside the builders: the family records are read (which family
# claims a config, the memory estimate) without building anything, and transformers takes longer to import than torch

Loader = Callable[[Path, dict, torch.dtype], torch.nn.Module]


# A block longer than this is no block (when the config does not say how many positions the model has).
MAX_BLOCK_SIZE = 65536


@dataclass(frozen=True)
class PublishedLayout:
    """A family's published config.json identity (``dllm_align.models.export``): its ``model_type``, the classes
    its ``architectures`` names and the remote-code modules its ``auto_map`` points at. The fields its own code
    reads besides (the block size, the mask id) are the family's :attr:`Family.block_size` and
    :attr:`Family.mask_token_id`."""

    model_type: str
    architectures: tuple[str, ...]
    auto_map: dict = field(default_factory=dict)
    # config.json fields the published code reads but its configuration class gives no default (the values of the
    # published checkpoints): an exported config that lacks one gets it, or the published forward fails on it
    defaults: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    """Everything the rest of the code needs to know about one model family."""

    name: str
    # config.json ``model_type`` values whose checkpoints this family loads natively; the first is the
    # family's own, which a bare config with that type and no other evidence goes to.
    model_types: tuple[str, ...] = ()
    # Class names the published config.json names (``architectures``, or the classes of ``auto_map``):
    # the strongest evidence, since a ``model_type`` can be shared (LLaDA-MoE's hub config says "llada").
    architectures: tuple[str, ...] = ()
    # config.json keys only this family's configs hold: they settle a ``model_type`` shared by two
    # families when the folder names no class (LLaDA: ``d_model``; LLaDA-MoE: ``num_experts``).
    signature: tuple[str, ...] = ()
    # Evidence beside config.json for a folder its config.json alone does not tell from another family's:
    # (folder, config.json dict) -> True when the folder is this family's (LLaDA2.1: its shipped modeling file,
    # read as text). Read by ``families.with_folder_evidence``, which records the answer as ``dllm_align_family``.
    folder_claim: Optional[Callable[[Path, dict], bool]] = None
    # Which output scores position j: j - logit_shift (Dream: 1, "shifted logits";
    # position 0 then reuses its own output, as the published code does).
    logit_shift: int = 0
    # The published mask token id (the config or tokenizer still wins when it names one).
    mask_token_id: Optional[int] = None
    # Tokens that end the generated text, most specific first (resolved through the tokenizer;
    # tokens a checkpoint's vocabulary lacks are ignored).
    stop_tokens: tuple[str, ...] = ()
    # How the published code renders generated ids as text: LLaDA's decodes with
    # skip_special_tokens=True; Dream's keeps every token before the end of text (Qwen2's added
    # tokens such as <|box_end|> stay in the text).
    decode_keeps_special: bool = False
    # The decoding rule of the family's own code (docs/design.md#generation): "llada", "dream"
    # (``diffusion_generate``: one canvas, timestep schedule, confidence rules) or "block" (block
    # diffusion: block by block with a KV cache over finished blocks, ``dllm_align.generate.block``).
    sampler: str = "llada"
    # Native loader: (folder, config.json dict, dtype) -> a transformers model, no remote code.
    load_native: Optional[Loader] = None
    # Tokenizer fix-ups (a missing pad token, a remote-code tokenizer class with a native twin).
    fix_tokenizer: Optional[Callable[[Any, Path], Any]] = None
    # Published decoding defaults, written into the bundled recipes.
    decoding: dict = field(default_factory=dict)
    # The noise process and its ELBO, by name in ``dllm_align.objective.elbo.LIKELIHOODS``: "masked"
    # (whole-sequence absorbing-mask diffusion) or "block" (block diffusion over ``block_size`` blocks).
    likelihood: str = "masked"
    # Other likelihoods its models may be trained with, chosen by ``reference.likelihood`` (a recorded choice; the
    # family's ``likelihood`` stays the default); any other name is refused for this family.
    likelihood_options: tuple[str, ...] = ()
    # Block diffusion (LLaDA2.x, SDAR): the published block size; None for whole-sequence diffusion.
    block_size: Optional[int] = None
    # The published block rule (``dllm_align.generate.block``): "sdar" (SDAR's generate.py) or "llada2"
    # (LLaDA2MoeModelLM.generate: at most ``steps`` rounds, never more positions than are masked).
    block_rule: str = "sdar"
    # Why the commands refuse this family's checkpoints (said in full by ``load_model``); None: they do not.
    refuse_reason: Optional[str] = None
    # The family's built-in models (``builtin:*``, the table in ``models/load.py``): a byte-level tokenizer with
    # its special tokens, and (tokenizer, hidden_size, layers, heads, intermediate_size, max_position_embeddings,
    # seed) -> a random model of its layout, deterministic by seed. None: the family has no built-in model.
    tiny_tokenizer: Optional[Callable[[], Any]] = None
    build_tiny: Optional[Callable[..., torch.nn.Module]] = None
    # An encoder-decoder family's scoring call (DiffusionGemma): (model, context [S], clean canvases, their noisy
    # versions [K, C], self_conditioning) -> per-canvas logits [K, C, V], or for G examples of one shape (context
    # [G, S], canvases [G, C], noisy [G, K, C]) -> [G, K, C, V]; None: the family scores one sequence.
    score_canvases: Optional[Callable[..., list]] = None
    # LoRA on tied stacks: (model, target_modules) -> the module names to adapt, and (model) -> None, run after
    # the adapters are injected; None: the recipe's target_modules as they are.
    lora_modules: Optional[Callable[[Any, list], list]] = None
    after_lora: Optional[Callable[[Any], Any]] = None
    # Tied copies a saved checkpoint does not hold (DiffusionGemma: the encoder's text weights, which are the
    # decoder's): key (transformers' name) -> True to leave it out of an export; None: every key is written.
    export_skips: Optional[Callable[[str], bool]] = None
    # Files the published layout holds beside the weights and config that ``save_pretrained`` of the config does
    # not write: (folder, the model's config, tokenizer, the folder the run started from or None) -> None, run
    # after the final model is saved (DiffusionGemma: generation_config.json, which its serving engines read).
    export_extras: Optional[Callable[[Path, Any, Any, Optional[Path]], None]] = None
    # Why FSDP cannot shard this family's model (said by name when a launch asks for it); None: it can.
    fsdp_refusal: Optional[str] = None
    # Why FSDP1 (one module per unit) cannot, where FSDP2 can; None: both can.
    fsdp1_refusal: Optional[str] = None
    # FSDP2's units where one module per unit would put a parameter in two units: (model) -> groups of modules,
    # each group one ``fully_shard`` unit (DiffusionGemma: encoder layer i with decoder layer i, which share every
    # weight); None: each decoder layer its own unit (the layer class, as accelerate wraps it).
    fsdp_units: Optional[Callable[[Any], list]] = None
    # Why FSDP's activation checkpointing (``fsdp_activation_checkpointing``) would give wrong gradients here;
    # None: it gives the same ones.
    fsdp_checkpointing_refusal: Optional[str] = None
    # Export in the published layout (``dllm_align.models.export``), the inverse of the native loading: the trained
    # model's config.json dict -> the published config's fields (None: the native names are the published ones),
    # and its state dict -> the published weight names (None: the same names).
    # The memory model's questions (``dllm_align.training.memory``): whether the body normalises queries and keys,
    # (config.json dict, its routed experts) -> bool (None: only a dense Qwen3 body does); and whether the config
    # nests its text stack's fields under ``text_config``, one set of weights serving encoder and decoder
    # (DiffusionGemma), which the estimate sizes instead of the top-level fields.
    qk_norm: Optional[Callable[[dict, int], bool]] = None
    tied_text_stack: bool = False
    # Whether its native loader reads each weight by name as stored (``load_mapped`` without ``combine``): then an
    # FSDP2 launch reads each process's shard of each weight only (``models.load.read_weight_shards``); otherwise
    # every process reads the whole model first (what ``doctor``'s host-RAM line counts).
    reads_by_name: bool = True
    published: Optional[PublishedLayout] = None  # None: no published layout to export into (the native one is kept)
    published_fields: Optional[Callable[[dict], dict]] = None
    published_state: Optional[Callable[[dict], dict]] = None

    def block_size_problem(self, config: dict | Any) -> Optional[str]:
        """What is wrong with a checkpoint's ``block_size`` (None: nothing, or a whole-sequence family): a whole
        number of positions from 1 to the model's positions (``MAX_BLOCK_SIZE`` when it does not say)."""
        if not self.block_size:
            return None
        value = config.get("block_size") if isinstance(config, dict) else getattr(config, "block_size", None)
        if value is None:
            return None
        positions = (config.get("max_position_embeddings") if isinstance(config, dict)
                     else getattr(config, "max_position_embeddings", None))
        top = positions if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0 else MAX_BLOCK_SIZE
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            return (f"block_size {value!r}: a whole number of positions from 1 to {top:,} "
                    f"(the published {self.name} models use {self.block_size})")
        return None

    def block_size_in(self, config: dict | Any) -> Optional[int]:
        """The block size of one checkpoint (a config.json dict or a transformers config): its config's
        ``block_size``, else the published one; None for a whole-sequence family. A bad value is refused
        (:meth:`block_size_problem`; the loaders name the file first)."""
        if not self.block_size:
            return None
        problem = self.block_size_problem(config)
        if problem:
            raise UserError(f"the model's config: {problem}")
        value = config.get("block_size") if isinstance(config, dict) else getattr(config, "block_size", None)
        return int(value or self.block_size)

    def source_positions(self, cols: torch.Tensor) -> torch.Tensor:
        """The output positions whose hidden states score positions ``cols``."""
        if not self.logit_shift:
            return cols
        return (cols - self.logit_shift).clamp_min(0)

    def align_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Full logits [B, T, V] re-indexed so that row j predicts token j."""
        if not self.logit_shift:
            return logits
        s = self.logit_shift
        return torch.cat([logits[:, :1].expand(-1, s, -1), logits[:, :-s]], dim=1)

    @staticmethod
    def decoder_layer_class(model) -> Optional[type]:
        """The repeated block FSDP wraps (and activation checkpointing targets)."""
        # The first ``layers`` list found, so that wrappers (PEFT, DDP) around the body do not matter.
        for name, mod in model.named_modules():
            if name.rsplit(".", 1)[-1] == "layers" and isinstance(mod, torch.nn.ModuleList) and len(mod):
                return type(mod[0])
        return None


# --------------------------------------------------------------------------- built-in tokenizers
def byte_level_tokenizer(specials: list[str], *, bos: str, eos: str, mask: str, extra: list[str], chat_template: str):
    """A byte-level tokenizer: the 256 byte symbols, then ``specials`` (ids in that order).

    Every string round-trips exactly and one token is one UTF-8 byte, so any text
    can be fed to a built-in model. Padding uses EOS.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    t = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=eos, mask_token=mask,
        additional_special_tokens=extra,
    )
    t.chat_template = chat_template
    t.model_max_length = 1 << 20
    return t


# --------------------------------------------------------------------------- shared loading
def index_shards(index: Path) -> list[str]:
    """The shard files a ``model.safetensors.index.json`` names, each a plain file name in the index's own folder
    (a name with a folder in it, ``..`` or an absolute path would read weights from elsewhere), refused naming the
    index otherwise."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{index}: not a JSON index of the weights ({type(e).__name__}: {str(e)[:80]})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(f"{index}: no weight_map (an object from tensor names to the shard files holding them)")
    names = set()
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise UserError(f"{index}: weight_map[{str(tensor)[:80]!r}] is {json.dumps(name)[:80]}, not a file name "
                            "in the index's own folder")
        names.add(name)
    return sorted(names)


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return [folder / n for n in index_shards(index)]
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    raise UserError(
        f"{folder}: no safetensors weights found",
        hint="dllm-align never unpickles .bin checkpoints; convert them to safetensors first",
    )


def refuse(family: str, unsupported: list[str]) -> None:
    """One error naming every config option the native mapping does not reproduce."""
    if unsupported:
        raise UserError(
            f"{family} config options not supported by the native loader: {', '.join(unsupported)}",
            hint="set model.trust_remote_code: true to run the checkpoint's own code instead",
        )


def _short(keys: list[str]) -> str:
    return ", ".join(keys[:3]) + (" ..." if len(keys) > 3 else "")


# The dtypes weights are stored in; an integer or boolean tensor is not a weight these models read.
WEIGHT_DTYPES = {"F64", "F32", "F16", "BF16"}
_CONFIG_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}
_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16}


def check_weight_files(folder: Path, cfg: Optional[dict] = None) -> int:
    """The folder's safetensors files, read by their headers before any weight loads: each must open (a truncated
    or damaged file is refused naming it), hold weights (floating tensors: an int32 one is refused naming it), and
    when the config names the dtype it was saved in, the tensors must not all be narrower (a folder whose every
    tensor was rewritten in a lower precision is refused). Every family's loader asks this; the values' finiteness is
    checked once the model is built (:func:`check_finite`). Returns how many weight values the files hold."""
    want = _CONFIG_DTYPES.get(str((cfg or {}).get("dtype") or (cfg or {}).get("torch_dtype") or ""))
    seen: set[str] = set()
    elements = 0
    for f in safetensors_files(folder):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    dt = sf.get_slice(k).get_dtype()
                    if dt not in WEIGHT_DTYPES:
                        raise UserError(f"{f}: tensor {k[:120]!r} is {dt}, not a weight (floating point) tensor",
                                        hint="the folder was modified after it was saved; use the checkpoint as written")
                    seen.add(dt)
                    elements += math.prod(sf.get_slice(k).get_shape())
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors' own errors for a truncated or damaged file
            raise UserError(f"{f}: not a readable safetensors file ({str(e).splitlines()[0][:160]})",
                            hint="the file is truncated or damaged; use an earlier checkpoint") from None
    widest = max((_BITS[d] for d in seen), default=0)
    if want is not None and seen and want not in seen and (widest < _BITS[want] or widest == 16):
        # every tensor narrower than the config says (fp32 rewritten as fp16), or the other 16-bit format; a
        # checkpoint saved wider than its config (a bf16 model kept in fp32) loses nothing and loads
        raise UserError(f"{folder}: config.json says the weights are {want} but every tensor is "
                        f"{'/'.join(sorted(seen))}", hint="the weights were rewritten after the model was saved")
    return elements


def refuse_oversized(folder: Path, elements: int, build: Callable[[], torch.nn.Module]) -> None:
    """Refuse a config.json that describes a model far larger than the weights beside it (another model's config
    in a checkpoint folder), counted on the meta device before a loader that allocates the whole model first
    (transformers' ``from_pretrained``) runs out of memory on it."""
    with torch.device("meta"):
        model = build()
    need = sum(p.numel() for p in model.parameters())
    if need > 1.5 * elements + 1_000_000:
        raise UserError(f"{folder / 'config.json'}: describes a model of {need:,} weights, but the folder's safetensors "
                        f"hold {elements:,}", hint="the config.json is another model's; use the one saved with the weights")


def from_pretrained_checked(load: Callable, folder: Path, what: str, **kw):
    """``load(folder, **kw)`` (a transformers ``from_pretrained``) with what it tolerates refused by name: a missing
    weight (it would be random), an unknown one (dropped) and one of another shape (its own error names none)."""
    try:
        model, info = load(str(folder), output_loading_info=True, **kw)
    except RuntimeError as e:
        if "ignore_mismatched_sizes" not in str(e):
            raise
        model, info = load(str(folder), output_loading_info=True, ignore_mismatched_sizes=True, **kw)
    for problem, keys in (("is missing weights", info["missing_keys"]),
                          ("holds weights the model does not have", info["unexpected_keys"]),
                          ("holds weights of another shape than config.json gives", info["mismatched_keys"])):
        if keys:
            names = sorted(k if isinstance(k, str) else k[0] for k in keys)
            raise UserError(f"{folder}: the {what} checkpoint {problem}: {_short(names)}",
                            hint="the folder was modified after it was saved, or its config.json is another model's")
    return model


def check_finite(model, folder) -> None:
    """Refuse a model with a NaN or infinite weight, naming it (a tampered or broken file; no checksums needed)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and p.device.type != "meta" and not bool(torch.isfinite(p).all()):
                raise UserError(f"{folder}: weight {name!r} holds NaN or infinite values",
                                hint="the weights were damaged or modified; use an earlier checkpoint")


# Where each weight of a model loaded with empty weights lies in its folder: native name -> (file, key).
WeightSources = dict[str, tuple[Path, str]]
_EMPTY: contextvars.ContextVar[Optional[WeightSources]] = contextvars.ContextVar("dllm_align_empty_weights", default=None)


@contextlib.contextmanager
def empty_weights():
    """Within it, :func:`load_mapped` reads no weight: the model comes back with empty host storage (allocated, never
    written, so no page of it is resident) and the yielded dict says where each weight lies in the folder, for
    :func:`dllm_align.models.load.read_weight_shards` to read each process's shard only. A family whose weights are
    transformed as they load (``combine``: stacked experts) or that loads without :func:`load_mapped` leaves the
    dict empty and loads its weights as usual."""
    sources: WeightSources = {}
    token = _EMPTY.set(sources)
    try:
        yield sources
    finally:
        _EMPTY.reset(token)


def load_mapped(
    folder: Path,
    model_cls,
    config,
    dtype: torch.dtype,
    rename: Callable[[str], Optional[str]],
    family: str,
    combine: Optional[Callable[[dict], dict]] = None,
    prepare: Optional[Callable[[torch.nn.Module], None]] = None,
):
    """Build ``model_cls(config)`` on the meta device and fill it from the folder's safetensors.

    ``rename`` maps a checkpoint name onto the native name (None: unknown, an
    error); ``combine`` may merge renamed tensors (e.g. stack per-expert
    matrices); ``prepare`` may adjust the empty model first (e.g. drop a bias
    the family does not have). Every expected weight must be present: a missing or unknown one
    is named, so a silent numerical difference is impossible. Rotary
    frequencies are not weights: they are rebuilt in fp32 from the config
    (never trusted from a file, never left on the meta device). Each tensor is read in its stored dtype and cast
    on its own, so loading holds one full copy at ``dtype``; within :func:`empty_weights` none (the names are
    checked all the same).
    """
    with torch.device("meta"):
        model = model_cls(config)
    if prepare is not None:
        prepare(model)
    sources = _EMPTY.get() if combine is None else None
    state: dict[str, torch.Tensor] = {}
    unknown = []
    for f in safetensors_files(folder):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                nk = rename(k)
                if nk is None:
                    unknown.append(k)
                    continue
                if sources is not None:
                    state[nk] = torch.empty(sf.get_slice(k).get_shape(), dtype=dtype, device="meta")
                    sources[nk] = (f, k)
                else:
                    state[nk] = sf.get_tensor(k).to(dtype)
    if unknown:
        raise UserError(f"{folder}: weights the {family} mapping does not know: {_short(unknown)}")
    if combine is not None:
        state = combine(state)
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    expected = set(model.state_dict().keys())
    missing = sorted(expected - set(state))
    if missing:
        raise UserError(f"{folder}: {family} checkpoint is missing weights: {_short(missing)}")
    extra = sorted(set(state) - expected)
    if extra:
        raise UserError(f"{folder}: weights the {family} mapping does not know: {_short(extra)}")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for k, v in state.items():
        if tuple(v.shape) != shapes[k]:
            raise UserError(f"{folder}: weight {k!r} has shape {tuple(v.shape)}, the config gives {shapes[k]}",
                            hint="the weights do not match config.json (modified, or from another model)")
    model.load_state_dict(state, assign=True, strict=True)
    if sources is not None:
        model.to_empty(device="cpu")  # storage allocated, never written: read later, shard by shard
        if getattr(config, "tie_word_embeddings", False):
            model.tie_weights()
    rebuild_rotary(model)
    return model.eval()


def build_seeded(model_cls, config, seed: int):
    """``model_cls(config)`` with weights drawn from ``torch.manual_seed(seed)``, the global RNG left as it was."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_cls(config)
    finally:
        torch.random.set_rng_state(state)
    return model.eval()


def rebuild_rotary(model) -> None:
    """Recreate the rotary-embedding module from the config: its buffers in fp32, on the CPU."""
    inner = getattr(model, "model", None)
    rot = getattr(inner, "rotary_emb", None)
    if rot is None:
        return
    model.model.rotary_emb = type(rot)(config=model.config)


def transformers_key(key: str) -> Optional[str]:
    """Weight names already in transformers' layout (Dream on Qwen2, LLaDA-MoE on Qwen3-MoE); anything else is unknown."""
    if key == "lm_head.weight" or key.startswith("model."):
        return key
    return None


def special_ids(cfg: dict) -> dict:
    """The published config's bos/eos/pad ids and the bidirectional switch, for any translated config."""
    return {"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
            "pad_token_id": cfg.get("pad_token_id"), "is_causal": False}


def qwen_fields(cfg: dict) -> tuple[list[str], dict]:
    """A Qwen-style config.json (Dream's Qwen2, SDAR's Qwen3) read for a native transformers Qwen config:
    the options the native bodies do not reproduce, named, and the fields both configs take."""
    unsupported = []
    if cfg.get("use_sliding_window"):
        unsupported.append("use_sliding_window=true")
    if cfg.get("rope_scaling"):
        unsupported.append(f"rope_scaling={cfg['rope_scaling']!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={cfg['hidden_act']!r}")
    heads = cfg["num_attention_heads"]
    fields = dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        # A missing rope_theta takes the published configuration classes' default (10000), not the
        # checkpoints' 1e6: the folder is read as the published code would read it.
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0))},
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        use_sliding_window=False,
        **special_ids(cfg),
    )
    return unsupported, fields


def tag_config(config, cfg: dict, family: str, default_mask_id: int):
    """Record the mask id and family on a translated config (saved with every export)."""
    config.mask_token_id = cfg.get("mask_token_id", default_mask_id)
    config.dllm_align_family = family
    return config
