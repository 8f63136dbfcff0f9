"""LoRA adapters through the `peft` library: the option's text, the wrap, peft's own folders.

    spec = LoraSpec.parse("r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05")
    net = wrap(net, spec)                     # peft.get_peft_model: base frozen, adapters train
    net.save_pretrained("out/adapter")        # peft: adapter_config.json + adapter_model.safetensors

Nothing of LoRA is written here: peft builds the adapters, freezes the base and writes and
reads its folders. A plan records the spec (`plan["model"]["lora"]`), so the runtime builds
the same wrapped model for a package's check and export as the compiler traced.
peft is imported inside the functions (`ftpipe[hf]`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["LoraSpec", "base_name", "is_adapter", "wrap"]

ADAPTER = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")
_KEYS = ("r", "alpha", "targets", "dropout")
EXAMPLE = "r=16,alpha=32,targets=q_proj,v_proj[,dropout=0.05]"


@dataclass(frozen=True)
class LoraSpec:
    r: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LoraSpec:
        """`r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05`: a value without `key=` belongs
        to the targets before it. ValueError, one sentence, on anything else."""
        fields: dict[str, list[str]] = {}
        key = None
        for part in (p.strip() for p in text.split(",")):
            if "=" in part:
                key, _, value = part.partition("=")
                key = key.strip()
                if key not in _KEYS:
                    raise ValueError(f"unknown key {key!r}; give {EXAMPLE}")
                if key in fields:
                    raise ValueError(f"{key} is given twice; give {EXAMPLE}")
                fields[key] = [value.strip()]
            elif key == "targets" and part:
                fields[key].append(part)
            else:
                raise ValueError(
                    f"--lora: {part or 'an empty item'!r} is not key=value; give {EXAMPLE}"
                )
        missing = [k for k in ("r", "alpha", "targets") if k not in fields]
        if missing:
            raise ValueError(f"{', '.join(missing)} missing; give {EXAMPLE}")
        targets = tuple(t for t in fields["targets"] if t)
        try:
            r, alpha = int(fields["r"][0]), float(fields["alpha"][0])
            dropout = float(fields.get("dropout", ["0"])[0])
        except ValueError:
            raise ValueError(
                f"r must be an integer, alpha and dropout numbers; give {EXAMPLE}"
            ) from None
        # written as the ranges hold, so that nan (every comparison false) fails them too
        if not (r >= 1 and 0 < alpha < math.inf and 0 <= dropout < 1 and targets):
            raise ValueError(
                "r must be >= 1, alpha > 0, dropout in [0, 1) and targets not empty (numbers "
                "finite)"
            )
        return cls(r, alpha, targets, dropout)

    def to_json(self) -> dict:
        return {"r": self.r, "alpha": self.alpha, "targets": list(self.targets),
                "dropout": self.dropout}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> LoraSpec:
        return cls(int(d["r"]), float(d["alpha"]), tuple(d["targets"]), float(d["dropout"]))

    def config(self):
        """peft's LoraConfig of this spec."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            target_modules=list(self.targets),
            lora_dropout=self.dropout,
        )


def wrap(net, spec: LoraSpec | dict | None):
    """`net` with LoRA adapters (peft's PeftModel; its base frozen), or `net` when no spec.
    ValueError when no module of `net` is one of the targets."""
    if spec is None:
        return net
    spec = LoraSpec.from_json(spec) if isinstance(spec, dict) else spec
    try:
        from peft import get_peft_model
    except ImportError:
        raise ImportError("LoRA needs peft: pip install 'ftpipe[hf]'") from None
    try:
        return get_peft_model(net, spec.config())
    except ValueError:  # peft: "Target modules {...} not found in the base model"
        names = sorted({n.rsplit(".", 1)[-1] for n, m in net.named_modules() if _linear(m)})
        raise ValueError(
            f"--lora targets {', '.join(spec.targets)} match no module of the model; its "
            f"linear layers are named {', '.join(names[:12])}"
        ) from None


def _linear(m) -> bool:
    import torch

    return isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) or type(m).__name__ == "Conv1D"


def is_adapter(name: str) -> bool:
    """Is `name` (a parameter of a wrapped model) a LoRA adapter weight?"""
    return bool(ADAPTER.search(name))


def base_name(name: str) -> str:
    """A peft-wrapped model's parameter as the base model names it
    (`base_model.model.x.q_proj.base_layer.weight` -> `x.q_proj.weight`)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")
