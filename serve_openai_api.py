"""Serve a PocketLM checkpoint over an OpenAI-compatible HTTP API, with continuous batching.

    python serve_openai_api.py --checkpoint out/<run> [--port 8998] [--api_key KEY] [--max_batch_size 8]

SFT checkpoints answer POST /v1/chat/completions (the checkpoint's chat template, stopping at <|im_end|>);
pretrain checkpoints answer POST /v1/completions (raw text, stopping at <|endoftext|>). GET /v1/models lists the
model, GET /health reports the engine's load, and GET / is a chat page (serving/static/) for SFT checkpoints.
Listens on 127.0.0.1 unless --host says otherwise.

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8998/v1", api_key="unused")
    client.chat.completions.create(model="<run>", messages=[{"role": "user", "content": "Hi"}])
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import sys

from common.config import parse_config
from common.device import dtype_name
from common.errors import PocketLMError
from model.inference import describe_rope_scaling, resolve_device
from serving.config import ServeConfig, is_loopback


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (bound here so that a busy port is an `error:` line, and port 0 gets its number)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def main(argv: list[str] | None = None) -> int:
    try:
        config = parse_config(ServeConfig, argv, __doc__)
        server = config.server
        api_key = server.api_key or os.environ.get("POCKETLM_API_KEY") or None
        device = resolve_device(config.device.device)
        sock = listen(server.host, server.port)  # before the (slow) model load: a busy port fails fast
        # FastAPI and the model stack load only when needed
        from serving.api import create_app
        from serving.service import load_service
        service = load_service(config, device)
    except (PocketLMError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    import uvicorn

    logging.basicConfig(level=server.log_level.upper(), format="%(levelname)s: %(message)s")
    host, port = sock.getsockname()[:2]
    if not is_loopback(server.host) and api_key is None:
        print(f"warning: listening on {server.host} without --api_key: anyone who can reach this port can use "
              "the model", file=sys.stderr)
    cfg, engine = service.engine.model.config, service.engine
    endpoint = "/v1/chat/completions" if service.prompt_format == "chat" else "/v1/completions"
    print(f"serving {service.name} ({service.model_dir}, prompt format {service.prompt_format}, "
          f"{engine.model.num_parameters() / 1e6:.2f}M params, {engine.device}, "
          f"{dtype_name(engine.dtype)}, context {service.context}/{cfg.max_position_embeddings}"
          f"{describe_rope_scaling(cfg)}, "
          f"max_batch_size {engine.max_batch_size}) on http://{host}:{port}{endpoint}"
          + (f"; chat page: http://{host}:{port}/" if service.prompt_format == "chat" else ""), file=sys.stderr,
          flush=True)
    app = create_app(service, api_key=api_key, max_body_bytes=server.max_body_bytes)
    try:
        # uvicorn shuts down gracefully on SIGINT / SIGTERM (the engine fails what is still in flight), then
        # re-raises the signal: Ctrl-C ends here as 130, SIGTERM as the signal's own status
        uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=server.log_level)).run(sockets=[sock])
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    # Ctrl-C means stop, 130, however the server was started. A shell starts a script's background jobs with
    # SIGINT ignored and Python keeps it ignored; uvicorn answers SIGINT all the same (its handler replaces the
    # ignore) but re-raises it into the ignored disposition at the end, so such a server shut down and exited 0,
    # and a SIGINT during the model load was lost. Here, not in main(): tests call main() in their own process
    # (the module's imports above still run under the inherited disposition).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
