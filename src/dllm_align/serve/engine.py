"""The model side of ``dllm-align serve``: one in-process generator, a bounded queue of decoding jobs and one
worker thread that decodes them in micro-batches, and loading a new checkpoint folder between batches.

Why one worker thread: the model is one set of weights on one device, and the samplers make a prompt's tokens a
function of its ids, the settings and its own seed (docs/design.md#generation: each row owns its generator; the
DiffusionGemma rule decodes each prompt under its own seeded global generator), so requests that arrive together
can be decoded in one batch without changing what each gets. Jobs are grouped by their settings (one batch
decodes under one set) and by prompt length: rows of one length need no padding, so a batch computes for each
row exactly the shapes it computes alone, and no floating-point difference between padded shapes can flip a
near-tie (``tests/test_serve.py`` checks batched against one-at-a-time results).

A job's future is a ``concurrent.futures.Future``: the HTTP side awaits it (``asyncio.wrap_future``) and
cancels it on a timeout or a client gone away; a job cancelled before its batch starts is never decoded.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from dllm_align.config import components as registry
from dllm_align.core.console import info
from dllm_align.core.errors import UserError
from dllm_align.generate.in_process import InProcessGenerator
from dllm_align.generate.settings import RUN_KEYS, Completion, SamplerSettings, SamplerStats, model_fingerprint, row_seed

# The generate keys a request may set beside max_tokens / temperature / top_p / top_k / seed (the rest of the
# keys that decide a prompt's tokens; the keys that organise a run are the server's business).
REQUEST_KEYS = tuple(k for k in SamplerSettings.model_fields if k not in RUN_KEYS and k != "seed")


def request_keys() -> tuple[str, ...]:
    """:data:`REQUEST_KEYS` and the decoding rules' own settings (``generate.<rule>``, e.g. ``llada21``: an object
    of that rule's keys), which a request may set too; backends' settings are the client's business."""
    return REQUEST_KEYS + tuple(sorted(c.name for c in registry.section_components("generate") if c.kind != "backend"
                                       and c.has_settings()))
MAX_SEED = (1 << 63) - 1  # a torch.Generator seed; row seeds are 63 bits


class QueueFull(Exception):
    """The queue holds its maximum of jobs: the request is refused (HTTP 429), nothing is queued."""


class Stopped(Exception):
    """The server is shutting down: no job is accepted."""


@dataclass
class Job:
    prompt: list[int]
    settings: SamplerSettings
    seed: int
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)

    def group(self) -> tuple:
        return (json.dumps(self.settings.model_dump(mode="json"), sort_keys=True), len(self.prompt))


def default_seed(settings: SamplerSettings, prompt: Sequence[int]) -> int:
    """The seed of a request that names none: the server's ``generate.seed`` hashed with the prompt's ids, so a
    request's result stays a function of what it sent."""
    return row_seed(settings.seed, hashlib.sha256(json.dumps(list(prompt)).encode()).hexdigest()[:16])


class Engine:
    """The served model, its queue and its worker (see the module docstring).

    ``base``: the server's settings (the recipe's ``generate`` section), which a request overrides key by key;
    ``model``: the recipe's ``model`` section (a loaded folder replaces its ``name_or_path``)."""

    def __init__(self, generator: InProcessGenerator, base: SamplerSettings, model, *, device: str = "cpu",
                 name: Optional[str] = None, max_queue: int = 256, max_batch: int = 64, batch_window: float = 0.01) -> None:
        self.generator = generator
        self.model = model
        self.device = device
        self.base = generator.settings_for(base)
        self.name = name or str(generator.folder)
        self.max_batch = max_batch
        self.batch_window = batch_window
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._model_lock = threading.Lock()  # held while a batch decodes or a new model is swapped in
        self._load_lock = threading.Lock()   # one load at a time
        self._stop = threading.Event()
        self.stats = SamplerStats()
        self.batches: list[int] = []  # sizes of the batches decoded (for the benchmark and the tests)
        self._fingerprint = model_fingerprint(str(generator.folder)) if generator.folder is not None else None
        self._worker = threading.Thread(target=self._run, daemon=True, name="serve-worker")
        self._worker.start()

    @classmethod
    def from_section(cls, model, generate, *, device: str = "cpu", **kw) -> "Engine":
        """The recipe's model loaded on ``device`` with its ``generate`` section as the server's settings."""
        gen = InProcessGenerator.load(generate, None, model=model, device=device)
        return cls(gen, SamplerSettings.from_section(generate), model, device=device, **kw)

    # -- what is served
    @property
    def folder(self) -> Optional[str]:
        return None if self.generator.folder is None else str(self.generator.folder)

    @property
    def fingerprint(self) -> Optional[str]:
        return self._fingerprint

    @property
    def tokenizer(self) -> Any:
        return self.generator.tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self.generator.mp.model.get_output_embeddings().weight.shape[0])

    def serving(self) -> dict:
        """What this server serves: its model name, folder and weights fingerprint, family, default settings."""
        mp = self.generator.mp
        return {"model": self.name, "folder": self.folder, "fingerprint": self.fingerprint, "family": mp.family.name,
                "settings": self.base.model_dump(mode="json"), "max_positions": self.generator.max_positions,
                "vocab_size": self.vocab_size, "queue": {"size": self._queue.qsize(), "max": self._queue.maxsize},
                "max_batch": self.max_batch, "engine": "dllm_align"}

    # -- settings of one request
    def settings_for(self, overrides: dict) -> SamplerSettings:
        """The server's settings with a request's keys (``UserError`` naming the key when they cannot be decoded).
        A request that changes ``gen_length`` but not ``steps`` keeps the server's steps per block (the LLaDA
        and block rules; the other rules' steps are not per block)."""
        over = dict(overrides)
        if "gen_length" in over and "steps" not in over and self.base.sampler in ("llada", "block"):
            blk = over["block_length"] if "block_length" in over else self.base.block_length
            if isinstance(over["gen_length"], int) and isinstance(blk, int) and blk > 0 and over["gen_length"] % blk == 0:
                over["steps"] = self.base.steps_per_block * (over["gen_length"] // blk)
        settings = self.base.replace(**over) if over else self.base
        return self.generator.settings_for(settings)

    # -- the queue
    def submit(self, prompt: Sequence[int], settings: SamplerSettings, seed: int) -> concurrent.futures.Future:
        """Queue one prompt; its future resolves to a :class:`Completion`. Raises :class:`QueueFull` (nothing
        queued) or :class:`Stopped`."""
        if self._stop.is_set():
            raise Stopped()
        job = Job([int(t) for t in prompt], settings, int(seed))
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull() from None
        return job.future

    def pending(self) -> int:
        return self._queue.qsize()

    def _take(self) -> list[Job]:
        try:
            first = self._queue.get(timeout=0.2)
        except queue.Empty:
            return []
        jobs = [first]
        end = time.monotonic() + self.batch_window
        while len(jobs) < self.max_batch:
            left = end - time.monotonic()
            try:
                jobs.append(self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait())
            except queue.Empty:
                break
        return jobs

    def _run(self) -> None:
        while not self._stop.is_set():
            jobs = [j for j in self._take() if j.future.set_running_or_notify_cancel()]
            groups: dict[tuple, list[Job]] = {}
            for j in jobs:
                groups.setdefault(j.group(), []).append(j)
            for group in groups.values():
                self._decode(group)

    def _decode(self, group: list[Job]) -> None:
        with self._model_lock:
            try:
                out = self.generator.generate([j.prompt for j in group], group[0].settings, [j.seed for j in group],
                                              batch_size=self.max_batch, stats=self.stats)
            except Exception as e:  # a failed batch fails its requests (500 with the reason), not the server
                for j in group:
                    j.future.set_exception(e)
                return
            self.batches.append(len(group))
        for j, c in zip(group, out):
            j.future.set_result(c)

    def close(self) -> None:
        """Stop the worker; jobs still queued are failed with :class:`Stopped`."""
        self._stop.set()
        self._worker.join(timeout=30)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(Stopped())

    # -- a new model
    def load(self, folder: str) -> dict:
        """Load checkpoint ``folder`` and serve it from the next batch on (a batch in progress finishes on the old
        weights); its settings are checked against the new model before the old one is let go. Returns
        :meth:`serving`'s folder and fingerprint."""
        with self._load_lock:
            gen = InProcessGenerator.load(None, None, model=self.model, device=self.device, name_or_path=folder)
            base = gen.settings_for(self.base)
            fp = model_fingerprint(folder)
            with self._model_lock:
                self.generator, self.base, self._fingerprint = gen, base, fp
            info(f"serving {folder} (fingerprint {fp})")
        return {"folder": self.folder, "fingerprint": self.fingerprint}


def completion_record(c: Completion) -> dict:
    """The parts of a completion the server returns beside the text (the client backend rebuilds the completion
    from them): the token ids, the whole generated span, whether a stop token ended it, the forwards it took."""
    return {"token_ids": list(c.ids), "raw": list(c.raw), "stopped": bool(c.stopped), "forwards": int(c.forwards)}


__all__ = ["Engine", "Job", "MAX_SEED", "QueueFull", "REQUEST_KEYS", "request_keys", "Stopped", "completion_record", "default_seed"]
