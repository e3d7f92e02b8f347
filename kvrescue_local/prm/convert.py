"""Convert a Hugging Face PRM checkpoint into a backbone GGUF plus a reward-head file.

Supported: Qwen2ForProcessRewardModel (Qwen2.5-Math-PRM; head `score.0` -> ReLU -> `score.2`,
format qwen-prm) and Qwen2 causal LMs with a value head `v_head.summary` (Skywork-o1-Open-PRM,
format value-head). The backbone is streamed tensor by tensor from the safetensors files, so a
7B checkpoint converts in bounded memory.
"""

from __future__ import annotations

import ctypes
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import KVRescueError
from ..files import check_input_file
from ..gguf_export import TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNUSED, TOKEN_USER_DEFINED, Qwen2Shape, Vocab, write_qwen2_gguf
from .head import RewardHead, head_path

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
QUANTIZATIONS = {"q8_0": 7, "q4_k_m": 15, "q4_0": 2}
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
HEADS = {
    # format: (tensor names of the linear layers in order)
    "qwen-prm": (("score.0.weight", "score.0.bias"), ("score.2.weight", "score.2.bias")),
    "value-head": (("v_head.summary.weight", "v_head.summary.bias"),),
}


@dataclass(frozen=True)
class SafeTensor:
    """One tensor of a safetensors file, read only when load() is called."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    def load(self) -> np.ndarray:
        raw = np.memmap(self.file, dtype=SAFETENSORS_DTYPES[self.dtype], mode="r", offset=self.start,
                        shape=self.shape)
        if self.dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return np.asarray(raw, dtype=np.float32)


def read_safetensors_index(path: Path) -> dict[str, SafeTensor]:
    size = check_input_file(path, "checkpoint file", "download the checkpoint again").stat().st_size
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if 8 + header_len > size:
                raise ValueError(f"its header claims {header_len} bytes")
            header = json.loads(f.read(header_len))
        base = 8 + header_len
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise KVRescueError(f"{path.name}: tensor {name} has dtype {info['dtype']}; only F32, F16 and BF16 "
                                    "convert")
            start, end = info["data_offsets"]
            if not 0 <= start <= end <= size - base:
                raise ValueError(f"tensor {name} lies outside the file")
            tensors[name] = SafeTensor(path, info["dtype"], tuple(info["shape"]), base + start, base + end)
    except (struct.error, ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise KVRescueError(f"{path} is not a readable safetensors file ({type(exc).__name__}: {exc}): download "
                            "the checkpoint again") from None
    return tensors


def read_checkpoint(src: Path) -> dict[str, SafeTensor]:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise KVRescueError(f"no .safetensors files in {src}: download the full checkpoint (not only config.json)")
    tensors: dict[str, SafeTensor] = {}
    for f in files:
        tensors.update(read_safetensors_index(f))
    # trl-style value-head models prefix the backbone with `pretrained_model.`
    return {k.removeprefix("pretrained_model."): v for k, v in tensors.items()}


def read_json(path: Path) -> dict:
    if not path.exists():
        raise KVRescueError(f"{path.name} is missing from {path.parent}: download the whole checkpoint directory")
    check_input_file(path, "checkpoint file", "download the checkpoint again")
    try:
        data = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KVRescueError(f"{path} is not JSON ({type(exc).__name__}): download the checkpoint again") from None
    if not isinstance(data, dict):
        raise KVRescueError(f"{path} holds a JSON {type(data).__name__}, not an object: download the checkpoint again")
    return data


def read_vocab(src: Path, vocab_size: int) -> Vocab:
    """The BPE vocabulary of tokenizer.json, padded to the model's vocab_size as llama.cpp expects."""
    tok = read_json(src / "tokenizer.json")
    model = tok.get("model", {})
    if model.get("type") != "BPE":
        raise KVRescueError(f"tokenizer.json of {src} is a {model.get('type')} tokenizer; only byte-level BPE converts")
    by_id = {i: t for t, i in model["vocab"].items()}
    types = {i: TOKEN_NORMAL for i in by_id}
    for added in tok.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        types[added["id"]] = TOKEN_CONTROL if added.get("special") else TOKEN_USER_DEFINED
    size = max(vocab_size, max(by_id) + 1)
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    token_types = [types.get(i, TOKEN_UNUSED) for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    config = read_json(src / "tokenizer_config.json") if (src / "tokenizer_config.json").exists() else {}
    bos = config.get("bos_token") or "<|endoftext|>"
    eos = config.get("eos_token") or "<|im_end|>"
    for name, token in (("bos", bos), ("eos", eos)):
        if token not in tokens:
            raise KVRescueError(f"tokenizer of {src} has no {name} token {token!r}")
    return Vocab(tokens, token_types, merges, bos=bos, eos=eos)


def detect_format(config: dict, tensors: dict[str, SafeTensor]) -> str:
    if "Qwen2ForProcessRewardModel" in config.get("architectures", []):
        return "qwen-prm"
    if "v_head.summary.weight" in tensors:
        return "value-head"
    raise KVRescueError(f"unknown PRM architecture {config.get('architectures')}: supported are "
                        "Qwen2ForProcessRewardModel (qwen-prm) and Qwen2 with a v_head.summary value head (value-head)")


def backbone_tensors(tensors: dict[str, SafeTensor], n_layer: int) -> dict[str, SafeTensor]:
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    for i in range(n_layer):
        names.update({f"blk.{i}.{dst}": f"model.layers.{i}.{src}" for src, dst in LAYER_NAMES.items()})
    missing = [src for src in names.values() if src not in tensors]
    if missing:
        raise KVRescueError(f"checkpoint is missing {len(missing)} backbone tensors, e.g. {', '.join(missing[:3])}: "
                            "the download is incomplete or this is not a Qwen2 model")
    return {dst: tensors[src] for dst, src in names.items()}


def convert_prm(src: str | Path, out: str | Path, dtype: str = "f16", quantize: str | None = None) -> Path:
    """Write OUT (backbone GGUF) and OUT's .head.npz; returns the GGUF path."""
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise KVRescueError(f"{src} is not a checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise KVRescueError(f"unknown quantization {quantize!r}: use one of {', '.join(QUANTIZATIONS)}")
    config = read_json(src / "config.json")
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing_keys = [k for k in needed if not isinstance(config.get(k), int)]
    if missing_keys:
        raise KVRescueError(f"config.json of {src} has no integer {', '.join(missing_keys)}: it is not a Qwen2 "
                            "checkpoint's config; download the checkpoint again")
    tensors = read_checkpoint(src)
    fmt = detect_format(config, tensors)
    missing = [n for layer in HEADS[fmt] for n in layer if n not in tensors]
    if missing:
        raise KVRescueError(f"checkpoint has no reward-head tensors {', '.join(missing)} for format {fmt}")
    shape = Qwen2Shape(n_embd=config["hidden_size"], n_layer=config["num_hidden_layers"],
                       n_head=config["num_attention_heads"], n_head_kv=config.get("num_key_value_heads", config["num_attention_heads"]),
                       n_ff=config["intermediate_size"], n_ctx_train=config.get("max_position_embeddings", 4096),
                       rope_theta=float(config.get("rope_theta", 10000.0)), rms_eps=float(config.get("rms_norm_eps", 1e-6)))
    vocab = read_vocab(src, config["vocab_size"])
    out.parent.mkdir(parents=True, exist_ok=True)
    unquantized = out.with_name(out.name + ".f16.tmp") if quantize else out
    write_qwen2_gguf(unquantized, shape, backbone_tensors(tensors, shape.n_layer), vocab=vocab, name=src.name,
                     dtype=dtype, metadata={"kvrescue.prm.format": fmt})
    if quantize:
        quantize_gguf(unquantized, out, quantize)
        unquantized.unlink()
    RewardHead([tensors[w].load() for w, _ in HEADS[fmt]], [tensors[b].load() for _, b in HEADS[fmt]], fmt).save(head_path(out))
    return out


def quantize_gguf(src: Path, dst: Path, quantize: str) -> None:
    from ..runtime import llama

    low = llama()
    params = low.llama_model_quantize_default_params()
    params.ftype = QUANTIZATIONS[quantize]
    if low.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise KVRescueError(f"llama.cpp could not quantize {src} to {quantize}")
