"""Tiny Hugging Face-format PRM checkpoints and a direct numpy forward of them (the reference)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from kvrescue_local.gguf_export import CONTROL_TOKENS, byte_vocab

HIDDEN, LAYERS, HEADS, KV_HEADS, FF = 64, 2, 4, 2, 128
VOCAB_SIZE = 272  # padded beyond the tokenizer, as Qwen's configs are


def to_bf16(a: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16, returned as float32 values."""
    bits = a.astype(np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        if dtype == "BF16":
            raw = (to_bf16(array).view(np.uint32) >> 16).astype(np.uint16).tobytes()
        else:
            raw = array.astype(np.float32).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def write_tokenizer(out: Path) -> None:
    vocab = byte_vocab()
    n_plain = len(vocab.tokens) - len(CONTROL_TOKENS)
    tokenizer = {
        "model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(vocab.tokens[:n_plain])},
                  "merges": vocab.merges},
        "added_tokens": [{"id": n_plain + i, "content": t, "special": True} for i, t in enumerate(CONTROL_TOKENS)],
    }
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|im_end|>"}))


def write_prm_checkpoint(out: Path, fmt: str, seed: int, hidden: int = HIDDEN, dtype: str = "F32",
                         drop: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Write config.json, model.safetensors and the tokenizer; returns the weights as stored."""
    rng = np.random.default_rng(seed)
    head_dim = hidden // HEADS

    def w(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    t = {"model.embed_tokens.weight": w(VOCAB_SIZE, hidden), "model.norm.weight": 1 + w(hidden)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t.update({
            p + "input_layernorm.weight": 1 + w(hidden), p + "post_attention_layernorm.weight": 1 + w(hidden),
            p + "self_attn.q_proj.weight": w(hidden, hidden), p + "self_attn.q_proj.bias": w(hidden),
            p + "self_attn.k_proj.weight": w(KV_HEADS * head_dim, hidden), p + "self_attn.k_proj.bias": w(KV_HEADS * head_dim),
            p + "self_attn.v_proj.weight": w(KV_HEADS * head_dim, hidden), p + "self_attn.v_proj.bias": w(KV_HEADS * head_dim),
            p + "self_attn.o_proj.weight": w(hidden, hidden),
            p + "mlp.gate_proj.weight": w(FF, hidden), p + "mlp.up_proj.weight": w(FF, hidden),
            p + "mlp.down_proj.weight": w(hidden, FF),
        })
    if fmt == "qwen-prm":
        t.update({"score.0.weight": w(hidden, hidden) * 5, "score.0.bias": w(hidden),
                  "score.2.weight": w(2, hidden) * 5, "score.2.bias": w(2)})
        arch = "Qwen2ForProcessRewardModel"
    else:
        t.update({"lm_head.weight": w(VOCAB_SIZE, hidden), "v_head.summary.weight": w(1, hidden) * 5,
                  "v_head.summary.bias": w(1)})
        arch = "Qwen2ForCausalLM"
    for name in drop:
        t.pop(name)
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [arch], "model_type": "qwen2", "hidden_size": hidden, "intermediate_size": FF,
              "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
              "vocab_size": VOCAB_SIZE, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(config))
    write_safetensors(out / "model.safetensors", t, dtype)
    write_tokenizer(out)
    return {k: to_bf16(v) if dtype == "BF16" else v for k, v in t.items()}


def rms_norm(x, weight, eps=1e-6):
    return x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * weight


def rope(x, positions, theta=10000.0):
    """HF Qwen2 rotary embedding (rotate_half) on [tokens, heads, head_dim]."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angles = positions[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(angles)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(angles)] * 2, -1)[:, None, :]
    rotated = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rotated * sin


def hidden_states(t: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    """Final-norm hidden states of every token (causal attention), in float64."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    x = t["model.embed_tokens.weight"][ids]
    n, hidden = x.shape
    head_dim = hidden // HEADS
    pos = np.arange(n, dtype=np.float64)
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        h = rms_norm(x, t[p + "input_layernorm.weight"])
        q = (h @ t[p + "self_attn.q_proj.weight"].T + t[p + "self_attn.q_proj.bias"]).reshape(n, HEADS, head_dim)
        k = (h @ t[p + "self_attn.k_proj.weight"].T + t[p + "self_attn.k_proj.bias"]).reshape(n, KV_HEADS, head_dim)
        v = (h @ t[p + "self_attn.v_proj.weight"].T + t[p + "self_attn.v_proj.bias"]).reshape(n, KV_HEADS, head_dim)
        q, k = rope(q, pos), rope(k, pos)
        k = np.repeat(k, HEADS // KV_HEADS, axis=1)
        v = np.repeat(v, HEADS // KV_HEADS, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(head_dim) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", scores, v).reshape(n, hidden)
        x = x + attn @ t[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, t[p + "post_attention_layernorm.weight"])
        gate = h @ t[p + "mlp.gate_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    return rms_norm(x, t["model.norm.weight"])


def reference_rewards(t: dict[str, np.ndarray], fmt: str, ids: np.ndarray, flags: np.ndarray) -> np.ndarray:
    h = hidden_states(t, ids)[flags]
    if fmt == "qwen-prm":
        z = np.maximum(h @ t["score.0.weight"].T + t["score.0.bias"], 0) @ t["score.2.weight"].T + t["score.2.bias"]
        return 1 / (1 + np.exp(z[:, 0] - z[:, 1]))
    z = h @ t["v_head.summary.weight"].T + t["v_head.summary.bias"]
    return 1 / (1 + np.exp(-z[:, 0]))
