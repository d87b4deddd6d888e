"""`QuantizationConfig`: which quantization the transformer's linears use (`--quantization`,
`--diffusion-quantization-config`), parsed and checked here without torch (the engine config holds it).

Accepted forms (vLLM's flag, and vLLM-Omni's JSON, per component or flat):

    --quantization fp8
    --diffusion-quantization-config '{"method": "fp8"}'
    --diffusion-quantization-config '{"method": "fp8", "ignored_layers": ["img_mlp"]}'
    --diffusion-quantization-config '{"transformer": {"method": "fp8", "ignored_layers": [...]}}'
    --diffusion-quantization-config '{"method": "fp8", "is_checkpoint_fp8_serialized": true}'

`ignored_layers` replaces the family's default set of layers kept in high precision (an empty list
quantizes every linear); an entry names a module path or a run of its dotted parts (`img_mlp` matches
`transformer_blocks.3.img_mlp.net.2`), and an entry that matches no linear is refused at load.

An FP8 checkpoint (e4m3 weights with `weight_scale`s) is recognised from its tensors
(`layers/fp8_checkpoint.py`); vLLM's `is_checkpoint_fp8_serialized` states what the checkpoint is (a
checkpoint that is not what it says is refused at load) and `activation_scheme` may only be 'dynamic'
(activations are quantised per token at run time; a checkpoint's static `input_scale`s are not used).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

QUANT_METHODS = ("fp8",)
"""Methods this engine runs (docs/quantization.md)."""
BATCH_INVARIANT_METHODS = ("fp8",)
"""Methods with a batch-invariant linear (`batch_invariant.INVARIANT_METHODS`): the ones that may be
combined with VLLM_BATCH_INVARIANT (docs/batch_invariance.md)."""

_KEYS = {"method", "ignored_layers", "is_checkpoint_fp8_serialized", "activation_scheme"}
_COMPONENTS = ("transformer",)
"""Components that can be quantized (the VAE and text encoder run in --dtype)."""


@dataclass(frozen=True)
class QuantizationConfig:
    """The transformer's quantization; `method=None` means none (weights run in --dtype)."""

    method: str | None = None
    """'fp8' (W8A8: e4m3 weights with per-output-channel scales, dynamic per-token activation scales)."""
    ignored_layers: tuple[str, ...] | None = None
    """Linears kept in high precision (module paths or runs of dotted parts); None = the family's
    default set (its transformer's `plans.quant_kept_layers`)."""
    checkpoint_fp8: bool | None = None
    """vLLM's `is_checkpoint_fp8_serialized`: whether the transformer checkpoint holds FP8 weights
    (None: whatever its tensors say)."""
    source: str = "quantization"
    """The flag or field the config came from, named in error messages."""

    def __post_init__(self) -> None:
        if self.method is not None:
            if not isinstance(self.method, str):
                raise ValueError(f"{self.source}: method must be a string, got {self.method!r}")
            object.__setattr__(self, "method", self.method.strip().lower())
        if self.method == "int8":
            raise ValueError(
                f"{self.source}: method 'int8' is not supported (torch's INT8 GEMM ran 7x slower than BF16 "
                "at Qwen-Image's shapes); use 'fp8'"
            )
        if self.method in ("modelopt", "compressed-tensors"):
            raise ValueError(
                f"{self.source}: method {self.method!r}: give 'fp8'; FP8 checkpoints in vLLM's and "
                "ModelOpt's layout (e4m3 weights with weight_scale) load with it as they are "
                "(docs/quantization.md)"
            )
        if self.method is not None and self.method not in QUANT_METHODS:
            raise ValueError(
                f"{self.source}: unknown method {self.method!r}; supported: {', '.join(QUANT_METHODS)}"
            )
        if self.ignored_layers is not None:
            layers = self.ignored_layers
            if isinstance(layers, str) or not all(isinstance(n, str) and n.strip() for n in layers):
                raise ValueError(
                    f"{self.source}: ignored_layers must be a list of module names, got {layers!r}"
                )
            if self.method is None:
                raise ValueError(f"{self.source}: ignored_layers is given without a method")
            object.__setattr__(self, "ignored_layers", tuple(n.strip() for n in layers))

    @property
    def is_enabled(self) -> bool:
        return self.method is not None

    @classmethod
    def from_value(cls, value: Any, source: str = "quantization") -> QuantizationConfig:
        """From a config's value: a `QuantizationConfig`, None, a method name, a dict, its JSON text or
        the path of a `.json` file holding it (as vLLM's JSON flags take)."""
        if value is None or isinstance(value, QuantizationConfig):
            return value if value is not None else cls()
        if isinstance(value, str):
            text = value.strip()
            if text.endswith(".json"):
                path = Path(text).expanduser()
                if not path.is_file():
                    raise ValueError(
                        f"{source}: {text!r} is not a file; give the JSON text "
                        f'(e.g. \'{{"method": "fp8"}}\'), a method name, or the path of a JSON file'
                    )
                text = path.read_text(encoding="utf-8").strip()
            if text.startswith("{"):
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{source}: invalid JSON {text!r} ({exc.msg})") from None
            else:
                return cls(method=text or None, source=source)
        if not isinstance(value, dict):
            raise ValueError(f"{source}: expected a method name or a JSON object, got {value!r}")
        return cls._from_dict(value, source)

    @classmethod
    def _from_dict(cls, d: dict, source: str) -> QuantizationConfig:
        components = {k: v for k, v in d.items() if k not in _KEYS}
        if components and set(d) & _KEYS:
            raise ValueError(
                f'{source}: give either the flat form {{"method": ...}} or per component '
                f'{{"transformer": {{...}}}}, not both (got keys {sorted(d)})'
            )
        if components:
            unknown = sorted(set(components) - set(_COMPONENTS))
            if unknown:
                raise ValueError(
                    f"{source}: cannot quantize {unknown}: only the transformer is quantized (the VAE and "
                    "text encoder run in --dtype)"
                )
            d = components["transformer"]
            source = f"{source}.transformer"
            if not isinstance(d, dict):
                raise ValueError(f"{source}: expected a JSON object, got {d!r}")
            unknown = sorted(set(d) - _KEYS)
            if unknown:
                raise ValueError(f"{source}: unknown keys {unknown}; known: {sorted(_KEYS)}")
        if "method" not in d:
            raise ValueError(f'{source}: no \'method\' (e.g. {{"method": "fp8"}})')
        layers = d.get("ignored_layers")
        if layers is not None and not isinstance(layers, list):
            raise ValueError(f"{source}: ignored_layers must be a list of module names, got {layers!r}")
        ignored = None if layers is None else tuple(layers)
        serialized = d.get("is_checkpoint_fp8_serialized")
        if serialized is not None and not isinstance(serialized, bool):
            raise ValueError(
                f"{source}: is_checkpoint_fp8_serialized must be true or false, got {serialized!r}"
            )
        scheme = d.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(
                f"{source}: activation_scheme {scheme!r} is not supported: activations are quantised per "
                "token at run time ('dynamic'); a checkpoint's static input_scale tensors are not used"
            )
        return cls(method=d["method"], ignored_layers=ignored, checkpoint_fp8=serialized, source=source)

    def merged(self, other: QuantizationConfig) -> QuantizationConfig:
        """This config and `other` (two flags) as one; ValueError when both set different methods."""
        if not other.is_enabled:
            return self
        if not self.is_enabled:
            return other
        if self.method != other.method:
            raise ValueError(
                f"{self.source} ({self.method}) and {other.source} ({other.method}) disagree; give one"
            )
        if self.ignored_layers is not None and other.ignored_layers is not None:
            raise ValueError(
                f"ignored_layers is given by both {self.source} and {other.source}; give it once"
            )
        if (
            None not in (self.checkpoint_fp8, other.checkpoint_fp8)
            and self.checkpoint_fp8 != other.checkpoint_fp8
        ):
            raise ValueError(f"{self.source} and {other.source} disagree on is_checkpoint_fp8_serialized")
        base = self if other.ignored_layers is None else other  # the one whose layers (and name) count
        serialized = self.checkpoint_fp8 if other.checkpoint_fp8 is None else other.checkpoint_fp8
        return QuantizationConfig(base.method, base.ignored_layers, serialized, base.source)
