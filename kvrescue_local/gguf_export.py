"""Write qwen2-architecture GGUF files from numpy weights.

Used for the tiny models of the tests and the offline demo (random weights
from a seed), and by the exporters of trained or converted checkpoints.
The tokenizer is byte level in Qwen's GPT-2 byte-unicode form: token id b is
byte b, then a few merges, then the chat control tokens (docs/design.md §7).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<extra_0>")
# llama.cpp refuses a BPE vocabulary without merges; "\n\n" as one token also
# makes the step separator a single token, as in Qwen's real vocabulary.
MERGES = ("Ċ Ċ", "Ġ Ġ")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5


@dataclass(frozen=True)
class Vocab:
    """A GPT-2-style BPE vocabulary as llama.cpp reads it from GGUF."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    bos: str = "<|endoftext|>"
    eos: str = "<|im_end|>"
    pre: str = "qwen2"


def byte_vocab() -> Vocab:
    """Byte-level vocabulary: id b is byte b, then the merges, then the control tokens."""
    table = byte_to_unicode()
    tokens = [table[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES]
    types = [TOKEN_NORMAL] * len(tokens) + [TOKEN_CONTROL] * len(CONTROL_TOKENS)
    return Vocab(tokens + list(CONTROL_TOKENS), types, list(MERGES))


@dataclass(frozen=True)
class Qwen2Shape:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


TINY_BASE = Qwen2Shape(n_embd=128, n_layer=4, n_head=4, n_head_kv=2, n_ff=256)
TINY_HELPER = Qwen2Shape(n_embd=64, n_layer=2, n_head=2, n_head_kv=1, n_ff=128)


def n_vocab() -> int:
    return len(byte_vocab().tokens)


def qwen2_tensor_shapes(shape: Qwen2Shape) -> dict[str, tuple[int, ...]]:
    """The GGUF tensor names of llama.cpp's qwen2 and their HF (out, in) shapes, for the byte vocabulary with the
    output layer tied to the embedding; the RMS norms' names end in "norm.weight"."""
    d, kv = shape.n_embd, shape.n_head_kv * shape.head_dim
    shapes = {"token_embd.weight": (n_vocab(), d), "output_norm.weight": (d,)}
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": (d,),
            p + "attn_q.weight": (d, d), p + "attn_q.bias": (d,),
            p + "attn_k.weight": (kv, d), p + "attn_k.bias": (kv,),
            p + "attn_v.weight": (kv, d), p + "attn_v.bias": (kv,),
            p + "attn_output.weight": (d, d),
            p + "ffn_norm.weight": (d,),
            p + "ffn_gate.weight": (shape.n_ff, d),
            p + "ffn_up.weight": (shape.n_ff, d),
            p + "ffn_down.weight": (d, shape.n_ff),
        })
    return shapes


def random_qwen2_weights(shape: Qwen2Shape, seed: int, scale: float = 0.08) -> dict[str, np.ndarray]:
    """Random weights with the GGUF tensor names of llama.cpp's qwen2, in HF (out, in) layout; norms at 1."""
    rng = np.random.default_rng(seed)
    return {name: np.ones(dims, np.float32) if name.endswith("norm.weight")
            else (rng.standard_normal(dims) * scale).astype(np.float32)
            for name, dims in qwen2_tensor_shapes(shape).items()}


def write_qwen2_gguf(path: str | Path, shape: Qwen2Shape, weights, vocab: Vocab | None = None,
                     name: str = "tiny", dtype: str = "f32", metadata: dict[str, str] | None = None) -> Path:
    """Write a loadable qwen2 GGUF, one tensor at a time.

    weights maps GGUF tensor names to arrays or to objects with `.shape` and `.load()` (lazy
    checkpoint tensors), in HF (out, in) layout; output.weight absent means tied to token_embd.
    dtype "f16" stores matrices in half precision (norms and biases stay f32, as llama.cpp expects).
    """
    import gguf  # gguf-py; imported here so that reading GGUFs never needs it

    if dtype not in ("f32", "f16"):
        raise ValueError(f"dtype must be f32 or f16, not {dtype!r}")
    vocab = vocab or byte_vocab()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name(name)
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.tokens.index(vocab.bos))
    writer.add_eos_token_id(vocab.tokens.index(vocab.eos))
    writer.add_pad_token_id(vocab.tokens.index(vocab.bos))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)
    for key, value in (metadata or {}).items():
        writer.add_string(key, value)

    def stored_dtype(ndim: int) -> np.dtype:
        return np.dtype(np.float16 if dtype == "f16" and ndim == 2 else np.float32)

    for tensor_name, tensor in weights.items():
        out = stored_dtype(len(tensor.shape))
        writer.add_tensor_info(tensor_name, tuple(tensor.shape), out, int(np.prod(tensor.shape)) * out.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in weights.values():
        array = np.asarray(tensor.load() if hasattr(tensor, "load") else tensor, dtype=np.float32)
        writer.write_tensor_data(np.ascontiguousarray(array.astype(stored_dtype(array.ndim))))
    writer.close()
    return path


def write_tiny_model(path: str | Path, shape: Qwen2Shape, seed: int) -> Path:
    return write_qwen2_gguf(path, shape, random_qwen2_weights(shape, seed), name=f"tiny-seed{seed}")
