"""Quantization schemes by name, and the module swap that applies one to a loaded model."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tidal.config.quant import WEIGHT_SCHEMES, check_scheme

if TYPE_CHECKING:  # NOTE: kept torch-free at import time
    from torch import nn

# scheme name -> module exposing quantize_linear(nn.Linear) and
# quantize_tied_embedding(quantized head, nn.Embedding); imported only when the scheme is used.
_SCHEME_MODULES = {
    "int8": "tidal.quant.int8",
    "int4": "tidal.quant.int4",
    "fp8": "tidal.quant.fp8",
}
assert tuple(_SCHEME_MODULES) == WEIGHT_SCHEMES  # NOTE: the names live in tidal.config.quant


@dataclass(slots=True)
class QuantSummary:
    scheme: str
    num_linear: int  # nn.Linear modules replaced
    weight_bytes_before: int  # unique parameter + buffer bytes
    weight_bytes_after: int


def weight_bytes(model: nn.Module) -> int:
    """Bytes of distinct tensors (parameters and buffers); tied or shared ones count once."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total


def quantize_model(model: nn.Module, scheme: str) -> QuantSummary:
    """Replace every nn.Linear in place (the model definition stays untouched).

    A LM head tied to the embedding (Gemma 3, tied Llamas) is quantized once for the matmul, and the
    embedding is swapped for a lookup into the quantized copy, so the float table is released."""
    from torch import nn

    check_scheme(scheme)
    before = weight_bytes(model)
    if scheme in ("none", "gguf"):
        return QuantSummary(scheme, 0, before, before)
    if scheme == "gguf-q8":  # the model was loaded with load_model(..., gguf_blocks=True)
        from tidal.quant.gguf_blocks import set_activations

        return QuantSummary(scheme, set_activations(model, "q8"), before, before)
    if scheme == "auto":
        raise ValueError("quantization='auto' must be resolved first (resolve_scheme)")
    impl = importlib.import_module(_SCHEME_MODULES[scheme])
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    tied = (
        isinstance(embed, nn.Embedding)
        and isinstance(head, nn.Linear)
        and head.weight is embed.weight
    )
    count = 0
    # A scheme may keep the LM head at higher precision than the rest (int4 does, like GGUF's
    # Q4_K_M keeps token_embd at Q8_0/Q6_K): every logit over a 262k vocabulary reads it.
    quantize_head = getattr(impl, "quantize_head", impl.quantize_linear)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                is_head = parent is model and name == "lm_head"
                setattr(parent, name, (quantize_head if is_head else impl.quantize_linear)(child))
                count += 1
    if tied:
        assert inner is not None and isinstance(embed, nn.Embedding)
        inner.embed_tokens = impl.quantize_tied_embedding(model.lm_head, embed)
    return QuantSummary(scheme, count, before, weight_bytes(model))
