"""Write a tiny random LoRA adapter for the tiny Llama of ``make_tiny_model.py`` (no
downloads, no ``peft``, standard library only).

    python tests/e2e_vllm/make_tiny_adapter.py OUT_DIR [SEED]

Writes what vLLM's ``LoRAModel.from_local_checkpoint`` reads (vLLM 0.32,
``vllm/lora/lora_model.py`` and ``peft_helper.py``): ``adapter_config.json`` in PEFT's
format and ``adapter_model.safetensors`` with, per layer and target module,
``base_model.model.model.layers.{i}.self_attn.{q,v}_proj.lora_{A,B}.weight`` shaped
``[r, in]`` and ``[out, r]`` (float32). The safetensors file is written by hand: an
8-byte little-endian header length, the JSON header (padded to 8 bytes), the raw data.
"""

from __future__ import annotations

import json
import random
import struct
import sys
from pathlib import Path

RANK = 8
LAYERS = 2  # make_tiny_model.py's config
HIDDEN = 128
KV_OUT = 4 * 32  # num_key_value_heads × head_dim
TARGETS = {"q_proj": (HIDDEN, HIDDEN), "v_proj": (HIDDEN, KV_OUT)}  # module: (in, out)


def safetensors_bytes(tensors: dict[str, tuple[list[int], list[float]]]) -> bytes:
    """A safetensors file of float32 tensors: name -> (shape, values, row-major)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    data = bytearray()
    for name, (shape, values) in tensors.items():
        count = 1
        for dim in shape:
            count *= dim
        assert len(values) == count, (name, shape, len(values))
        start = len(data)
        data += struct.pack(f"<{count}f", *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [start, len(data)]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(data)


def write_adapter(out: Path, seed: int = 0, base_model: str = "tiny") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    tensors: dict[str, tuple[list[int], list[float]]] = {}
    for layer in range(LAYERS):
        for module, (fan_in, fan_out) in TARGETS.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                [RANK, fan_in], [rng.gauss(0.0, 0.02) for _ in range(RANK * fan_in)])
            tensors[f"{prefix}.lora_B.weight"] = (
                [fan_out, RANK], [rng.gauss(0.0, 0.02) for _ in range(fan_out * RANK)])
    (out / "adapter_model.safetensors").write_bytes(safetensors_bytes(tensors))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "target_modules": sorted(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }, indent=2))
    return out


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    print(write_adapter(Path(argv[1]), int(argv[2]) if len(argv) == 3 else 0))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
