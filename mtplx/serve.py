"""``mtplx serve`` and ``mtplx generate``: argument definitions and implementations.

Kept apart from ``mtplx/cli.py`` so the CLI module only wires subcommands. Heavy imports
(MLX through the engine, FastAPI and uvicorn through the server) happen inside the command
functions: ``mtplx --help`` stays fast, and the engine package never imports the web stack
at module level.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from typing import Any

from mtplx.request import DRAFTER_NAMES, MAX_DEPTH

__all__ = [
    "add_generate_parser",
    "add_serve_parser",
    "describe_blas",
    "engine_factory",
    "generate",
    "resolve_model",
    "serve",
]


def _depth(value: str) -> int | None:
    """``--depth K`` (0..16) or ``--depth adaptive``."""
    if value.lower() in ("adaptive", "auto"):
        return None
    try:
        depth = int(value)
    except ValueError:
        message = f"depth must be an integer or 'adaptive', got {value!r}"
        raise argparse.ArgumentTypeError(message) from None
    if not 0 <= depth <= MAX_DEPTH:
        raise argparse.ArgumentTypeError(f"depth must be in [0, {MAX_DEPTH}], got {depth}")
    return depth


def add_serve_parser(commands: Any) -> argparse.ArgumentParser:
    """The ``serve`` subcommand. Options left out fall back to env, config file, defaults."""
    p = commands.add_parser("serve", help="start the OpenAI-compatible server")
    p.add_argument("model", nargs="?", help="checkpoint path or id (default: shipped model)")
    p.add_argument("--drafter", choices=DRAFTER_NAMES, help="default drafter")
    p.add_argument("--depth", type=_depth, help="draft tokens per cycle, or 'adaptive'")
    p.add_argument("--host", help="bind address (non-loopback requires an API key)")
    p.add_argument("--port", type=int)
    p.add_argument("--config", metavar="FILE", help="YAML settings (see configs/)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or MTPLX_API_KEY)")
    p.add_argument("--max-queue", type=int, help="waiting requests before 429")
    p.add_argument("--max-tokens-limit", type=int, help="largest max_tokens a request may ask")
    p.add_argument("--served-model-name", help="the model id clients send")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    return p


def add_generate_parser(commands: Any) -> argparse.ArgumentParser:
    """The ``generate`` subcommand: stream one prompt to the terminal."""
    p = commands.add_parser("generate", help="generate from one prompt, streamed to stdout")
    p.add_argument("model", nargs="?", help="checkpoint path or id (default: shipped model)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="no chat template: complete the prompt")
    p.add_argument("--system", help="system message (chat template only)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--drafter", choices=DRAFTER_NAMES, default="mtp")
    p.add_argument("--depth", type=_depth, default=None)
    p.add_argument("--quiet", action="store_true", help="no statistics on stderr")
    return p


def _default_model_function() -> Callable[[], Any]:
    try:
        from mtplx.models.gguf import ensure_default_model
    except ImportError as exc:
        raise SystemExit(
            "mtplx: no MODEL given and the shipped default model is unavailable "
            f"(mtplx.models.gguf.ensure_default_model: {exc}); pass a checkpoint path or id"
        ) from exc
    return ensure_default_model


def resolve_model(model: str | None) -> str:
    """The checkpoint to load: ``model``, or the shipped default (fetched/converted on first
    use by ``mtplx.models.gguf.ensure_default_model``)."""
    return model or str(_default_model_function()())


def engine_factory(model: str | None, drafter: str, depth: int | None) -> Callable[[], Any]:
    """A callable that loads the checkpoint and builds the engine. The scheduler runs it on
    its engine thread, so MLX arrays are created on the thread that uses them, and the
    server answers /health (503) while it runs."""
    if not model:
        _default_model_function()  # a missing default fails now, not after the server is up

    def build() -> Any:
        from mtplx.engine import Engine
        from mtplx.models import load

        return Engine(load(resolve_model(model)), default_drafter=drafter, default_depth=depth)

    return build


def describe_blas() -> Mapping[str, Any] | str:
    """What /health reports as BLAS: the MLX CPU BLAS shim's own description when present,
    else NumPy's BLAS as a hint."""
    try:
        from mtplx import blas  # type: ignore[attr-defined]

        return blas.describe()
    except (ImportError, AttributeError):
        pass
    try:
        import numpy as np

        config = np.show_config(mode="dicts")
        info = config.get("Build Dependencies", {}).get("blas", {})
        return {"numpy_blas": info.get("name", "unknown"), "version": info.get("version")}
    except Exception:  # an informational probe never fails /health
        return "unknown"


def serve(args: argparse.Namespace) -> int:
    """Run the HTTP server until interrupted."""
    from pydantic import ValidationError

    from server.settings import ConfigError, is_loopback, load_settings

    overrides = {
        "model": args.model,
        "drafter": args.drafter,
        "depth": args.depth,
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key,
        "max_queue": args.max_queue,
        "max_tokens_limit": args.max_tokens_limit,
        "served_model_name": args.served_model_name,
        "log_level": args.log_level,
    }
    try:
        settings = load_settings(args.config, overrides)
    except (ConfigError, ValidationError) as exc:
        print(f"mtplx serve: {exc}", file=sys.stderr)
        return 2
    if settings.api_key is None and not is_loopback(settings.host):
        print(
            f"mtplx serve: refusing to listen on {settings.host} without an API key; "
            "pass --api-key or set MTPLX_API_KEY (or bind to 127.0.0.1)",
            file=sys.stderr,
        )
        return 2

    import logging

    import uvicorn

    from mtplx.scheduler import Scheduler
    from server.app import create_app

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    scheduler = Scheduler(
        engine_factory(settings.model, settings.drafter, settings.depth),
        max_queue=settings.max_queue,
        request_timeout=settings.request_timeout,
    )
    app = create_app(scheduler, settings, blas_info=describe_blas)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)
    return 0


def _prompt_ids(tokenizer: Any, args: argparse.Namespace) -> list[int]:
    if args.raw:
        return list(tokenizer.encode(args.prompt))
    messages = [{"role": "user", "content": args.prompt}]
    if args.system:
        messages.insert(0, {"role": "system", "content": args.system})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def generate(args: argparse.Namespace) -> int:
    """Stream one generation to stdout; statistics to stderr."""
    from mtplx.request import FinishEvent, GenerationRequest, TokenEvent
    from mtplx.sampling import SamplerConfig

    engine = engine_factory(args.model, args.drafter, args.depth)()
    try:
        request = GenerationRequest(
            prompt_ids=_prompt_ids(engine.tokenizer, args),
            sampler=SamplerConfig(
                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
            ),
            max_tokens=args.max_tokens,
            drafter=args.drafter,
            depth=args.depth,
        )
        engine.validate(request)
    except ValueError as exc:
        print(f"mtplx generate: {exc}", file=sys.stderr)
        return 2
    events = engine.generate(request)
    try:
        for event in events:
            if isinstance(event, TokenEvent):
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif isinstance(event, FinishEvent) and not args.quiet:
                s = event.stats
                print(
                    f"\n[{event.finish_reason}] {s.completion_tokens} tokens, "
                    f"{s.num_cycles} cycles, acceptance {s.acceptance_rate:.0%}, "
                    f"mean acceptance length {s.mean_acceptance_length:.2f}",
                    file=sys.stderr,
                )
    except KeyboardInterrupt:
        return 130
    finally:
        events.close()
    sys.stdout.write("\n")
    return 0
