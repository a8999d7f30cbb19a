"""The vision encoder (SigLIP, pixel shuffle, connector) as a Core ML program of its own: one frame in, its image
tokens' rows out, fp16, static shapes, no state.

Program: input `patches` (1, 3 * p * p, 1, P) fp16, one normalised frame cut into its patches on the host
(engine.backends.coreml.vision.frame_patches, a reshape); output `features` (1, C, 1, N), C the text model's width, N
the frame's image tokens (the host transposes it to (N, C), the rows `engine.vision.model.ImageEmbedding` gives the
text model).

ANE layout, as the text model's chunks (coreml.wrapper):
- channels-first (1, E, 1, P) for the whole encoder: the patch embedding a 1x1 convolution over the host's patches
  (a strided convolution is one the reference interpreter does not run, and the ANE gains nothing from it), every
  linear a 1x1 convolution (`ConvProj`), so no transposes around the projections;
- LayerNorm over channels as the text wrapper's norms do it: the one `layer_norm` op over the last axis of the
  transposed (1, P, 1, E), then back;
- attention over all patches of the frame (bidirectional, no mask), heads batched as (1, H, P, D) x (1, H, D, P)
  with one softmax over the last axis, the text chunks' form; the scale is folded into q before the product, so
  scores stay small in fp16;
- the pixel shuffle as reshapes and transposes of rank <= 4 on (1, P, E), then channels-first again for the
  connector's 1x1 convolution; E * scale^2 (12,288 for SmolVLM) stays under the ANE's 16,384 per dimension.

The tower is taken by its Hugging Face module names (`vision_model.`, `connector.`, its `config`): engine.vision is
not a package the converter imports (tests/import_graph.py's FACES).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from coreml.wrapper import ConvProj
from engine.backends.coreml.errors import ConversionError
from engine.backends.coreml.vision import ENCODER_INPUT, ENCODER_OUTPUT


class ChannelLayerNorm(nn.Module):
    """LayerNorm over the channel axis of (1, E, 1, P): the `layer_norm` op on the transposed tensor."""

    def __init__(self, norm: nn.LayerNorm) -> None:
        super().__init__()
        self.eps = float(norm.eps)
        self.channels = int(norm.weight.shape[0])
        self.weight = nn.Parameter(norm.weight.detach().half().clone(), requires_grad=False)
        self.bias = nn.Parameter(norm.bias.detach().half().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (1, E, 1, P) -> (1, E, 1, P)
        y = F.layer_norm(x.transpose(1, 3), (self.channels,), self.weight, self.bias, self.eps)  # (1, P, 1, E)
        return y.transpose(1, 3)


class EncoderLayer(nn.Module):
    def __init__(self, layer: Any, heads: int, patches: int, approximate: str) -> None:
        super().__init__()
        # Shapes as constants: the program's shapes are static (a traced x.shape would become runtime ops).
        self.e, self.p = int(layer.layer_norm1.weight.shape[0]), patches
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = ChannelLayerNorm(layer.layer_norm1), ChannelLayerNorm(layer.layer_norm2)
        self.q, self.k, self.v, self.o = (ConvProj(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj))
        self.fc1, self.fc2 = ConvProj(mlp.fc1), ConvProj(mlp.fc2)
        self.heads = heads
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (1, E, 1, P) -> (1, E, 1, P)
        e, p = self.e, self.p
        h, d = self.heads, self.e // self.heads
        hn = self.norm1(x)
        q = (self.q(hn) * (1.0 / math.sqrt(d))).reshape(1, h, d, p).transpose(2, 3)  # (1, H, P, D)
        k = self.k(hn).reshape(1, h, d, p)  # (1, H, D, P)
        v = self.v(hn).reshape(1, h, d, p).transpose(2, 3)  # (1, H, P, D)
        probs = torch.softmax(torch.matmul(q, k), dim=-1)  # (1, H, P, P), every patch sees every other
        o = torch.matmul(probs, v).transpose(2, 3).reshape(1, e, 1, p)  # (1, E, 1, P)
        x = x + self.o(o)
        y: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate=self.approximate))
        return y


class EncoderProgram(nn.Module):
    """The tower in the ANE layout, fp16: patches (1, 3 * p * p, 1, P) -> (1, C, 1, N)."""

    def __init__(self, tower: nn.Module) -> None:
        super().__init__()
        cfg: Any = tower.config
        vm: Any = tower.vision_model
        patch = vm.embeddings.patch_embedding  # (E, 3, p, p): as a linear over a patch's 3 * p * p values
        as_linear = nn.Linear(patch.weight[0].numel(), patch.weight.shape[0])
        as_linear.weight, as_linear.bias = nn.Parameter(patch.weight.detach().flatten(1)), patch.bias
        self.embed = ConvProj(as_linear)
        self.patch = int(cfg.patch_size)
        self.e, self.side = int(cfg.hidden_size), int(cfg.image_size) // int(cfg.patch_size)
        positions = vm.embeddings.position_embedding.weight.detach()  # (P, E)
        self.positions = nn.Parameter(positions.t().half()[None, :, None, :].clone(), requires_grad=False)
        approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"
        heads = int(cfg.num_attention_heads)
        self.layers = nn.ModuleList(
            EncoderLayer(layer, heads, self.side**2, approximate) for layer in vm.encoder.layers
        )
        self.post_norm = ChannelLayerNorm(vm.post_layernorm)
        self.scale = int(cfg.scale_factor)
        connector: Any = tower.connector
        self.proj = ConvProj(connector.modality_projection.proj)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # (1, 3 * p * p, 1, P) -> (1, C, 1, N)
        e, side = self.e, self.side
        x = self.embed(patches) + self.positions  # (1, E, 1, P)
        for layer in self.layers:
            x = layer(x)
        x = self.post_norm(x)
        # Idefics3's pixel shuffle (engine.vision.siglip.pixel_shuffle) on (side, side / s, E * s) pieces
        s = self.scale
        t = x.reshape(e, side * side).transpose(0, 1)  # (P, E)
        t = t.reshape(side, side // s, e * s).transpose(0, 1)  # (side / s, side, E * s)
        t = t.reshape(side // s, side // s, e * s * s).transpose(0, 1)  # (side / s, side / s, E * s^2)
        t = t.reshape(1, (side // s) ** 2, 1, e * s * s).transpose(1, 3)  # (1, E * s^2, 1, N)
        out: torch.Tensor = self.proj(t)
        return out


def convert_encoder(tower: nn.Module, out: Path) -> Path:
    """`tower` (an engine.vision.siglip.VisionTower, fp32) as the Core ML program `out` (.mlpackage), fp16, for a
    macOS 15 Core ML. Needs coremltools (no Core ML runtime: it converts on any OS). ConversionError in one
    sentence when coremltools cannot convert it."""
    import coremltools as ct

    program = EncoderProgram(tower).eval()
    example = torch.zeros(1, 3 * program.patch**2, 1, program.side**2, dtype=torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=torch.jit.TracerWarning)  # type: ignore[attr-defined]
        with torch.no_grad():
            traced = torch.jit.trace(program.float(), example.float())  # type: ignore[no-untyped-call]
    try:
        mlmodel = ct.convert(
            traced,
            inputs=[ct.TensorType(name=ENCODER_INPUT, shape=tuple(example.shape), dtype=np.float16)],
            outputs=[ct.TensorType(name=ENCODER_OUTPUT, dtype=np.float16)],
            minimum_deployment_target=ct.target.macOS15,
            compute_precision=ct.precision.FLOAT16,
            convert_to="mlprogram",
            skip_model_load=True,  # no Core ML runtime needed (and none on Linux)
        )
    except Exception as exc:
        first = str(exc).splitlines()[0][:160] if str(exc) else exc.__class__.__name__
        raise ConversionError(f"Core ML conversion of the vision encoder failed: {first}.") from None
    mlmodel.save(str(out))
    return out
