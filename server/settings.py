"""Server settings: command line > environment (``MTPLX_*``) > YAML config file > defaults.

A config file may only use the field names below; an unknown key is an error that names it,
so a typo never silently falls back to a default.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from mtplx.drafter_registry import DRAFTER_NAMES

__all__ = ["ConfigError", "ServerSettings", "is_loopback", "load_settings", "read_config_file"]


class ConfigError(ValueError):
    """A config file that cannot be used (unreadable, not a mapping, unknown key)."""


# "auto" picks the best drafter the model has (mtplx.drafter_registry.best_drafter).
_DRAFTER_CHOICES = ("auto", *DRAFTER_NAMES)


class ServerSettings(BaseSettings):
    """Everything ``mtplx serve`` can be told, with defaults for a local single-user server."""

    model_config = SettingsConfigDict(env_prefix="MTPLX_", extra="forbid", validate_default=True)

    model: str | None = Field(None, description="checkpoint path or id; None = shipped default")
    served_model_name: str | None = Field(None, description="id clients send; default: model's")
    drafter: Literal[_DRAFTER_CHOICES] = "auto"
    depth: int | None = Field(
        None, ge=0, le=16, description="draft tokens per cycle; None=adaptive"
    )
    draft_layers: int | None = Field(
        None, ge=1, description="layer-skip self-draft: the first N target layers (draft_model)"
    )
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: SecretStr | None = None
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Host header names accepted besides localhost, 127.0.0.1 and [::1] "
        "(comma list; * = any). Empty: only those on a loopback bind, any otherwise",
    )
    allowed_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="browser origins allowed by CORS (comma list; * = any); empty: no CORS",
    )
    max_num_seqs: int = Field(
        16, ge=1, le=64, description="sequences decoded together in one batch (rows per step)"
    )
    prefill_chunk_size: int = Field(
        32, ge=8, description="prompt tokens a prompt feeds per step beside decoding streams"
    )
    prefix_cache_bytes: int = Field(
        1 << 30,
        ge=0,
        description="memory for cached prompt-prefix states (bytes, or with K/M/G: 512M, 2G); "
        "0 turns the prefix cache off",
    )
    max_kv_bytes: int | None = Field(
        4 << 30,
        ge=1,
        description="KV memory (bytes, or with K/M/G: 512M, 4G) admission keeps the running "
        "sequences under: a request starts when its prompt's KV fits beside theirs (else it "
        "waits in the queue; one sequence alone always runs; a prompt over it alone is a 400); "
        "null or none: no bound",
    )
    max_queue: int = Field(64, ge=1, description="requests waiting for the engine before 429")
    max_tokens_limit: int = Field(8192, ge=1, description="largest max_tokens a request may ask")
    max_n: int = Field(16, ge=1, description="largest n (choices per prompt)")
    max_choices: int = Field(
        16, ge=1, description="largest number of choices per request: prompts x n"
    )
    request_timeout: float = Field(
        600.0, gt=0, allow_inf_nan=False, description="seconds, waiting plus generating"
    )
    shutdown_timeout: float = Field(
        30.0,
        ge=0,
        allow_inf_nan=False,
        description="seconds in-flight requests may finish on SIGTERM / SIGINT",
    )
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="larger bodies: 413")
    max_connections: int = Field(
        1024,
        ge=1,
        description="open connections at most (kept below the open-file limit); past it the "
        "connection waiting longest for a request head is closed, or a new one refused",
    )
    header_timeout: float = Field(
        10.0,
        gt=0,
        allow_inf_nan=False,
        description="seconds a request's head (request line and headers) may take to arrive",
    )
    body_timeout: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="seconds without a byte inside a request body before the connection closes",
    )
    # Above the 5 s a client of httpx (the openai package's transport) keeps an idle
    # connection: at equal timeouts a client reuses the connection the server is closing
    # that moment and reads a reset. Below header_timeout, which an idle connection is
    # also under (past it the connection would get a 408 instead of a quiet close).
    keep_alive_timeout: float = Field(
        8.0, gt=0, allow_inf_nan=False, description="idle seconds between requests on a connection"
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    reasoning_parser: Literal["auto", "none", "qwen3", "deepseek_r1"] = Field(
        "auto",
        description="how a reply's <think>...</think> is told from its answer (auto: from "
        "the chat template; none: left in the text); see docs/reasoning.md",
    )

    @field_validator("api_key")
    @classmethod
    def _usable_api_key(cls, value: SecretStr | None) -> SecretStr | None:
        # An empty key would pass the "no key on a public bind" guard and then be matched
        # by a request without any Authorization header.
        if value is None:
            return None
        key = value.get_secret_value()
        if not key.strip():
            raise ValueError(
                "api_key is empty or whitespace; pass a real key, or leave --api-key and "
                "MTPLX_API_KEY unset for no key"
            )
        if key != key.strip():
            raise ValueError(
                "api_key has leading or trailing whitespace, which clients cannot send"
            )
        return value

    @model_validator(mode="after")
    def _keep_alive_within_head_deadline(self) -> ServerSettings:
        # An idle connection is also waiting for a request head: past header_timeout it
        # would get a 408 where the keep-alive meant to close it quietly.
        if self.keep_alive_timeout >= self.header_timeout:
            raise ValueError(
                f"keep_alive_timeout ({self.keep_alive_timeout:g} s) must be below "
                f"header_timeout ({self.header_timeout:g} s)"
            )
        return self

    @field_validator("prefix_cache_bytes", "max_kv_bytes", mode="before")
    @classmethod
    def _byte_size(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool):  # YAML's yes / true would pass as 1 byte
            raise ValueError("a size is a number of bytes, or with K, M, G or T")
        no_bound = isinstance(value, str) and value.strip().lower() in ("none", "null", "")
        if no_bound and info.field_name == "max_kv_bytes":
            return None
        return parse_byte_size(value) if isinstance(value, str) else value

    @field_validator("allowed_hosts", "allowed_origins", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        # MTPLX_ALLOWED_HOSTS="a.example, b.example" and --allowed-hosts a,b are comma lists.
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Keyword arguments (the CLI) first, then the environment; load_settings adds the file.
        return (init_settings, env_settings)


class _MappingSource(PydanticBaseSettingsSource):
    """Values read from a config file, lowest priority above the defaults."""

    def __init__(self, settings_cls: type[BaseSettings], values: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self._values = values

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._values)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML config; raise ConfigError naming the file and any unknown key."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping of setting: value")
    unknown = sorted(str(key) for key in data if key not in ServerSettings.model_fields)
    if unknown:
        raise ConfigError(
            f"unknown key {unknown[0]!r} in config file {path} "
            f"(known: {', '.join(ServerSettings.model_fields)})"
        )
    return data


def load_settings(
    config_file: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> ServerSettings:
    """Settings with the documented precedence. ``overrides`` are the CLI values given
    (leave out what the user did not pass, so the environment and the file still apply)."""
    file_values = read_config_file(config_file) if config_file else {}

    class _WithFile(ServerSettings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, _MappingSource(settings_cls, file_values))

    merged = _WithFile(**{k: v for k, v in (overrides or {}).items() if v is not None})
    return ServerSettings.model_construct(**merged.model_dump())


def is_loopback(host: str) -> bool:
    """True for hosts only this machine can reach (localhost, 127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_BYTE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_byte_size(text: str) -> int:
    """``"1073741824"``, ``"512M"``, ``"2G"``, ``"1.5GiB"`` -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"{text!r} is not a size: a number of bytes, or with K, M, G or T")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).upper()])
