"""A qwen2 decoder in torch (training only: import this module only where torch is installed).

The math is llama.cpp's qwen2: RMSNorm, NEOX (rotate-half) RoPE, grouped-query attention with biases
on q/k/v only, SwiGLU MLP, embeddings tied to the output. `gguf_weights` names the tensors as
kvrescue_local.gguf_export.write_qwen2_gguf expects them.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..gguf_export import Qwen2Shape


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Block(nn.Module):
    def __init__(self, s: Qwen2Shape) -> None:
        super().__init__()
        hd = s.head_dim
        self.s = s
        self.attn_norm = RMSNorm(s.n_embd, s.rms_eps)
        self.q = nn.Linear(s.n_embd, s.n_head * hd)
        self.k = nn.Linear(s.n_embd, s.n_head_kv * hd)
        self.v = nn.Linear(s.n_embd, s.n_head_kv * hd)
        self.o = nn.Linear(s.n_head * hd, s.n_embd, bias=False)
        self.ffn_norm = RMSNorm(s.n_embd, s.rms_eps)
        self.gate = nn.Linear(s.n_embd, s.n_ff, bias=False)
        self.up = nn.Linear(s.n_embd, s.n_ff, bias=False)
        self.down = nn.Linear(s.n_ff, s.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        s, (b, t, _) = self.s, x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, s.n_head, s.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, s.n_head_kv, s.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, s.n_head_kv, s.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = s.n_head // s.n_head_kv  # query head i reads kv head i // rep, as in llama.cpp
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Qwen2(nn.Module):
    def __init__(self, shape: Qwen2Shape, n_vocab: int) -> None:
        super().__init__()
        self.shape = shape
        self.embed = nn.Embedding(n_vocab, shape.n_embd)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.n_layer))
        self.norm = RMSNorm(shape.n_embd, shape.rms_eps)
        inv = 1.0 / shape.rope_theta ** (torch.arange(0, shape.head_dim, 2).float() / shape.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / (2 * shape.n_layer) ** 0.5 if name.endswith(("o.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states after the output norm (what llama.cpp returns as embeddings)."""
        angles = torch.arange(ids.shape[1], dtype=torch.float32)[:, None] * self.inv_freq[None]
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hidden(ids) @ self.embed.weight.T

    def gguf_weights(self) -> dict[str, np.ndarray]:
        def a(t: torch.Tensor) -> np.ndarray:
            return t.detach().float().cpu().numpy()

        out = {"token_embd.weight": a(self.embed.weight), "output_norm.weight": a(self.norm.weight)}
        for i, blk in enumerate(self.blocks):
            p = f"blk.{i}."
            out.update({p + "attn_norm.weight": a(blk.attn_norm.weight),
                        p + "attn_q.weight": a(blk.q.weight), p + "attn_q.bias": a(blk.q.bias),
                        p + "attn_k.weight": a(blk.k.weight), p + "attn_k.bias": a(blk.k.bias),
                        p + "attn_v.weight": a(blk.v.weight), p + "attn_v.bias": a(blk.v.bias),
                        p + "attn_output.weight": a(blk.o.weight), p + "ffn_norm.weight": a(blk.ffn_norm.weight),
                        p + "ffn_gate.weight": a(blk.gate.weight), p + "ffn_up.weight": a(blk.up.weight),
                        p + "ffn_down.weight": a(blk.down.weight)})
        return out


class PRMModel(nn.Module):
    """A backbone and a qwen-prm style reward head: Linear(d, d) -> ReLU -> Linear(d, 2)."""

    def __init__(self, backbone: Qwen2) -> None:
        super().__init__()
        d = backbone.shape.n_embd
        self.backbone = backbone
        self.head = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone.hidden(ids))

    def reward_head(self, format_name: str):
        from ..prm import RewardHead

        layers = [self.head[0], self.head[2]]
        return RewardHead([l.weight.detach().numpy().copy() for l in layers],
                          [l.bias.detach().numpy().copy() for l in layers], format_name)
