"""The frozen reference's weights without a full copy at the weights' dtype on any process.

A model whose folder names each weight (``mp.weight_sources``: a family that reads by name, safetensors files) is
made with empty storage and then read one weight at a time, each in its stored dtype:

* on an FSDP2 launch of several processes, sharded as the policy is (the family's decoder layers as units, then the
  root), each process reading only its rows of each weight (:func:`dllm_align.models.shards.read_weight_shards`).
  FSDP2 gathers a unit's parameters in one dtype, so the shards keep the weights' dtype and autocast casts each
  Linear per call: the very function the FSDP2 policy computes (``models.precision``), exact against the cache;
* otherwise whole, each weight read straight into the dtype it stays resident in (a Linear in the autocast dtype
  under autocast, ``models.precision.prepare_reference``), on the device: no fp32 copy of the model exists on the
  host or on the device at any moment.

A sharded reference's forwards are collectives: every process must make as many. Training calls it exactly where it
calls the policy (the same count on every rank); precompute deals out micro-batches of different sizes, so there
each forward is announced (:meth:`ShardedReference.finish` runs a process's share of forwards to the end).
"""

from __future__ import annotations

from typing import Callable

import torch

from dllm_align.models.families.base import Family
from dllm_align.models.precision import Precision, fsdp_mixed_precision, reference_cast_modules
from dllm_align.models.shards import read_weight_shards
from dllm_align.training.distributed import fsdp_launch_of, is_fsdp
from dllm_align.training.policy import PolicyScorer, fsdp2_mesh

# lazy imports: torch.distributed.fsdp: fully_shard is public from torch 2.6 (pyproject allows 2.4); only FSDP2 runs use it


def sharded_launch(accelerator) -> bool:
    """Whether ``accelerator`` is an FSDP2 launch of several processes (the reference is then sharded)."""
    return (accelerator is not None and is_fsdp(accelerator) and fsdp_launch_of(accelerator)[0] == 2
            and accelerator.num_processes > 1)


def resident_dtypes(model: torch.nn.Module, precision: Precision) -> None:
    """Give each weight of an empty model the dtype it stays resident in (``models.precision.prepare_reference``'s
    choice) without reading or writing its storage: new empty tensors, so no page of the model becomes resident (a
    weight two modules share stays shared)."""
    made: dict[int, torch.nn.Parameter] = {}
    for mod in reference_cast_modules(model, precision):
        for name, p in list(mod.named_parameters(remove_duplicate=False)):
            if p.is_floating_point() and p.dtype != precision.autocast:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=precision.autocast, device=p.device),
                                                     requires_grad=p.requires_grad)
                owner, _, leaf = name.rpartition(".")
                setattr(mod.get_submodule(owner), leaf, made[id(p)])


class ShardedReference:
    """The reference sharded by FSDP2, seen as its MaskPredictor: scoring calls go through the FSDP2 root (so every
    unit is gathered), everything else is the MaskPredictor's. ``lockstep``: announce each forward to the other
    processes (precompute, where processes make different numbers of forwards)."""

    def __init__(self, mp, module: torch.nn.Module):
        self.__dict__.update(mp=mp, module=module, lockstep=False, last=None, capturing=False)

    def __getattr__(self, name):
        return getattr(self.mp, name)

    def target_logprobs(self, *args, **kwargs):
        return self._call("target_logprobs", args, kwargs)

    def canvas_logits(self, *args, **kwargs):
        return self._call("canvas_logits", args, kwargs)

    def _call(self, name: str, args, kwargs):
        if self.capturing:
            self.__dict__["last"] = (name, args, kwargs)
            raise _Captured
        if self.lockstep:
            self._anyone_working(True)
            self.__dict__["last"] = (name, args, kwargs)
        return self.module(*args, call=name, **kwargs)

    def _anyone_working(self, working: bool) -> bool:
        flag = torch.tensor([int(working)], device=self.mp.device)
        torch.distributed.all_reduce(flag)
        return bool(flag.item())

    @torch.no_grad()
    def finish(self, probe: Callable[[], object]) -> None:
        """Wait for the other processes' forwards, joining each with one of this process's (result dropped), until
        every process is done. ``probe``: a scoring call whose first forward's arguments this process repeats when
        it has made none yet (its arguments are taken, nothing is computed)."""
        while self._anyone_working(False):
            if self.last is None:
                self.__dict__["capturing"] = True
                try:
                    probe()
                except _Captured:
                    pass
                finally:
                    self.__dict__["capturing"] = False
            name, args, kwargs = self.last
            self.module(*args, call=name, **kwargs)


class _Captured(Exception):
    """Raised by a capturing :class:`ShardedReference` once it holds a forward's arguments."""


def shard_reference(mp, accelerator) -> ShardedReference:
    """An empty-storage reference sharded by FSDP2 as the policy is (decoder layers as units, then the root, the
    policy's precision policy: no parameter cast), then each process's rows of each weight read."""
    from torch.distributed.fsdp import fully_shard

    scorer = PolicyScorer(mp)
    mesh, policy = fsdp2_mesh(accelerator), fsdp_mixed_precision(2)
    cls = Family.decoder_layer_class(mp.model)
    for layer in [m for m in mp.model.modules() if cls is not None and isinstance(m, cls)]:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(scorer, mesh=mesh, mp_policy=policy)
    read_weight_shards(scorer, mp.weight_sources, prefix="model.")
    return ShardedReference(mp, scorer)


def read_reference(mp, precision: Precision, device) -> None:
    """An empty-storage reference read whole, each weight straight into its resident dtype, on ``device``."""
    resident_dtypes(mp.model, precision)
    mp.model.to(device)  # empty storage: nothing is copied that was ever written
    read_weight_shards(mp.model, mp.weight_sources)
