"""From a validated OpenAI request to engine input: one ``GenerationRequest`` per choice
(prompts come from ``server.prompts``), with every limit checked and every rejection an
``APIError`` naming the field."""

from __future__ import annotations

from collections.abc import Sequence

from mtplx.grammar import GrammarSpec
from mtplx.request import GenerationRequest, SamplerConfig
from server.engine_bridge import EngineLike
from server.errors import APIError, from_value_error
from server.prompts import Prompt, count_prompts
from server.schemas import ChatCompletionRequest, CompletionRequest, unsupported_fields
from server.settings import ServerSettings
from server.structured import grammar_for

__all__ = [
    "MAX_STOP_CHARS",
    "MAX_STOP_SEQUENCES",
    "aliases_for",
    "build_requests",
    "check_common",
    "check_stop",
]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions API
# OpenAI's limit on stop sequences; each is matched against the output at every token, so
# their length is bounded too.
MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256


def check_stop(
    stop: str | list[str] | None, param: str = "stop", max_count: int = MAX_STOP_SEQUENCES
) -> None:
    """400 naming ``param`` for more than ``max_count`` stop sequences, one longer than
    ``MAX_STOP_CHARS`` characters, or an empty one."""
    sequences = [stop] if isinstance(stop, str) else list(stop or [])
    if len(sequences) > max_count:
        raise APIError(
            400,
            f"'{param}' may hold at most {max_count} sequences, got {len(sequences)}",
            param=param,
            code="invalid_value",
        )
    for i, sequence in enumerate(sequences):
        where = param if isinstance(stop, str) else f"{param}[{i}]"
        if not sequence:
            raise APIError(400, f"'{where}' must not be empty", param=param, code="invalid_value")
        if len(sequence) > MAX_STOP_CHARS:
            raise APIError(
                400,
                f"'{where}' is {len(sequence)} characters; a stop sequence may be at most "
                f"{MAX_STOP_CHARS}",
                param=param,
                code="invalid_value",
            )


def check_common(
    body: ChatCompletionRequest | CompletionRequest, settings: ServerSettings, model_names: set[str]
) -> None:
    """Checks that need no tokenizer: unsupported fields, model, n and the number of
    choices (prompts x n), stream_options."""
    unsupported = unsupported_fields(body)
    if unsupported:
        field, reason = unsupported
        raise APIError(400, f"'{field}': {reason}", param=field, code="unsupported_parameter")
    if body.model not in model_names:
        raise APIError(
            404, f"The model '{body.model}' does not exist", param="model", code="model_not_found"
        )
    if body.n > settings.max_n:
        raise APIError(
            400, f"n must be <= {settings.max_n}, got {body.n}", param="n", code="invalid_value"
        )
    if isinstance(body, CompletionRequest) and body.best_of is not None and body.best_of < body.n:
        raise APIError(
            400,
            f"best_of must be >= n, got best_of {body.best_of} and n {body.n}",
            param="best_of",
            code="invalid_value",
        )
    prompts = count_prompts(body.prompt) if isinstance(body, CompletionRequest) else 1
    if prompts * body.n > settings.max_choices:
        param = "prompt" if prompts > settings.max_choices else "n"
        raise APIError(
            400,
            f"a request may ask for at most {settings.max_choices} choices (prompts x n); "
            f"this one asks for {prompts} x {body.n} = {prompts * body.n}",
            param=param,
            code="invalid_value",
        )
    if body.stream_options is not None and not body.stream:
        raise APIError(
            400,
            "stream_options is only allowed when stream is true",
            param="stream_options",
            code="invalid_value",
        )


def _max_tokens(
    body: ChatCompletionRequest | CompletionRequest,
    prompt_len: int,
    engine: EngineLike,
    settings: ServerSettings,
) -> tuple[int, str]:
    """The max_tokens to use and the field it came from."""
    field, requested = "max_tokens", body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        if requested is not None and requested != body.max_completion_tokens:
            raise APIError(
                400,
                "max_tokens and max_completion_tokens differ; send one of them",
                param="max_completion_tokens",
                code="invalid_value",
            )
        field, requested = "max_completion_tokens", body.max_completion_tokens
    room = engine.context_length - prompt_len
    if requested is None:
        default = (
            COMPLETIONS_DEFAULT_MAX_TOKENS
            if isinstance(body, CompletionRequest)
            else settings.max_tokens_limit
        )
        return max(1, min(default, settings.max_tokens_limit, room)), field
    if requested > settings.max_tokens_limit:
        raise APIError(
            400,
            f"{field} must be <= {settings.max_tokens_limit} on this server, got {requested}",
            param=field,
            code="invalid_value",
        )
    if requested > room:
        raise APIError(
            400,
            f"This model's maximum context length is {engine.context_length} tokens. However, "
            f"you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
            f"{requested} for the completion).",
            param=field,
            code="context_length_exceeded",
        )
    return requested, field


def prompt_logprobs(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    """How many alternatives each scored prompt token carries, None when the prompt is not
    scored: completions score it for ``echo`` with ``logprobs`` (OpenAI's legacy way, what
    lm-evaluation-harness sends) or for vLLM's ``prompt_logprobs``."""
    if not isinstance(body, CompletionRequest):
        return None
    if body.prompt_logprobs is not None:
        return body.prompt_logprobs
    return body.logprobs if body.echo else None


def _logprobs(body: ChatCompletionRequest | CompletionRequest) -> int | None:
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(
            400,
            "top_logprobs requires logprobs to be true",
            param="top_logprobs",
            code="invalid_value",
        )
    return (body.top_logprobs or 0) if body.logprobs else None


def aliases_for(body: ChatCompletionRequest | CompletionRequest) -> dict[str, str]:
    """Engine field names (first word of its ValueErrors) to the API field to report."""
    chat = isinstance(body, ChatCompletionRequest)
    max_tokens = "max_completion_tokens" if chat and body.max_completion_tokens else "max_tokens"
    return {
        "prompt_ids": "messages" if chat else "prompt",
        "prompt": "messages" if chat else "prompt",
        "drafter": "mtplx.drafter",
        "depth": "mtplx.depth",
        "logprobs": "top_logprobs" if chat else "logprobs",
        "max_tokens": max_tokens,
    }


def build_requests(
    body: ChatCompletionRequest | CompletionRequest,
    prompts: Sequence[Prompt],
    engine: EngineLike,
    settings: ServerSettings,
    grammar: GrammarSpec | None = None,
) -> list[GenerationRequest]:
    """One GenerationRequest per choice, prompt-major: choice ``p * n + i`` is sample i of
    prompt p. With a seed, choice k uses ``seed + k``, so every choice is reproducible.
    ``grammar``: a constraint the caller chose (tool calls); else the request's own
    ``response_format`` / ``mtplx.regex`` / ``mtplx.grammar``."""
    aliases = aliases_for(body)
    prompt_param = aliases["prompt"]
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stop):
        raise APIError(400, "stop strings must not be empty", param="stop", code="invalid_value")
    logprobs = _logprobs(body)
    scored = prompt_logprobs(body)
    if scored is not None and body.stream:
        raise APIError(
            400,
            "prompt logprobs (echo with logprobs, prompt_logprobs) are not streamed: "
            "send the request with stream false",
            param="stream",
            code="unsupported_parameter",
        )
    options = body.mtplx
    drafter = options.drafter if options else None  # None: the engine's default drafter
    # GenerationRequest.depth None means adaptive; only an explicit "depth" (even null)
    # overrides the server's configured default.
    explicit_depth = options is not None and "depth" in options.model_fields_set
    depth = options.depth if explicit_depth else engine.default_depth
    if grammar is None:
        grammar = grammar_for(
            body.response_format,
            options.regex if options else None,
            options.grammar if options else None,
        )
    requests = []
    for p, prompt in enumerate(prompts):
        if len(prompt.token_ids) >= engine.context_length:
            raise APIError(
                400,
                f"This model's maximum context length is {engine.context_length} tokens. "
                f"However, your prompt is {len(prompt.token_ids)} tokens.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        max_tokens, _ = _max_tokens(body, len(prompt.token_ids), engine, settings)
        for i in range(body.n):
            choice = p * body.n + i
            try:
                sampler = SamplerConfig(
                    temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p,
                    top_k=max(0, body.top_k or 0),
                    min_p=body.min_p or 0.0,
                    presence_penalty=body.presence_penalty or 0.0,
                    frequency_penalty=body.frequency_penalty or 0.0,
                    repetition_penalty=(
                        1.0 if body.repetition_penalty is None else body.repetition_penalty
                    ),
                    logit_bias=dict(body.logit_bias or {}),
                    seed=None if body.seed is None else body.seed + choice,
                )
                requests.append(
                    GenerationRequest(
                        prompt_ids=prompt.token_ids,
                        sampler=sampler,
                        max_tokens=max_tokens,
                        stop=tuple(stop),
                        ignore_eos=body.ignore_eos,
                        drafter=drafter,
                        depth=depth,
                        logprobs=logprobs,
                        grammar=grammar,
                        starts_reply=prompt.starts_reply,
                        prompt_logprobs=scored,
                        close_within_budget=options.close_within_max_tokens if options else True,
                    )
                )
            except ValueError as exc:
                raise from_value_error(exc, aliases) from exc
    return requests
