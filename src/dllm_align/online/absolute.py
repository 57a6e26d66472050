"""An LLM judge in absolute mode as a verifier (``--rule judge:MODEL``, the component ``judge``:
:func:`judge_rule`): is this answer good, yes or no?

The request goes through the judge's own client (:class:`dllm_align.judge.client.ChatClient`: only the
recipe's ``judge.base_url`` is contacted, the key comes from ``judge.api_key_env`` and never reaches a
file or a log, retries and deadlines as for ``judge``). The prompt (:data:`TEMPLATE`) asks for a final
``[[YES]]`` or ``[[NO]]``; a reply with neither is asked once more for the verdict alone, and then
counted as unjudgeable: that sample is left out of the rows and counted in the summary. Every verdict is
cached in ``DIR/label_cache.jsonl`` (keyed by model, prompt, answer and settings), so a rerun after a
kill asks nothing twice. Requests are sent one at a time, or with ``judge.batch`` through the Batch API
(:meth:`AbsoluteJudge.batch`), as ``judge --batch`` does.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from pathlib import Path
from typing import Optional

from dllm_align.config.schema import JudgeSection
from dllm_align.core.errors import UserError
from dllm_align.core.io import JsonlAppender, recover_jsonl
from dllm_align.judge.batch import BatchRunner
from dllm_align.judge.cache import CacheWriter, Task
from dllm_align.judge.client import ChatClient, check_base_url, read_api_key
from dllm_align.judge.run import request_params
from dllm_align.online.verifiers import Rule

TEMPLATE = (
    "You are judging one answer to a user's request. Decide whether the answer is good: correct, helpful "
    "and responsive to the request. Explain briefly, then end with your verdict on its own line: [[YES]] if "
    "the answer is good, [[NO]] if it is not.\n\n[Request]\n{prompt}\n\n[Answer]\n{completion}\n"
)
FOLLOW_UP = "Your reply gives no final verdict. Answer with exactly [[YES]] or [[NO]] and nothing else."
_VERDICT = re.compile(r"\[\[(YES|NO)\]\]", re.I)
CACHE = "label_cache.jsonl"


def parse_yes_no(text: str) -> Optional[bool]:
    """The last ``[[YES]]`` / ``[[NO]]`` of a reply (True / False), or None."""
    found = _VERDICT.findall(text or "")
    return None if not found else found[-1].upper() == "YES"


def _yes_no(text: str) -> Optional[str]:
    v = parse_yes_no(text)
    return None if v is None else ("YES" if v else "NO")


class AbsoluteJudge:
    """A verifier ``(prompt, completion, row) -> True | False | None`` (None: unjudgeable)."""

    def __init__(self, model: str, section, out_dir: Path):
        s = section.model_dump()
        key = read_api_key(s["api_key_env"])
        self.client = ChatClient(s["base_url"], key, api_key_env=s["api_key_env"] or "(none)", timeout=s["timeout"],
                                 max_retries=s["max_retries"], retry_base_delay=s["retry_base_delay"],
                                 retry_max_delay=s["retry_max_delay"], retry_after_max=s["retry_after_max"], concurrency=1,
                                 allow_plain_http=s["allow_plain_http"], env_proxy=s["env_proxy"])
        self.model, self.params, self.settings, self.out = model, request_params(s), s, Path(out_dir)
        self.path = Path(out_dir) / CACHE
        self.cache = {r["key"]: r for r in recover_jsonl(self.path) if r.get("verdict") in ("YES", "NO") and "key" in r}
        self._appender = None
        self.unjudgeable = 0
        self.requests = 0

    def _key(self, prompt: str, completion: str) -> str:
        fields = {"model": self.model, "template": TEMPLATE, "prompt": prompt, "completion": completion, "params": self.params}
        return hashlib.sha256(json.dumps(fields, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()

    def __call__(self, prompt: str, completion: str, row: dict) -> Optional[bool]:
        key = self._key(prompt, completion)
        if key in self.cache:
            return self.cache[key]["verdict"] == "YES"
        content = TEMPLATE.replace("{prompt}", prompt).replace("{completion}", completion)
        history: tuple = ()
        for _ in range(2):  # the request, then once more for the verdict alone
            reply = self.client.complete(self.model, content, self.params, history)
            self.requests += 1
            v = parse_yes_no(reply.text)
            if v is not None:
                entry = {"key": key, "verdict": "YES" if v else "NO", "reply": reply.text, "model": self.model}
                if self._appender is None:
                    self._appender = JsonlAppender(self.path)
                self._appender.write(entry)
                self.cache[key] = entry
                return v
            history = ({"role": "assistant", "content": reply.text}, {"role": "user", "content": FOLLOW_UP})
        self.unjudgeable += 1
        return None

    def batch(self, pairs: list[tuple[str, str]]) -> list[Optional[bool]]:
        """The verdicts of ``(prompt, completion)`` pairs, the uncached ones asked through the Batch API (as
        ``judge --batch``: resumable at every stage from ``DIR/batch_state.json``). What a batch left without
        a verdict is then asked live, with the re-ask for the verdict alone."""
        tasks: dict[str, Task] = {}
        for prompt, completion in pairs:
            key = self._key(prompt, completion)
            if key not in self.cache and key not in tasks:
                content = TEMPLATE.replace("{prompt}", prompt).replace("{completion}", completion)
                tasks[key] = Task(key, self.model, "absolute", key[:16], content)
        if tasks:
            s = self.settings
            with CacheWriter(self.path, self.cache) as writer:
                runner = BatchRunner(self.client, self.out, self.params, writer, _yes_no, poll_interval=s["batch_poll_interval"],
                                     poll_max=s["batch_poll_max"], stop=threading.Event())
                runner.run(tasks, s["batch_rounds"] if s["batch_failed"] == "batch" else 1)
        return [self(prompt, completion, {}) for prompt, completion in pairs]

    def close(self) -> None:
        if self._appender is not None:
            self._appender.close()
            self._appender = None
        self.client.close()


def check_judge(rule: str, section) -> None:
    """``--rule judge:MODEL``: the model named, the key set and ``judge.base_url`` a URL, before any work."""
    if not rule[len("judge:"):].strip():
        raise UserError("--rule judge:MODEL: name the judge model, e.g. judge:gpt-4o-mini")
    key = read_api_key(section.api_key_env)
    try:
        check_base_url(section.base_url, has_key=key is not None, allow_plain_http=section.allow_plain_http)
    except UserError as e:  # the client names its own flag; label reads the recipe's key
        raise UserError(e.message.replace("--base-url", "judge.base_url"), hint=e.hint) from None


def judge_rule(sel):
    """The verifier ``judge:MODEL`` (``sel``: an ``online.verifiers.Selection``): the recipe's judge section
    checked now (key and URL), the judge itself made once the run folder is taken (its verdicts are cached
    there), on the rank that labels."""
    section = sel.recipe.judge if sel.recipe is not None else JudgeSection()
    check_judge(sel.spec, section)
    return Rule(sel.spec, lambda p, c, r: True, bind=lambda out: AbsoluteJudge(sel.argument, section, out))
