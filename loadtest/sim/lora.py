"""LoRA adapters as vLLM's API server keeps them (``vllm/entrypoints/openai/models/serving.py``).

The registry holds the adapters a request may name: those of ``--lora-modules`` (loaded at
start) and those loaded at runtime with ``POST /v1/load_lora_adapter`` (only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), dropped by ``POST /v1/unload_lora_adapter``. The
checks, their order, the messages and the success texts are vLLM 0.32's; a load takes the
engine's ``lora_load_s`` (held per adapter name, as vLLM's per-name lock does), and the
adapter is listed and usable only once it is loaded. Not modelled: the path is never read
(vLLM answers 404 for a path with no adapter), and the CPU-side LRU of ``--max-cpu-loras``.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from typing import Any

from loadtest.sim.protocol import SimError, body_error

INVALID_INPUT = "InvalidUserInput"


def parse_lora_module(item: str) -> tuple[str, str]:
    """One ``--lora-modules`` value: ``name=path`` or vLLM's JSON ``{"name", "path"}``."""
    if "=" in item and "," not in item:
        name, path = item.split("=", 1)
        return name, path
    try:
        module = json.loads(item)
        return str(module["name"]), str(module["path"])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"Invalid --lora-modules value: {item}") from exc


def _string_field(body: dict[str, Any], name: str) -> str:
    if name not in body:
        raise body_error(name, "missing", "Field required", body)
    value = body[name]
    if not isinstance(value, str):
        raise body_error(name, "string_type", "Input should be a valid string", value)
    return value


class LoraRegistry:
    """The adapters one server serves on its base model: name -> path, in load order."""

    def __init__(self, base_model: str, modules: tuple[tuple[str, str], ...], load_s: float):
        self.base_model = base_model
        self.load_s = load_s
        self.adapters: dict[str, str] = dict(modules)
        self.loads = 0  # runtime loads that succeeded
        self.unloads = 0  # and unloads
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    async def load(self, body: dict[str, Any]) -> str:
        """``POST /v1/load_lora_adapter``: the success text, or raises vLLM's error."""
        name, path = _string_field(body, "lora_name"), _string_field(body, "lora_path")
        inplace = bool(body.get("load_inplace", False))
        async with self._locks[name]:
            if not name or not path:
                raise SimError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                               error_type=INVALID_INPUT)  # fmt: skip
            if name == self.base_model:
                raise SimError(
                    400, f"The lora adapter '{name}' conflicts with a served base model.",
                    error_type=INVALID_INPUT,
                )  # fmt: skip
            if not inplace and name in self.adapters:
                raise SimError(
                    400,
                    f"The lora adapter '{name}' has already been loaded. If you want to load "
                    "the adapter in place, set 'load_inplace' to True.",
                    error_type=INVALID_INPUT,
                )
            if self.load_s > 0:
                await asyncio.sleep(self.load_s)
            self.adapters[name] = path
            self.loads += 1
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: dict[str, Any]) -> str:
        """``POST /v1/unload_lora_adapter``: the success text, or raises vLLM's error."""
        name = _string_field(body, "lora_name")
        async with self._locks[name]:
            if not name:
                raise SimError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                               error_type=INVALID_INPUT)  # fmt: skip
            if name not in self.adapters:
                raise SimError(404, f"The lora adapter '{name}' cannot be found.")
            del self.adapters[name]
            self.unloads += 1
        return f"Success: LoRA adapter '{name}' removed successfully."

    def cards(self, created: int, permission: dict[str, Any]) -> list[dict[str, Any]]:
        """``/v1/models`` entries of the adapters: ``root`` the path, ``parent`` the base."""
        return [
            {"id": name, "object": "model", "created": created, "owned_by": "vllm",
             "root": path, "parent": self.base_model, "max_model_len": None,
             "permission": [permission]}
            for name, path in self.adapters.items()
        ]  # fmt: skip
