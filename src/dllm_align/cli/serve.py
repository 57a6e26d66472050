"""``dllm-align serve``: an OpenAI-compatible server over the in-process samplers (docs/serving.md).

Thin: resolve the recipe (its ``model`` section is served, its ``generate`` section gives the settings a request
does not name) and hand it to :mod:`dllm_align.serve`. Only typer, the standard library, cli.app and the recipe
schema are imported at module level; torch, transformers, starlette and uvicorn inside the command body, so that
`dllm-align --help` loads none of them.
"""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

from dllm_align.cli.app import RecipeArg, SetOpt, command, given

API_KEY_ENV = "DLLM_ALIGN_SERVE_KEY"


@command("serve")
def serve(
    recipe: RecipeArg,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Checkpoint folder or hub id (overrides model.name_or_path).")] = None,
    set_: SetOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind; anything but loopback needs an API key.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port.")] = 8000,
    api_key_env: Annotated[str, typer.Option("--api-key-env", help="Environment variable holding the API key every /v1 route then requires ('' for none).")] = API_KEY_ENV,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="The model name requests use (default: model.name_or_path).")] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", min=1, help="Prompts waiting at most; more are refused with 429.")] = 256,
    max_batch: Annotated[int, typer.Option("--max-batch", min=1, help="Prompts decoded together at most.")] = 64,
    batch_window_ms: Annotated[float, typer.Option("--batch-window-ms", min=0, help="How long the worker waits for companions of a request.")] = 10.0,
    timeout: Annotated[float, typer.Option("--timeout", min=1, help="Seconds a request may wait for its result (then 504).")] = 600.0,
    max_body_mb: Annotated[float, typer.Option("--max-body-mb", min=0.001, help="Largest request body in MiB (then 413).")] = 4.0,
    max_connections: Annotated[int, typer.Option("--max-connections", min=1, help="Open connections at most (then 503).")] = 2048,
    no_load: Annotated[bool, typer.Option("--no-load", help="Refuse POST /v1/load (serve one model only).", metavar="")] = False,
    device: Annotated[Optional[str], typer.Option("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available).")] = None,
) -> None:
    """Serve a recipe's model over an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models).

    Requests arriving together are decoded in one batch; a request's result is a function of its prompt, its
    settings and its seed. POST /v1/load {"folder": DIR} serves another checkpoint; GET /v1/serving tells which
    folder and weights fingerprint are served.

    Example: dllm-align serve demo --port 8000

    Example: DLLM_ALIGN_SERVE_KEY=... dllm-align serve kto_mix_14k -m runs/kto/final --host 0.0.0.0
    """
    import torch

    from dllm_align.config.recipe import load_recipe
    from dllm_align.core.console import info
    from dllm_align.judge.client import read_api_key
    from dllm_align.models.load import check_device
    from dllm_align.serve.api import Server, check_bind, check_limits, serve_forever
    from dllm_align.serve.engine import Engine

    check_limits(timeout=timeout, batch_window_ms=batch_window_ms, max_body_mb=max_body_mb, served_model_name=served_model_name)
    rec = load_recipe(recipe, set_, None, flags=given({"model.name_or_path": ("--model", model)}))
    key = read_api_key(api_key_env) if api_key_env and os.environ.get(api_key_env) else None
    check_bind(host, key)
    dev = str(check_device(device)) if device else ("cuda" if torch.cuda.is_available() else "cpu")
    engine = Engine.from_section(rec.model, rec.generate, device=dev, name=served_model_name or rec.model.name_or_path,
                                 max_queue=max_queue, max_batch=max_batch, batch_window=batch_window_ms / 1000.0)
    server = Server(engine, api_key=key, max_body=int(max_body_mb * (1 << 20)), timeout=timeout, allow_load=not no_load)
    info(f"serving {engine.name} (folder {engine.folder}, fingerprint {engine.fingerprint}) at http://{host}:{port}/v1"
         + (" (API key required)" if key else ""))
    serve_forever(server, host, port, max_connections=max_connections)
