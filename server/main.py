"""``mtplx serve``: merge the settings, build the engine bridge and the app, run uvicorn.

The server side of the command; its arguments are defined with the engine's options in
``mtplx.commands`` (``mtplx/cli.py`` wires both). Heavy imports (uvicorn, MLX through the
engine factory) happen inside the functions.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import time
from typing import Any

from mtplx.commands import check_drafter_options, describe_blas, engine_factory, resolve_model
from mtplx.file_limits import import_mlx_lm

__all__ = ["CannotListen", "Interrupted", "listen_problem", "run_server", "serve"]


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

    from server.app import create_app
    from server.bridge_errors import EngineNotReady
    from server.connections import ConnectionLimits
    from server.engine_bridge import EngineBridge

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
            bridge.fail(EngineNotReady(str(failure)))

        pipeline.on_failure = lost
    bridge = EngineBridge(
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
    app = create_app(bridge, settings, blas_info=describe_blas)
    limits = ConnectionLimits(
        max_connections=settings.max_connections,
        header_timeout=settings.header_timeout,
        body_timeout=settings.body_timeout,
        keep_alive_timeout=settings.keep_alive_timeout,
    )
    try:
        error = run_server(
            app,
            bridge,
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
    except CannotListen as exc:
        if pipeline is not None:
            pipeline.close()
        print(f"mtplx serve: {exc}", file=sys.stderr)
        return 1
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


class CannotListen(Exception):
    """The server's address cannot be bound (a port in use): found before the model loads."""


def listen_problem(host: str, port: int) -> str | None:
    """Why uvicorn could not listen on ``host:port`` (None: it can): each address it would
    bind is bound the way asyncio binds it, and let go. Checked before the app starts,
    because uvicorn binds only after the lifespan started the engine, and a failed bind
    then leaves the process exiting while the model loads on its thread."""
    try:
        addresses = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as exc:
        return f"cannot listen on {host}:{port}: {exc}"
    for family, kind, proto, _, address in set(addresses):
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(address)
        except OSError as exc:
            return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
    return None


def run_server(
    app: Any,
    bridge: Any,
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
    still reach the bridge get 503, then the rest end with an error event (code
    ``server_shutting_down``, and ``[DONE]``); the process exits 0. A second SIGINT ends
    every request at once, streams with that error event, and raises ``Interrupted``.
    An address that cannot be bound raises ``CannotListen`` before anything starts."""
    import threading

    import uvicorn

    problem = listen_problem(host, port)
    if problem is not None:
        raise CannotListen(problem)

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
    # mlx-lm sets the open-file limits when it is imported: import it (without that change)
    # before raising the limit, so the engine thread's import cannot lower it under the cap.
    import_mlx_lm()
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
                bridge.drain(shutdown_timeout)
            elif self.force_exit and not self.interrupted:
                # uvicorn would drop the connections now: end the requests first, so each
                # stream still gets its error event and end marker.
                self.force_exit = False
                self.interrupted = True
                threading.Thread(target=self._stop_now, name="mtplx-interrupt", daemon=True).start()

        def _stop_now(self) -> None:
            bridge.stop()
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
        # Streams end by themselves once the bridge's drain is over; uvicorn only cuts
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
        if not bridge.wait_ready() and bridge.state == "failed":
            server.should_exit = True

    threading.Thread(target=stop_if_load_fails, name="mtplx-load-watch", daemon=True).start()
    server.run()
    if server.interrupted:
        raise Interrupted("interrupted twice: the requests still running were ended")
    return bridge.load_error  # stays None unless loading failed
