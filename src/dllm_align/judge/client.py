"""The judge's transport: the ``openai`` SDK over an ``httpx2`` client that we
configure and guard ourselves (docs/design.md#secrets).

What the SDK gives us: request building and typed replies for chat completions,
files and batches, its error classes, and whatever OpenAI-compatible servers
need next. What this module adds, because the project promises it and the SDK
does not:

* **Only --base-url is contacted.** The httpx2 client follows no redirects and
  reads no proxy or TLS settings from the environment (``trust_env=False``,
  unless ``--env-proxy``); :class:`GuardTransport` refuses any request for
  another scheme, host, port or path prefix, and sets the ``Authorization``
  header itself, so neither ``OPENAI_CUSTOM_HEADERS`` (its headers are
  removed), ``OPENAI_ORG_ID`` nor any other ambient setting of the SDK adds a
  credential or a header.
* **A key is never sent in clear** to a host that is not loopback
  (:func:`check_base_url`), unless ``--allow-plain-http``.
* **Bounded in time and memory.** Every response has a total deadline and a
  size cap: the headers are waited for until the deadline, and the body is
  checked on every chunk, so a server that trickles its headers or its body (or
  never ends it) is cut at the deadline, not kept alive by httpx's per-read
  timeout, and nothing is buffered past the cap.
* **Ctrl-C always stops.** Requests run on daemon threads; :meth:`ChatClient.abort`
  sets the stop flag (checked before sending and on every chunk) and shuts
  down the sockets of responses being read, and the process can exit without
  joining a thread blocked on a socket.
* **Retries we can count and interrupt.** The SDK's own retries are off
  (``max_retries=0``): its sleeps cannot be interrupted and its delays cannot be
  configured. :meth:`ChatClient.call` retries 408/409/425/429/5xx, timeouts and
  dropped connections with exponential backoff and jitter, or the server's
  ``Retry-After`` / ``retry-after-ms``. A server asking for a longer wait than
  ``retry_after_max`` is not asked again in this run (:class:`ServerAskedToWait`).
* **Errors name the URL actually requested** (from the request object), and
  every message is scrubbed of the key.

Size: about 700 lines, kept whole: the guarded transport, the SDK client built on it and the retry
loop share one request state (URL, key scrubbing, limits), and splitting them would export that state.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import queue
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any, Callable, Mapping, Optional, Sequence
import urllib.request
from urllib.parse import urlsplit

from dllm_align.core.console import warn
from dllm_align.core.errors import UserError

# lazy imports: httpx2, openai: absent on Python 3.10 (pyproject installs them from 3.11), where everything but an
# API judge works and `judge` with a model says what to install

# A judge's reply is a few kB; a batch output file can be hundreds of MB.
MAX_RESPONSE_BYTES = 8 << 20
MAX_DOWNLOAD_BYTES = 2 << 30


# =========================================================================== secrets
class Scrubber:
    """Removes a secret from text: the whole secret, and any 8-character piece of
    it (servers echo keys partly masked, e.g. ``sk-abc...xyz``)."""

    PIECE = 8

    def __init__(self, secret: Optional[str]):
        self.secret = secret or ""
        k = self.PIECE
        self._pieces = {self.secret[i : i + k] for i in range(len(self.secret) - k + 1)} if len(self.secret) >= k else set()

    def __call__(self, text: str) -> str:
        if not self.secret or not text:
            return text
        text = text.replace(self.secret, "***")
        if not self._pieces:
            return text
        k = self.PIECE
        hit = [False] * len(text)
        for i in range(len(text) - k + 1):
            if text[i : i + k] in self._pieces:
                for j in range(i, i + k):
                    hit[j] = True
        if not any(hit):
            return text
        out, i = [], 0
        while i < len(text):
            if hit[i]:
                while i < len(text) and hit[i]:
                    i += 1
                out.append("***")
            else:
                out.append(text[i])
                i += 1
        return "".join(out)


def read_api_key(env_name: str, environ: Mapping[str, str] | None = None) -> Optional[str]:
    """The API key from the variable ``env_name`` (``""``: no key, for local servers
    without authentication). Errors name the variable, never the value."""
    if not env_name:
        return None
    environ = os.environ if environ is None else environ
    key = (environ.get(env_name) or "").strip()
    if not key:
        raise UserError(
            f"the environment variable {env_name} holding the judge's API key is not set",
            hint=f"export {env_name}=...; or --api-key-env NAME for another variable, or --api-key-env '' for a server without authentication",
        )
    if any(c.isspace() or ord(c) < 32 or ord(c) > 126 for c in key):
        raise UserError(f"the API key in {env_name} contains spaces or non-printable characters")
    return key


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain") or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_base_url(base_url: str, *, has_key: bool, allow_plain_http: bool = False) -> str:
    """Validate ``--base-url`` and return it without a trailing slash.

    A key is never sent over plain ``http://`` to a host that is not loopback
    unless ``allow_plain_http`` (anyone on the path could read it)."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"--base-url {base_url!r}: expected http(s)://host[:port]/path")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise UserError("--base-url must not hold credentials, a query or a fragment; the key is read from --api-key-env")
    try:
        parts.port
    except ValueError:
        raise UserError(f"--base-url {base_url!r}: bad port")
    if parts.scheme == "http" and has_key and not is_loopback(parts.hostname) and not allow_plain_http:
        raise UserError(
            f"--base-url {base_url} is plain http:// to a host that is not loopback: the API key would travel unencrypted",
            hint="use https://, or --api-key-env '' if the server needs no key, or --allow-plain-http if the network is yours",
        )
    return base_url.rstrip("/")


# =========================================================================== errors and replies
class JudgementFailed(Exception):
    """This judgement could not be obtained; the run goes on."""


class FatalApiError(Exception):
    """Nothing will work (bad key, unknown model, wrong URL): stop the run."""

    def __init__(self, message: str, user_error: bool = True):
        super().__init__(message)
        self.user_error = user_error


class ServerAskedToWait(FatalApiError):
    """The server asked to be retried later than ``judge.retry_after_max`` allows: no request is sent to it
    again in this run (those in flight finish); the message says when it asked to be retried and how to resume."""

    def __init__(self, message: str, retry_at: float):
        super().__init__(message, user_error=False)
        self.retry_at = retry_at  # seconds since the epoch


class Cancelled(Exception):
    """The run is stopping (Ctrl-C or a fatal error elsewhere)."""


class TransportLimit(Exception):
    """A response broke the deadline or the size cap (raised inside the body stream)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class OffBaseUrl(Exception):
    """Something asked for a URL outside --base-url; refused before any byte was sent."""


@dataclass
class Reply:
    text: str
    usage: dict
    finish_reason: Optional[str] = None  # "length": cut off at the token cap


@dataclass
class ClientStats:
    retries: dict = field(default_factory=dict)
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    other_models: set = field(default_factory=set)  # (asked, answered) pairs already warned about

    def retry(self, reason: str) -> None:
        with self.lock:
            self.retries[reason] = self.retries.get(reason, 0) + 1

    def request(self) -> None:
        with self.lock:
            self.requests += 1


def _retry_after(headers: Mapping[str, str]) -> Optional[float]:
    """Seconds the server asks us to wait: ``retry-after-ms``, or ``Retry-After`` (seconds or an HTTP date)."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return max(0.0, float(ms) / 1000.0)
        except ValueError:
            pass
    ra = headers.get("retry-after")
    if not ra:
        return None
    try:
        return max(0.0, float(ra))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(ra)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _error_message(body: Any, text: str) -> str:
    """A short message from an error body (OpenAI style ``{"error": {"message": ...}}`` or text)."""
    obj = body
    if obj is None:
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
        if isinstance(err, str):
            return err[:300]
    return (text or "")[:300].strip()


def _error_code(body: Any) -> Optional[str]:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("code") or err.get("type") or "")
    return None


def _url_of(request: Any) -> str:
    """The URL a request actually went to, without its query."""
    try:
        u = request.url
        return f"{u.scheme}://{u.netloc.decode() if isinstance(u.netloc, bytes) else u.netloc}{u.path}"
    except Exception:
        return "?"


# =========================================================================== the guarded httpx2 transport
def _ambient_header_names() -> set[str]:
    """Header names the SDK adds from ``OPENAI_CUSTOM_HEADERS`` ("Name: value" lines)."""
    text = os.environ.get("OPENAI_CUSTOM_HEADERS") or ""
    return {line.partition(":")[0].strip().lower() for line in text.split("\n") if ":" in line}


def _make_transport(inner, *, scheme: str, host: str, port: int, path_prefix: str, auth: Optional[str],
                    deadline_s: float, stop: threading.Event, live_sockets: set, lock: threading.Lock):
    """httpx2's transport ``inner`` behind the guards of the module docstring: a request only to the base URL, with
    our credentials and no ambient ones, headers within the deadline, the body within the deadline and the size cap,
    every live socket known (so a stop can shut it), and nothing sent once ``stop`` is set."""
    import httpx2

    ambient = _ambient_header_names()
    GuardedStream = _guarded_stream_class(httpx2, stop, live_sockets, lock)

    class GuardTransport(httpx2.BaseTransport):
        def handle_request(self, request):
            u = request.url
            _refuse_off_base(request, scheme, host, port, path_prefix)
            _only_our_credentials(request, auth, ambient)
            if stop.is_set():
                raise Cancelled()
            # a batch file upload or a results download: larger, so longer (10x) and a larger cap
            big = u.path.endswith("/content") or (request.method == "POST" and u.path.endswith("/files"))
            started = time.monotonic()
            limit = deadline_s * (10 if big else 1)
            resp = _headers_within(inner, request, started + limit, limit, stop, lock)
            sock = _socket_of(resp)
            if sock is not None:
                with lock:
                    live_sockets.add(sock)
            if stop.is_set():
                resp.close()
                raise Cancelled()
            stream = GuardedStream(resp.stream, started + limit, limit, MAX_DOWNLOAD_BYTES if big else MAX_RESPONSE_BYTES, _url_of(request), sock)
            return httpx2.Response(resp.status_code, headers=resp.headers, stream=stream, extensions=resp.extensions)

        def close(self):
            inner.close()

    return GuardTransport()


def _refuse_off_base(request, scheme: str, host: str, port: int, path_prefix: str) -> None:
    """Refuse a request for anything but the base URL's scheme, host, port and path."""
    u = request.url
    if u.scheme != scheme or u.host != host or (u.port or (443 if u.scheme == "https" else 80)) != port \
            or not (u.path == path_prefix or u.path.startswith(path_prefix.rstrip("/") + "/")):
        raise OffBaseUrl(f"refused a request for {_url_of(request)}: outside --base-url")


def _only_our_credentials(request, auth: Optional[str], ambient) -> None:
    """Drop every credential header the SDK or the environment added, and set ours."""
    for name in [k for k in request.headers.keys() if k.lower() in ("authorization", "openai-organization", "openai-project") or k.lower() in ambient]:
        del request.headers[name]
    if auth:
        request.headers["Authorization"] = auth


def _socket_of(resp):
    """The response's socket (so a stop can shut it), or None where the transport does not say."""
    try:
        ns = resp.extensions.get("network_stream")
        return ns.get_extra_info("socket") if ns is not None else None
    except Exception:
        return None


def _headers_within(inner, request, deadline: float, limit: float, stop: threading.Event, lock: threading.Lock):
    """``inner.handle_request`` (which returns once the headers are in) on a
    helper thread, waited for until the deadline: httpx's read timeout is per
    read, so a server trickling its headers a byte at a time would otherwise
    hold the request for as long as it likes. A request given up on is closed
    when its headers do arrive (h11 caps them at 16 KiB meanwhile)."""
    box: dict = {}
    done = threading.Event()

    def go():
        try:
            box["resp"] = inner.handle_request(request)
        except BaseException as e:  # handed back below
            box["err"] = e
        with lock:
            done.set()
            late = box.get("abandoned")
        if late and "resp" in box:
            box["resp"].close()

    threading.Thread(target=go, daemon=True, name="judge-headers").start()
    while not done.wait(0.1):
        if stop.is_set() or time.monotonic() > deadline:
            with lock:
                if not done.is_set():
                    box["abandoned"] = True
            if box.get("abandoned"):
                if stop.is_set():
                    raise Cancelled()
                raise TransportLimit(f"no response from {_url_of(request)} within {limit:g} s", "timeout")
    if "err" in box:
        raise box["err"]
    return box["resp"]


def _guarded_stream_class(httpx2, stop: threading.Event, live_sockets: set, lock: threading.Lock) -> type:
    """A response body that stops at ``stop``, past its deadline or past its size cap, and forgets its socket when
    read or closed (a subclass of httpx2's stream, which is imported only where it is used)."""

    class GuardedStream(httpx2.SyncByteStream):
        def __init__(self, stream, deadline: float, limit: float, cap: int, url: str, sock):
            self._stream, self._deadline, self._limit, self._cap, self._url, self._sock = stream, deadline, limit, cap, url, sock

        def __iter__(self):
            n = 0
            try:
                for chunk in self._stream:
                    if stop.is_set():
                        raise Cancelled()
                    n += len(chunk)
                    if n > self._cap:
                        raise TransportLimit(f"response from {self._url} larger than {self._cap >> 20} MiB; not read further", "too-large")
                    if time.monotonic() > self._deadline:
                        raise TransportLimit(f"response from {self._url} not complete within {self._limit:g} s", "timeout")
                    yield chunk
            finally:
                self._forget()

        def _forget(self):
            if self._sock is not None:
                with lock:
                    live_sockets.discard(self._sock)
                self._sock = None

        def close(self):
            self._forget()
            self._stream.close()

    return GuardedStream


# =========================================================================== the client
class ChatClient:
    """The openai SDK bound to one base URL, with the guarantees of the module docstring.

    ``call(fn)`` runs ``fn(sdk)`` (one SDK call) with retries; :meth:`complete`
    is one chat completion of a single user message.
    """

    def __init__(
        self,
        base_url: str,
        api_key: Optional[str],
        *,
        api_key_env: str = "OPENAI_API_KEY",
        timeout: float = 60.0,
        max_retries: int = 6,
        retry_base_delay: float = 1.0,
        retry_max_delay: float = 60.0,
        retry_after_max: float = 60.0,
        concurrency: int = 8,
        allow_plain_http: bool = False,
        env_proxy: bool = False,
        stop: Optional[threading.Event] = None,
        stats: Optional[ClientStats] = None,
    ):
        self.base_url = check_base_url(base_url, has_key=bool(api_key), allow_plain_http=allow_plain_http)
        try:
            import httpx2
            import openai
        except ImportError:
            raise UserError("judging with a model at --base-url needs the openai SDK 3.x (Python 3.11+)",
                            hint="pip install 'openai>=3.20,<4'; rule:NAME judges need nothing")
        self._openai = openai
        parts = urlsplit(self.base_url)
        self.api_key_env = api_key_env
        self.scrub = Scrubber(api_key)
        self.timeout = timeout
        self.max_retries = max_retries
        self.retry_base_delay = retry_base_delay
        self.retry_max_delay = retry_max_delay
        self.retry_after_max = retry_after_max
        self.stop = stop or threading.Event()
        # Set when a server asked for a wait past retry_after_max: no new request or retry starts; unlike
        # `stop`, the responses being read are not cut, so what is in flight finishes and is kept.
        self.held: Optional[ServerAskedToWait] = None
        self.stats = stats or ClientStats()
        self._rng = random.Random()
        self._sockets: set = set()
        self._lock = threading.Lock()
        proxy = None
        if env_proxy:  # only when asked: the proxy the environment names for this scheme, unless NO_PROXY covers the host

            if not urllib.request.proxy_bypass(parts.hostname):
                proxy = urllib.request.getproxies().get(parts.scheme)
        limits = httpx2.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
        # TCP_NODELAY: httpcore writes a request's headers and body separately, and
        # Nagle's algorithm then holds the body until the server's delayed ACK (~40 ms a request).
        inner = httpx2.HTTPTransport(trust_env=env_proxy, limits=limits, proxy=proxy,
                                     socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        transport = _make_transport(
            inner, scheme=parts.scheme, host=parts.hostname, port=parts.port or (443 if parts.scheme == "https" else 80),
            path_prefix=parts.path or "/", auth=f"Bearer {api_key}" if api_key else None, deadline_s=timeout,
            stop=self.stop, live_sockets=self._sockets, lock=self._lock,
        )
        self._http = httpx2.Client(transport=transport, trust_env=False, follow_redirects=False,
                                   timeout=httpx2.Timeout(timeout, connect=min(timeout, 30.0)))
        # Every value the SDK would otherwise read from the environment is given explicitly.
        self.sdk = openai.OpenAI(
            api_key=api_key or "unused", admin_api_key="", organization="", project="", webhook_secret="",
            base_url=self.base_url + "/", timeout=timeout, max_retries=0, http_client=self._http,
            default_headers={"Authorization": f"Bearer {api_key}" if api_key else ""},
        )

        self._warm_up(httpx2, openai)

    @staticmethod
    def _warm_up(httpx2, openai) -> None:
        """One chat completion against an in-memory transport. The SDK's first call
        spends ~0.2-0.5 s of CPU on one-time setup while holding the GIL; done here,
        before the workers start, it does not eat into the first requests' deadlines."""
        body = {"id": "w", "object": "chat.completion", "created": 0, "model": "w",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "w"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        mock = httpx2.Client(transport=httpx2.MockTransport(lambda request: httpx2.Response(200, json=body)), trust_env=False)
        try:
            openai.OpenAI(api_key="w", admin_api_key="", organization="", project="", webhook_secret="",
                          base_url="http://127.0.0.1:9/v1/", max_retries=0, http_client=mock).chat.completions.create(
                model="w", messages=[{"role": "user", "content": "w"}], max_tokens=1, temperature=0)
        except Exception:
            pass  # only a warm-up
        finally:
            mock.close()

    # -- stopping
    def abort(self) -> None:
        """Stop every worker now: no new requests, and responses being read are cut
        (shutting a socket down wakes a thread blocked reading it; close alone does not)."""
        self.stop.set()
        with self._lock:
            socks = list(self._sockets)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        try:
            self._http.close()
        except Exception:
            pass

    # -- retries
    def _backoff(self, attempt: int) -> float:
        cap = min(self.retry_max_delay, self.retry_base_delay * (2 ** attempt))
        return cap * (0.5 + 0.5 * self._rng.random())

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self.stop.wait(min(left, 0.2)):
                raise Cancelled()
            if self.held is not None:  # another request was told to wait for hours: this retry is not sent
                raise self.held

    def _hold(self, wait_s: float, asked: str, status: int) -> ServerAskedToWait:
        """Record (once) that the server asked to be retried in ``wait_s`` seconds, past retry_after_max."""
        with self._lock:
            if self.held is None:
                at = time.time() + wait_s
                when = dt.datetime.fromtimestamp(at, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
                self.held = ServerAskedToWait(self.scrub(
                    f"{self.base_url} asked to be retried after {when} (HTTP {status}, {asked}: a wait of {wait_s:,.0f} s, "
                    f"more than judge.retry_after_max {self.retry_after_max:g} s): nothing more was requested from it; run "
                    "the same command again after that time (verdicts already obtained are kept and not asked again)"), at)
            return self.held

    def call(self, fn: Callable[[Any], Any], what: str, *, retry: bool = True) -> Any:
        """``fn(sdk)`` with retries; raises :class:`JudgementFailed` (this call
        cannot succeed), :class:`FatalApiError` (nothing can) or :class:`Cancelled`."""
        oa = self._openai
        last = "no attempt"
        tries = self.max_retries + 1 if retry else 1
        for attempt in range(tries):
            if self.stop.is_set():
                raise Cancelled()
            if self.held is not None:
                raise self.held
            wait_s: Optional[float] = None
            self.stats.request()
            try:
                return fn(self.sdk)
            except Cancelled:
                raise
            except OffBaseUrl as e:
                self.stop.set()
                raise FatalApiError(self.scrub(str(e)))
            except TransportLimit as e:
                if e.reason == "too-large":
                    raise JudgementFailed(self.scrub(str(e)))
                last, reason = self.scrub(str(e)), "timeout"
            except oa.APITimeoutError as e:
                last, reason = f"no answer from {_url_of(e.request)} within {self.timeout:g} s", "timeout"
            except oa.APIStatusError as e:
                status, headers = e.status_code, e.response.headers
                url = self.scrub(_url_of(e.request))
                try:
                    text = e.response.text
                except Exception:
                    text = ""
                msg = self.scrub(_error_message(e.body, text))
                code = _error_code(e.body)
                if 300 <= status < 400 or status in (401, 403, 404) or (status == 429 and code == "insufficient_quota"):
                    self.stop.set()  # no other worker starts a request that cannot succeed
                if 300 <= status < 400:
                    where = self.scrub(headers.get("location", "?"))
                    raise FatalApiError(f"HTTP {status} from {url}: redirect to {where} not followed (the key is sent only to --base-url); set --base-url to the final address")
                if status == 401:
                    raise FatalApiError(f"HTTP 401 from {url}: the API key in {self.api_key_env} was rejected ({msg})")
                if status == 403:
                    raise FatalApiError(f"HTTP 403 from {url}: the API key in {self.api_key_env} may not use this model or endpoint ({msg})")
                if status == 404:
                    raise FatalApiError(f"HTTP 404 from {url} ({what}): {msg}")
                if status == 429 and code == "insufficient_quota":
                    raise FatalApiError(f"HTTP 429 from {url}: quota exhausted ({msg})", user_error=False)
                if status in (408, 409, 425, 429) or status >= 500:
                    last, reason = f"HTTP {status} ({msg})" if msg else f"HTTP {status}", f"http-{status}"
                    wait_s = _retry_after(headers)
                    if wait_s is not None and wait_s > self.retry_after_max:
                        # A server may ask for an hour (Retry-After: 3600, or an HTTP date a year ahead):
                        # waiting, or retrying sooner, is against its word; stop asking it in this run.
                        ms = headers.get("retry-after-ms")
                        asked = f"retry-after-ms: {ms}" if ms else f"Retry-After: {headers.get('retry-after')}"
                        raise self._hold(wait_s, self.scrub(asked[:80]), status)
                else:  # 400, 413, 422, ...: this request will not succeed by repeating it
                    hint = ""
                    if status == 400 and any(p in msg for p in ("max_tokens", "temperature")):
                        hint = " (a reasoning model? try --max-completion-tokens N --no-temperature)"
                    raise JudgementFailed(f"HTTP {status}: {msg}{hint}")
            except oa.APIConnectionError as e:
                cause = e.__cause__
                if isinstance(cause, Exception) and "CERTIFICATE_VERIFY_FAILED" in str(cause):
                    raise FatalApiError(self.scrub(f"TLS certificate check failed for {_url_of(e.request)}: {cause}"))
                if self.stop.is_set():
                    raise Cancelled()
                detail = f"{type(cause).__name__}: {cause}" if cause is not None and str(cause) else type(cause or e).__name__
                last, reason = self.scrub(f"connection error at {_url_of(e.request)} ({detail})"), "connection"
            except oa.APIResponseValidationError:
                last, reason = f"a reply from {self.base_url} that is not what {what} returns", "bad-body"
            except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
                last, reason = self.scrub(f"a reply that is not what {what} returns ({type(e).__name__})"), "bad-body"
            if attempt == tries - 1:
                break
            self.stats.retry(reason)
            delay = self._backoff(attempt) if wait_s is None else wait_s + 0.1 * self.retry_base_delay * self._rng.random()
            self._sleep(delay)
        raise JudgementFailed(f"gave up after {tries} attempt(s); last: {last}")

    def _check_model(self, asked: str, answered: Any) -> None:
        """Say (once per pair) when a server answers as another model than the one asked for; a dated
        snapshot of the same name (gpt-4o-mini -> gpt-4o-mini-2024-07-18) is the same model."""
        if not isinstance(answered, str) or not answered or answered.startswith(asked) or asked.startswith(answered):
            return
        with self.stats.lock:
            if (asked, answered) in self.stats.other_models:
                return
            self.stats.other_models.add((asked, answered))

        warn(self.scrub(f"asked {self.base_url} for model {asked!r}, but it answered as {answered!r}: "
                        "the verdicts are that model's (check the server's model routing)"))

    def complete(self, model: str, content: str, params: Mapping[str, Any], history: Sequence[Mapping[str, str]] = ()) -> Reply:
        """One chat completion of a user message (``params``: temperature, max_tokens or
        max_completion_tokens), with retries; ``history`` continues the conversation after it
        (the judge's earlier reply and a follow-up question)."""

        def one(sdk):
            messages = [{"role": "user", "content": content}, *[dict(m) for m in history]]
            r = sdk.chat.completions.create(model=model, messages=messages, **params)
            choice = r.choices[0]
            msg = choice.message  # raises on a body that is not a chat completion: retried as bad-body
            text = msg.content if isinstance(msg.content, str) else ""
            usage = r.usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"}) if r.usage else {}
            finish = getattr(choice, "finish_reason", None)
            self._check_model(model, getattr(r, "model", None))
            return Reply(self.scrub(text), {k: v for k, v in usage.items() if isinstance(v, int)},
                         finish if isinstance(finish, str) else None)

        return self.call(one, f"chat completions for model {model!r}")


# =========================================================================== live judgements on daemon threads
def run_pool(items: list, work: Callable[[Any], Any], concurrency: int, stop: threading.Event):
    """Yield ``(item, result_or_exception)`` as each ``work(item)`` finishes, from
    ``concurrency`` daemon threads. Daemon threads, not a ThreadPoolExecutor:
    the interpreter joins an executor's threads at exit, so one thread blocked
    on a dead socket would keep Ctrl-C from ending the process."""
    todo: queue.Queue = queue.Queue()
    done: queue.Queue = queue.Queue()
    for it in items:
        todo.put(it)

    def worker():
        while not stop.is_set():
            try:
                it = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((it, work(it)))
            except BaseException as e:  # handed to the main thread, which decides
                done.put((it, e))

    threads = [threading.Thread(target=worker, daemon=True, name=f"judge-{i}") for i in range(min(concurrency, len(items)))]
    for t in threads:
        t.start()
    left = len(items)
    while left:
        try:
            item = done.get(timeout=0.2)
        except queue.Empty:
            if stop.is_set() and not any(t.is_alive() for t in threads):
                return
            continue
        left -= 1
        yield item
