"""Typed access to one parsed model config (a JSON/YAML dict) with one-line SpecErrors.

Every read names the file and the key, so a user who feeds a truncated or hand-edited
config.json learns which key to fix and how, never a KeyError traceback.
"""

from __future__ import annotations

from typing import Any

from planner.inputs.shown import shown
from planner.specs import SpecError

_REQUIRED = object()
# No model has a width, head count, vocabulary or context above this (2**24 = 16.8M; the
# largest presets have vocabularies of ~256K and contexts of 10M tokens). Bounding every size
# keeps the parameter and FLOP arithmetic finite for any input.
MAX_SIZE = 1 << 24


class ConfigReader:
    """Reads typed values from a config dict; `where` is the file or preset, `prefix` a nesting."""

    def __init__(self, cfg: dict[str, Any], where: str, prefix: str = "") -> None:
        if not isinstance(cfg, dict):
            raise SpecError(f"{where}: {prefix or 'the config'} must be a JSON/YAML mapping")
        self.cfg = cfg
        self.where = where
        self.prefix = prefix
        self.taken: dict[str, Any] = {}  # key -> value of every key read from the config
        self.defaulted: dict[str, Any] = {}  # key -> default used for an absent key

    def _took(self, key: str, value: Any) -> Any:
        self.taken[self._name(key)] = value
        return value

    def _default(self, keys: tuple[str, ...], value: Any) -> Any:
        if value is not None:
            self.defaulted[self._name(keys[0])] = value
        return value

    def _name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def has(self, key: str) -> bool:
        """True when `key` is present and not null."""
        return self.cfg.get(key) is not None

    def first_key(self, keys: tuple[str, ...]) -> str | None:
        """The first of `keys` present (aliases of one setting across families)."""
        return next((k for k in keys if self.has(k)), None)

    def error(self, key: str, problem: str, fix: str) -> SpecError:
        return SpecError(f"{self.where}: key '{self._name(key)}' {problem}; {fix}")

    def int(
        self,
        key: str | tuple[str, ...],
        default: Any = _REQUIRED,
        minimum: int = 1,
        maximum: int = MAX_SIZE,
    ) -> int:
        """An integer in [minimum, maximum]; `key` may be a tuple of aliases (the first present
        wins)."""
        keys = (key,) if isinstance(key, str) else key
        found = self.first_key(keys)
        if found is None:
            if default is _REQUIRED:
                names = " or ".join(f"'{self._name(k)}'" for k in keys)
                raise SpecError(
                    f"{self.where}: missing key {names}; add it (an integer >= {minimum})"
                )
            return self._default(keys, default)
        value = self.cfg[found]
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(
                found,
                f"must be an integer, got {shown(value)}",
                f"write a whole number >= {minimum}",
            )
        if value < minimum:
            raise self.error(found, f"must be >= {minimum}, got {value}", "use a positive size")
        if value > maximum:
            raise self.error(
                found, f"must be <= {maximum}, got {value}", "no model has one that large"
            )
        return self._took(found, value)

    def bool(self, key: str, default: bool) -> bool:
        """A JSON boolean; absent or null gives `default`."""
        if not self.has(key):
            return self._default((key,), default)
        value = self.cfg[key]
        if not isinstance(value, bool):
            raise self.error(
                key, f"must be true or false, got {shown(value)}", "write true or false"
            )
        return self._took(key, value)

    def int_list(self, key: str, minimum: int = 0) -> tuple[int, ...]:
        """A list of integers (e.g. mlp_only_layers); absent gives ()."""
        if not self.has(key):
            return ()
        value = self.cfg[key]
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and minimum <= v <= MAX_SIZE
            for v in value
        ):
            raise self.error(
                key, f"must be a list of integers >= {minimum}", "write e.g. [0, 1, 2]"
            )
        return self._took(key, tuple(value))

    def str_list(self, key: str) -> tuple[str, ...]:
        """A list of strings (e.g. GPT-OSS layer_types); absent gives ()."""
        if not self.has(key):
            return ()
        value = self.cfg[key]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, "must be a list of strings", 'write e.g. ["full_attention"]')
        return self._took(key, tuple(value))

    def sub(self, key: str) -> ConfigReader:
        """A nested mapping (DBRX's ffn_config / attn_config, Llama-4's text_config)."""
        if not self.has(key):
            raise SpecError(f"{self.where}: missing key '{self._name(key)}'; add the section")
        value = self.cfg[key]
        if not isinstance(value, dict):
            raise self.error(key, "must be a mapping", "write it as a JSON object")
        return ConfigReader(value, self.where, f"{self._name(key)}.")
