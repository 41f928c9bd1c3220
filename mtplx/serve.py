"""``mtplx serve`` and ``mtplx generate``: argument definitions and implementations.

Kept apart from ``mtplx/cli.py`` so the CLI module only wires subcommands. Heavy imports
(MLX through the engine, FastAPI and uvicorn through the server) happen inside the command
functions: ``mtplx --help`` stays fast, and the engine package never imports the web stack
at module level.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from mtplx.request import DRAFTER_NAMES, MAX_DEPTH

__all__ = [
    "Interrupted",
    "add_generate_parser",
    "add_serve_parser",
    "check_drafter_options",
    "describe_blas",
    "engine_factory",
    "generate",
    "resolve_model",
    "run_server",
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


def _positive(value: str) -> int:
    """A positive integer argument."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {number}")
    return number


def add_serve_parser(commands: Any) -> argparse.ArgumentParser:
    """The ``serve`` subcommand. Options left out fall back to env, config file, defaults."""
    p = commands.add_parser("serve", help="start the OpenAI-compatible server")
    p.add_argument("model", nargs="?", help="checkpoint path or id (default: shipped model)")
    p.add_argument(
        "--drafter",
        choices=("auto", *DRAFTER_NAMES),
        help="default drafter (auto: mtp+ngram when the model has MTP heads, else "
        "draft_model+ngram when --draft-layers is given, else ngram; X+ngram drafts by n-gram "
        "lookup when the history has a match, else with X)",
    )
    p.add_argument("--depth", type=_depth, help="draft tokens per cycle, or 'adaptive'")
    p.add_argument(
        "--draft-layers",
        type=_positive,
        metavar="N",
        help="self-draft with the first N target layers (enables drafter draft_model)",
    )
    p.add_argument("--host", help="bind address (non-loopback requires an API key)")
    p.add_argument("--port", type=int)
    p.add_argument("--config", metavar="FILE", help="YAML settings (see configs/)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (or MTPLX_API_KEY)")
    p.add_argument(
        "--allowed-hosts",
        metavar="H1,H2",
        help="Host header names accepted besides localhost/127.0.0.1/[::1] ('*' = any)",
    )
    p.add_argument(
        "--allowed-origins",
        metavar="O1,O2",
        help="browser origins allowed by CORS, e.g. http://localhost:3000 ('*' = any)",
    )
    p.add_argument("--max-num-seqs", type=int, help="sequences decoded together (batch rows)")
    p.add_argument("--prefill-chunk-size", type=int, help="prompt tokens per prefill forward")
    p.add_argument(
        "--prefix-cache-bytes",
        help="memory for cached prompt-prefix states (bytes or 512M, 2G; 0: off)",
    )
    p.add_argument(
        "--max-kv-bytes",
        help="KV memory of running sequences past which no new one is admitted (bytes or "
        "512M, 4G; none: no bound)",
    )
    p.add_argument("--max-queue", type=int, help="waiting requests before 429")
    p.add_argument(
        "--shutdown-timeout", type=float, help="seconds in-flight requests may finish on SIGTERM"
    )
    p.add_argument("--max-tokens-limit", type=int, help="largest max_tokens a request may ask")
    p.add_argument("--served-model-name", help="the model id clients send")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    p.add_argument(
        "--reasoning-parser",
        choices=("auto", "none", "qwen3", "deepseek_r1"),
        help="split <think>...</think> from the answer (auto: when the chat template "
        "writes </think>; none: leave it in the text)",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="split the model's layers over the ranks of mlx.launch (rank 0 serves HTTP)",
    )
    p.add_argument(
        "--pipeline-timeout",
        type=float,
        default=20.0,
        metavar="SECONDS",
        help="with --distributed: a rank silent this long is lost (503s, exit 1)",
    )
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
    p.add_argument("--drafter", choices=("auto", *DRAFTER_NAMES), default="auto")
    p.add_argument("--depth", type=_depth, default=None)
    p.add_argument("--draft-layers", type=_positive, metavar="N")
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


def check_drafter_options(drafter: str, draft_layers: int | None) -> str | None:
    """What is wrong with the drafter options before any model is loaded, or None."""
    if drafter == "draft_model" and draft_layers is None:
        return (
            "--drafter draft_model needs a draft model: pass --draft-layers N to draft with "
            "the first N layers of the target"
        )
    return None


def _check_drafter_available(
    drafter: str, model: str, has_mtp: bool, has_draft_model: bool
) -> None:
    """Raise a ValueError that says what to pass instead when ``drafter`` cannot run."""
    available = ["none", "ngram"]
    available += ["mtp", "mtp+ngram"] * has_mtp
    available += ["draft_model", "draft_model+ngram"] * has_draft_model
    if drafter in available:
        return
    reason = {
        "mtp": "the checkpoint has no MTP heads",
        "draft_model": "no draft model was given (--draft-layers N)",
    }[drafter.removesuffix("+ngram")]
    raise ValueError(
        f"--drafter {drafter} is not available for {model}: {reason}; available drafters: "
        f"{', '.join(available)} (pass --drafter, or --draft-layers N for draft_model)"
    )


def engine_factory(
    model: str | None,
    drafter: str,
    depth: int | None,
    draft_layers: int | None = None,
    max_num_seqs: int = 16,
    prefill_chunk_size: int = 32,
    prefix_cache_bytes: int = 0,
    pipeline: Any = None,
    max_kv_bytes: int | None = None,
) -> Callable[[], Any]:
    """A callable that loads the checkpoint and builds the engine. The scheduler runs it on
    its engine thread, so MLX arrays are created on the thread that uses them, and the
    server answers /health (503) while it runs.

    ``draft_layers`` N adds a layer-skip self-draft (the target's first N layers) as the
    ``draft_model`` drafter. A ``drafter`` the loaded model cannot use is a ValueError that
    names the available ones. ``pipeline`` (a ``mtplx.distributed.Pipeline``, rank 0): load
    rank 0's stage only and run the others' over the pipeline."""
    if not model:
        _default_model_function()  # a missing default fails now, not after the server is up

    def build() -> Any:
        from mtplx.engine import Engine
        from mtplx.models import load, make_layer_skip_draft

        path = resolve_model(model)
        loaded = load(path) if pipeline is None else load(path, stage=pipeline.stage)
        batched = None if pipeline is None else pipeline.target(loaded.target, max_num_seqs)
        draft = make_layer_skip_draft(loaded, draft_layers) if draft_layers else None
        if drafter != "auto":
            _check_drafter_available(drafter, path, bool(loaded.mtp_heads), draft is not None)
        engine = Engine(
            loaded,
            default_drafter=None if drafter == "auto" else drafter,
            default_depth=depth,
            draft_model=draft,
            max_num_seqs=max_num_seqs,
            prefill_chunk_size=prefill_chunk_size,
            prefill_budget=256,
            prefix_cache_bytes=prefix_cache_bytes,
            max_kv_bytes=max_kv_bytes,
            batched=batched,
        )
        engine.warm_up()  # while /health says loading, not in the first request
        return engine

    return build


# Absolute paths (POSIX or Windows) in a message: /health is open, paths stay private.
_PATH = re.compile(r"(?:[A-Za-z]:)?[\\/][^\s'\",;:()]*[\\/][^\s'\",;:()]*")


def describe_blas() -> Mapping[str, Any]:
    """What /health reports as BLAS (``mtplx.blas``): its name, thread count, whether it is
    the fast one, and why not when it is not. The library's path is left out (start-up
    logs it), and paths in the fallback reason are replaced by ``<path>``: /health answers
    without the API key."""
    from mtplx.blas import blas_info

    info = blas_info()
    reason = info.fallback_reason
    return {
        "name": info.name,
        "threads": info.threads,
        "fast": info.fast,
        "fallback_reason": _PATH.sub("<path>", reason) if reason else reason,
        "quantized_kernel": _quantized_kernel(),
    }


def _quantized_kernel() -> str | None:
    """The quantized products' kernel if this process built it (``mtplx.quant``), else None;
    never builds it (a float32 model does not need it)."""
    import mtplx.quant as quant

    return quant.quant_info().kernel if quant.loaded() else None


def _settings_problems(exc: Any) -> str:
    """A pydantic ValidationError as ``field: message`` lines, without the rejected input
    (which, for api_key, is the secret)."""
    lines = []
    for error in exc.errors():
        field = ".".join(str(item) for item in error.get("loc", ())) or "settings"
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        lines.append(f"{field}: {message}")
    return "; ".join(lines)


def serve(args: argparse.Namespace) -> int:
    """Run the HTTP server until interrupted."""
    from pydantic import ValidationError

    from server.settings import ConfigError, is_loopback, load_settings

    overrides = {
        "model": args.model,
        "drafter": args.drafter,
        "depth": args.depth,
        "draft_layers": args.draft_layers,
        "host": args.host,
        "port": args.port,
        "api_key": args.api_key,
        "allowed_hosts": args.allowed_hosts,
        "allowed_origins": args.allowed_origins,
        "max_num_seqs": args.max_num_seqs,
        "prefill_chunk_size": args.prefill_chunk_size,
        "prefix_cache_bytes": args.prefix_cache_bytes,
        "max_kv_bytes": args.max_kv_bytes,
        "max_queue": args.max_queue,
        "shutdown_timeout": args.shutdown_timeout,
        "max_tokens_limit": args.max_tokens_limit,
        "served_model_name": args.served_model_name,
        "log_level": args.log_level,
        "reasoning_parser": args.reasoning_parser,
    }
    try:
        settings = load_settings(args.config, overrides)
    except ConfigError as exc:
        print(f"mtplx serve: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        print(f"mtplx serve: invalid settings: {_settings_problems(exc)}", file=sys.stderr)
        return 2
    if settings.api_key is None and not is_loopback(settings.host):
        print(
            f"mtplx serve: refusing to listen on {settings.host} without an API key; "
            "pass --api-key or set MTPLX_API_KEY (or bind to 127.0.0.1)",
            file=sys.stderr,
        )
        return 2
    problem = check_drafter_options(settings.drafter, settings.draft_layers)
    if problem:
        print(f"mtplx serve: {problem}", file=sys.stderr)
        return 2

    from mtplx.scheduler import EngineNotReady, Scheduler
    from server.app import create_app
    from server.connections import ConnectionLimits

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    pipeline = None
    if args.distributed:
        from mtplx.distributed import Pipeline

        if settings.draft_layers:
            print("mtplx serve: --draft-layers cannot be used with --distributed", file=sys.stderr)
            return 2
        try:
            pipeline = Pipeline.join(args.pipeline_timeout)
        except (RuntimeError, ValueError) as exc:
            print(f"mtplx serve: --distributed: {exc}", file=sys.stderr)
            return 2
        if pipeline.rank != 0:
            return pipeline.work(resolve_model(settings.model), settings.max_num_seqs)

        def lost(failure: Exception) -> None:
            scheduler.fail(EngineNotReady(str(failure)))

        pipeline.on_failure = lost
    scheduler = Scheduler(
        engine_factory(
            settings.model,
            settings.drafter,
            settings.depth,
            settings.draft_layers,
            settings.max_num_seqs,
            settings.prefill_chunk_size,
            settings.prefix_cache_bytes,
            pipeline,
            settings.max_kv_bytes,
        ),
        max_queue=settings.max_queue,
        request_timeout=settings.request_timeout,
    )
    app = create_app(scheduler, settings, blas_info=describe_blas)
    limits = ConnectionLimits(
        max_connections=settings.max_connections,
        header_timeout=settings.header_timeout,
        body_timeout=settings.body_timeout,
        keep_alive_timeout=settings.keep_alive_timeout,
    )
    try:
        error = run_server(
            app,
            scheduler,
            settings.host,
            settings.port,
            settings.log_level,
            settings.shutdown_timeout,
            limits,
        )
    except Interrupted as exc:
        if pipeline is not None:
            pipeline.close()
        print(f"mtplx serve: {exc}", file=sys.stderr)
        return 130  # the shell's code for a SIGINT
    if pipeline is not None and not pipeline.close():
        print(f"mtplx serve: {pipeline.failure}", file=sys.stderr)
        pipeline.exit_lost()
    if error is not None:
        print(f"mtplx serve: the model failed to load: {error}", file=sys.stderr)
        if pipeline is not None:
            pipeline.exit_lost()  # the launched command fails too (mlx.launch exits 0)
        return 1
    return 0


class Interrupted(Exception):
    """A second SIGINT stopped the server at once: running requests were ended."""


def run_server(
    app: Any,
    scheduler: Any,
    host: str,
    port: int,
    log_level: str,
    shutdown_timeout: float = 30.0,
    limits: Any = None,
) -> Any:
    """Serve ``app`` with uvicorn until interrupted. The model loads on the engine thread
    while /health answers 503; if loading fails (bad path, a drafter the checkpoint cannot
    use) the server shuts down and the load error is returned, else None.

    ``limits`` (``server.connections.ConnectionLimits``; None: its defaults) bounds what
    connections may hold: a deadline for each request head, an idle timeout inside a body
    and a cap on open connections, kept below the file-descriptor limit (whose soft value is
    raised to the hard one first). Log messages a client can trigger at will are
    rate-limited.

    SIGTERM / SIGINT stop it gracefully: no new connections (uvicorn closes idle keep-alive
    ones), requests in flight finish for up to ``shutdown_timeout`` seconds while any that
    still reach the scheduler get 503, then the rest end with an error event (code
    ``server_shutting_down``, and ``[DONE]``); the process exits 0. A second SIGINT ends
    every request at once, streams with that error event, and raises ``Interrupted``."""
    import threading

    import uvicorn

    from server.connections import (
        ACCEPT_BACKLOG,
        ConnectionGuard,
        ConnectionLimits,
        connection_cap,
        guarded_protocol,
        raise_fd_limit,
    )
    from server.log_limits import limit_log_floods
    from server.streaming import let_streams_drain

    let_streams_drain()
    limits = limits or ConnectionLimits()
    # mlx_lm sets the open-file limit to (2048, 4096) when it is imported: import it before
    # raising the limit, or the engine thread's import would lower it again under the cap.
    with contextlib.suppress(ImportError):
        import mlx_lm.utils  # noqa: F401
    fd_limit = raise_fd_limit()
    cap = connection_cap(limits.max_connections, fd_limit, ACCEPT_BACKLOG)
    guard = ConnectionGuard(
        ConnectionLimits(
            max_connections=cap,
            header_timeout=limits.header_timeout,
            body_timeout=limits.body_timeout,
            keep_alive_timeout=limits.keep_alive_timeout,
        )
    )

    class DrainingServer(uvicorn.Server):
        interrupted = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            # A graceful stop is a normal exit: uvicorn would re-raise the signal after it.
            self._captured_signals.clear()
            if first:
                scheduler.drain(shutdown_timeout)
            elif self.force_exit and not self.interrupted:
                # uvicorn would drop the connections now: end the requests first, so each
                # stream still gets its error event and end marker.
                self.force_exit = False
                self.interrupted = True
                threading.Thread(target=self._stop_now, name="mtplx-interrupt", daemon=True).start()

        def _stop_now(self) -> None:
            scheduler.stop()
            # The streams send their error events and end; uvicorn's shutdown then goes on
            # as usual. What has not ended in two seconds is cut.
            deadline = time.monotonic() + 2.0
            state = self.server_state
            while (state.tasks or state.connections) and time.monotonic() < deadline:
                time.sleep(0.05)
            if state.tasks or state.connections:
                self.force_exit = True

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=guarded_protocol(guard),
        backlog=ACCEPT_BACKLOG,
        timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]
        # Streams end by themselves once the scheduler's drain is over; uvicorn only cuts
        # what is left a little later.
        timeout_graceful_shutdown=shutdown_timeout + 5,  # type: ignore[arg-type]
    )
    limit_log_floods()  # after uvicorn.Config, which sets up uvicorn's loggers
    ctx = getattr(getattr(app, "state", None), "ctx", None)
    if ctx is not None:
        ctx.metrics.registry.register(guard)  # /metrics: open and closed connections
    if cap < limits.max_connections:
        logging.getLogger("mtplx.connections").warning(
            "at most %d connections (the open-file limit is %d)", cap, fd_limit
        )
    server = DrainingServer(config)

    def stop_if_load_fails() -> None:
        if not scheduler.wait_ready() and scheduler.state == "failed":
            server.should_exit = True

    threading.Thread(target=stop_if_load_fails, name="mtplx-load-watch", daemon=True).start()
    server.run()
    if server.interrupted:
        raise Interrupted("interrupted twice: the requests still running were ended")
    return scheduler.load_error  # stays None unless loading failed


def _prompt_ids(tokenizer: Any, args: argparse.Namespace) -> list[int]:
    if args.raw:
        return list(tokenizer.encode(args.prompt))
    messages = [{"role": "user", "content": args.prompt}]
    if args.system:
        messages.insert(0, {"role": "system", "content": args.system})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    if isinstance(ids, str):  # a template wrapper that ignores tokenize=True
        return list(tokenizer.encode(ids, add_special_tokens=False))
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):  # batched
        ids = ids[0]
    return [int(t) for t in ids]


def generate(args: argparse.Namespace) -> int:
    """Stream one generation to stdout; statistics to stderr."""
    from mtplx.request import FinishEvent, GenerationRequest, TokenEvent
    from mtplx.sampling import SamplerConfig

    problem = check_drafter_options(args.drafter, args.draft_layers)
    if problem:
        print(f"mtplx generate: {problem}", file=sys.stderr)
        return 2
    try:
        engine = engine_factory(args.model, args.drafter, args.depth, args.draft_layers)()
    except ValueError as exc:
        print(f"mtplx generate: {exc}", file=sys.stderr)
        return 2
    try:
        request = GenerationRequest(
            prompt_ids=_prompt_ids(engine.tokenizer, args),
            sampler=SamplerConfig(
                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
            ),
            max_tokens=args.max_tokens,
            drafter=None if args.drafter == "auto" else args.drafter,
            depth=args.depth,
        )
        engine.validate(request)
    except ValueError as exc:
        print(f"mtplx generate: {exc}", file=sys.stderr)
        return 2
    events = engine.generate(request)
    try:
        for event in events:
            if isinstance(event, TokenEvent | FinishEvent):
                # A FinishEvent carries the tail the detokenizer held back.
                sys.stdout.write(event.text)
                sys.stdout.flush()
            if isinstance(event, FinishEvent) and not args.quiet:
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
