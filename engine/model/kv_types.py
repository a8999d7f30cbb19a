"""What the slot table holds its keys and values in: fp16 (the canonical KV dtype) or llama.cpp's q8_0 (blocks of
32 int8 codes with one fp16 scale, 34 bytes per 32 values: 53 % of fp16), as llama.cpp's --cache-type-k/v.

A q8_0 table is read as fp16 values, fp16(d * q): what the attention, the read copies, episodic memory, the L3
cache and session files all see. Quantizing those fp16 values again gives the same codes and scales (the scale is
snapped to the one that reproduces the block exactly, see `quantize_q8_0`), so paging a block out and back in, or
saving and restoring a conversation, leaves the table bit for bit as it was.
"""

from __future__ import annotations

from enum import Enum

import torch

Q8_BLOCK = 32  # values per q8_0 block (one fp16 scale each)


class KVType(Enum):
    F16 = "f16"
    Q8_0 = "q8_0"

    @classmethod
    def named(cls, name: str) -> KVType:
        """'f16' or 'q8_0' -> the KVType; ValueError naming the choices otherwise."""
        try:
            return cls(name.lower())
        except ValueError:
            raise ValueError(
                f"{name!r} is not a KV cache type here; choose one of {', '.join(t.value for t in cls)}"
            ) from None

    def bytes_per_value(self) -> float:
        return 2.0 if self is KVType.F16 else (Q8_BLOCK + 2) / Q8_BLOCK

    def fits(self, head_dim: int) -> str | None:
        """Why a model of this head dim cannot hold its KV in this type, or None when it can."""
        if self is KVType.Q8_0 and head_dim % Q8_BLOCK:
            return f"q8_0 keys and values need a head dim that is a multiple of {Q8_BLOCK}, not {head_dim}"
        return None


def _round(x: torch.Tensor) -> torch.Tensor:
    """Half away from zero, as C's roundf (llama.cpp's quantizer), not torch.round's half to even."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float, D a multiple of 32 -> codes (..., D) int8 and scales (..., D/32) fp16, as llama.cpp's
    quantize_row_q8_0 (d = amax / 127 in fp32, q = roundf(x / d), d stored as fp16). When x is already a q8_0
    block's fp16 reading that this does not reproduce (fp16(amax / 127) can land one fp16 step off the scale that
    made it), the scale among fp16(d) and its two neighbours that reproduces every value exactly is taken instead,
    so quantizing a table's own reading changes nothing."""
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // Q8_BLOCK, Q8_BLOCK)  # (..., n, 32)
    d32 = xb.abs().amax(-1) / 127  # (..., n)
    inv = torch.where(d32 > 0, 1 / d32.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    q = _round(xb * inv[..., None])  # (..., n, 32)
    d = d32.half()

    def exact(scale: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        return ((scale.float()[..., None] * codes).half().float() == xb).all(-1)  # (..., n)

    done = exact(d, q)
    bits = d.view(torch.int16)  # d >= 0: its neighbours are the bit patterns one down and one up
    below = torch.where(bits > 0, bits - 1, bits).view(torch.float16)
    above = torch.where(bits < 0x7BFF, bits + 1, bits).view(torch.float16)  # 0x7BFF: the largest finite fp16
    for scale in (d.clone(), below, above):
        s = scale.float()[..., None]  # (..., n, 1)
        codes = torch.where(s > 0, _round(xb / s.clamp(min=torch.finfo(torch.float32).tiny)), 0.0).clamp(-127, 127)
        take = ~done & exact(scale, codes)  # (..., n)
        d = torch.where(take, scale, d)
        q = torch.where(take[..., None], codes, q)
        done = done | take
    return q.to(torch.int8).reshape(x.shape), d


def dequantize_q8_0(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes (..., D) int8, scales (..., D/32) fp16 -> (..., D) fp16: fp16(d * q), the values the table holds."""
    qb = codes.float().reshape(*codes.shape[:-1], -1, Q8_BLOCK)  # (..., n, 32)
    return (qb * scales.float()[..., None]).half().reshape(codes.shape)
