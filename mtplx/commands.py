"""``mtplx serve``'s and ``mtplx generate``'s arguments, the engine factory both use, and
``mtplx generate`` itself.

Kept apart from ``mtplx/cli.py`` so the CLI module only wires subcommands. The HTTP side of
``mtplx serve`` (settings, the app, uvicorn) is ``server.main``: nothing here imports the web
stack. MLX loads inside the engine factory: ``mtplx --help`` stays fast.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

from mtplx.drafter_registry import DRAFTER_NAMES, available_drafters, drafter_kind
from mtplx.request import MAX_DEPTH

__all__ = [
    "add_generate_parser",
    "add_serve_parser",
    "check_drafter_options",
    "describe_blas",
    "engine_factory",
    "generate",
    "resolve_model",
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
        help="KV memory bound: a request starts when its prompt's KV fits beside the running "
        "sequences' (bytes or 512M, 4G; none: no bound)",
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
    available = available_drafters(has_mtp, has_draft_model)
    if drafter in available:
        return
    reason = drafter_kind(drafter).needs
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
    """A callable that loads the checkpoint and builds the engine. The bridge runs it on
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
        "quantized_activations": _quantized_activations(),
    }


def _quantized_kernel() -> str | None:
    """The quantized products' kernel if this process built it (``mtplx.quant``), else None;
    never builds it (a float32 model does not need it)."""
    import mtplx.quant as quant

    return quant.quant_info().kernel if quant.loaded() else None


def _quantized_activations() -> str | None:
    """How the quantized kernel treats its rows (``MTPLX_ACTIVATIONS``: ``int8`` or
    ``float32``) when this process built it, else None."""
    import mtplx.quant as quant
    from mtplx.models.quantized import activations_format

    return activations_format() if quant.loaded() else None


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
    from mtplx.request import FinishEvent, GenerationRequest, SamplerConfig, TokenEvent

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
