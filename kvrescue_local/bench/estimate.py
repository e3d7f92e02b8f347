"""KV memory and decode compute per sequence against context length (the paper's Figure 8).

Formulas (per sequence, per decoded token, at a context of `ctx` tokens):
  KV bytes per token  = 2 · L · h_kv · d_head · bytes_per_elem        (K and V, every layer)
  KV bytes            = entries held · KV bytes per token
      full-KV base and helper hold every entry (ctx); the evicted base holds at most
      budget + buffer entries (it grows to budget + buffer, then evicts back to budget).
  FLOPs per token     = 2 · P_matmul + 4 · L · h · d_head · entries held
      2 · P_matmul: one multiply-add per weight that multiplies the token's activations (all weights but
      the token-embedding table, which is a lookup; with tied embeddings it is the output head and counts);
      4 · L · h · d_head · n: attention over n cached entries, Q·K^T and A·V, 2 FLOPs per multiply-add each,
      with h the number of query heads (grouped-query attention shares K/V, not the arithmetic).
  base + helper       = evicted base + full-KV helper (both decode every round in kvrescue mode).

Model constants come from a GGUF header (`<arch>.block_count`, `.embedding_length`,
`.attention.head_count`, `.attention.head_count_kv`, `.attention.key_length`/`.value_length` when
present, parameters counted from the tensor shapes) or from the built-in Qwen2.5-Math shapes
(config.json of Qwen2.5-Math-1.5B/7B/72B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import KVRescueError
from ..files import check_input_file, check_writable, write_figure
from ..runtime.context import CACHE_TYPES

MIB = 1024 * 1024
DEFAULT_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
MAX_POSITIONS = 2 ** 31 - 1  # llama_pos is an int32


@dataclass(frozen=True)
class ModelSpec:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int  # key length per head
    n_params: int  # every weight in the file
    matmul_params: int  # weights multiplied per token (the token-embedding lookup excluded unless tied)
    value_dim: int | None = None  # value length per head when it differs from the key length

    def kv_bytes_per_token(self, type_k: str = "f16", type_v: str = "f16") -> float:
        """L·h_kv·(d_k·bytes per K element + d_v·bytes per V element), of llama.cpp's cache types (CACHE_TYPES)."""
        return self.n_layer * self.n_head_kv * (self.head_dim * CACHE_TYPES[type_k].element_bytes
                                                + (self.value_dim or self.head_dim) * CACHE_TYPES[type_v].element_bytes)

    def attention_flops(self, entries: float) -> float:
        return 4.0 * self.n_layer * self.n_head * self.head_dim * entries

    def flops_per_token(self, entries: float) -> float:
        return 2.0 * self.matmul_params + self.attention_flops(entries)


def qwen2_spec(name: str, n_layer: int, n_embd: int, n_head: int, n_head_kv: int, n_ff: int, n_vocab: int,
               tied: bool, head_dim: int = 128) -> ModelSpec:
    """Parameters of a Qwen2 decoder from its config.json shape (q/k/v with bias, o without, SwiGLU MLP)."""
    per_layer = (n_embd * n_head * head_dim + n_head * head_dim  # q + bias
                 + 2 * (n_embd * n_head_kv * head_dim + n_head_kv * head_dim)  # k, v + biases
                 + n_head * head_dim * n_embd  # o
                 + 3 * n_embd * n_ff  # gate, up, down
                 + 2 * n_embd)  # two RMS norms
    embedding = n_vocab * n_embd
    total = n_layer * per_layer + embedding + (0 if tied else embedding) + n_embd
    return ModelSpec(name, n_layer, n_embd, n_head, n_head_kv, head_dim, total, total if tied else total - embedding)


# config.json of Qwen/Qwen2.5-Math-{1.5B,7B,72B}
BUILTIN = {
    "1.5b": qwen2_spec("Qwen2.5-Math-1.5B", 28, 1536, 12, 2, 8960, 151936, tied=True),
    "7b": qwen2_spec("Qwen2.5-Math-7B", 28, 3584, 28, 4, 18944, 152064, tied=False),
    "72b": qwen2_spec("Qwen2.5-Math-72B", 80, 8192, 64, 8, 29568, 152064, tied=False),
}


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.contents()


def spec_from_gguf(path: str | Path, option: str = "the model") -> ModelSpec:
    """Model constants from a GGUF header and its tensor shapes (nothing is loaded into memory)."""
    path = Path(path)
    if not path.exists():
        raise KVRescueError(f"GGUF file not found: {path}; pass a .gguf path or one of {', '.join(BUILTIN)}")
    check_input_file(path, option, f"pass a .gguf path or one of {', '.join(BUILTIN)}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise KVRescueError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); pass a .gguf model "
                            f"or one of {', '.join(BUILTIN)}")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)
    except Exception as exc:  # gguf raises ValueError/struct errors of many kinds on a damaged file
        raise KVRescueError(f"cannot read the GGUF header of {path} ({type(exc).__name__}: {exc}); download or "
                            "convert the model again") from None
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise KVRescueError(f"{path} has no general.architecture: it is not a model GGUF")

    def number(key: str, required: bool = True):
        value = _field(reader, f"{arch}.{key}")
        if isinstance(value, list):  # per-layer values (e.g. head_count_kv of hybrid models): the largest
            value = max(value) if value else None
        if value is None and required:
            raise KVRescueError(f"{path} has no {arch}.{key}: it is not a transformer decoder this estimate knows "
                                "(pass 7b, 72b or 1.5b for the built-in Qwen2.5-Math shapes)")
        return None if value is None else int(value)

    n_layer, n_embd, n_head = number("block_count"), number("embedding_length"), number("attention.head_count")
    n_head_kv = number("attention.head_count_kv", required=False) or n_head
    head_dim = number("attention.key_length", required=False) or n_embd // n_head
    value_dim = number("attention.value_length", required=False)
    sizes = {t.name: int(t.n_elements) for t in reader.tensors}
    total = sum(sizes.values())
    tied = "output.weight" not in sizes
    matmul = total - (0 if tied else sizes.get("token_embd.weight", 0))
    name = _field(reader, "general.name") or path.stem
    return ModelSpec(str(name), n_layer, n_embd, n_head, n_head_kv, head_dim, total, matmul,
                     value_dim if value_dim and value_dim != head_dim else None)


def resolve_model(value: str | Path, option: str = "the model") -> ModelSpec:
    """A built-in name (7b, 72b, 1.5b; case and a 'qwen2.5-math-' prefix ignored) or a GGUF path."""
    text = str(value).strip()
    name = text.lower().removeprefix("qwen2.5-math-")
    if name in BUILTIN:
        return BUILTIN[name]
    path = Path(text)
    if path.suffix.lower() == ".gguf" or path.exists():
        return spec_from_gguf(path, option)
    raise KVRescueError(f"unknown model {text!r}: use one of {', '.join(BUILTIN)} or the path of a .gguf file")


def scaled(number: str, scale: int) -> int:
    """int(number * scale) of a decimal text such as '1.5'; ValueError for NaN and for an infinity (of 'inf', or
    of a number too large for a float, '1e400'), which int() would meet as an OverflowError."""
    value = float(number) * scale
    if not math.isfinite(value):
        raise ValueError(f"{number!r} is not a finite number")
    return int(value)


def parse_contexts(text: str) -> list[int]:
    """'1k,2k,4k' or '1024,2048' -> token counts (k = 1024), each at most llama.cpp's largest position."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            value = scaled(part[:-1], 1024) if part.endswith("k") else int(part)
        except ValueError:
            raise KVRescueError(f"context lengths are comma-separated tokens like 1k,2k,4096, not {text!r}") from None
        if value < 1:
            raise KVRescueError(f"context lengths must be positive (got {part!r})")
        if value > MAX_POSITIONS:
            raise KVRescueError(f"context length {part} is larger than the {MAX_POSITIONS:,} positions llama.cpp "
                                "can hold (a 32-bit llama_pos): give a smaller one")
        out.append(value)
    return out


@dataclass(frozen=True)
class Point:
    ctx: int
    full_kv: float  # bytes, full-KV base
    base_kv: float  # bytes, evicted base
    helper_kv: float  # bytes, full-KV helper
    full_flops: float  # per token
    base_flops: float
    helper_flops: float

    @property
    def rescue_kv(self) -> float:
        return self.base_kv + self.helper_kv

    @property
    def rescue_flops(self) -> float:
        return self.base_flops + self.helper_flops


@dataclass(frozen=True)
class Estimate:
    base: ModelSpec
    helper: ModelSpec
    budget: int
    buffer: int
    cache: tuple[str, str]  # the base's (K, V) cache types
    helper_cache: tuple[str, str]
    points: list[Point]

    def table(self, markdown: bool = False) -> str:
        from .report import Table

        headers = ["context", "full base KV MiB", "evicted base KV MiB", "helper KV MiB", "base+helper KV MiB",
                   "KV saving x", "full base GFLOP/tok", "base+helper GFLOP/tok", "compute ratio"]
        rows = [[f"{p.ctx:,}", f"{p.full_kv / MIB:,.1f}", f"{p.base_kv / MIB:,.1f}", f"{p.helper_kv / MIB:,.1f}",
                 f"{p.rescue_kv / MIB:,.1f}", f"{p.full_kv / p.rescue_kv:.2f}", f"{p.full_flops / 1e9:,.2f}",
                 f"{p.rescue_flops / 1e9:,.2f}", f"{p.rescue_flops / p.full_flops:.2f}"] for p in self.points]
        b, h = self.base, self.helper
        notes = [
            f"base {b.name}: L={b.n_layer} d={b.n_embd} h={b.n_head} h_kv={b.n_head_kv} d_head={b.head_dim}, "
            f"{b.n_params / 1e9:.2f}B params, KV {self.base.kv_bytes_per_token(*self.cache):,.0f} B/token "
            f"(K {self.cache[0]}, V {self.cache[1]})",
            f"helper {h.name}: L={h.n_layer} d={h.n_embd} h={h.n_head} h_kv={h.n_head_kv} d_head={h.head_dim}, "
            f"{h.n_params / 1e9:.2f}B params, KV {self.helper.kv_bytes_per_token(*self.helper_cache):,.0f} B/token "
            f"(K {self.helper_cache[0]}, V {self.helper_cache[1]})",
            f"per sequence; evicted base holds at most budget {self.budget} + "
            f"buffer {self.buffer} = {self.budget + self.buffer} entries; FLOPs/token = 2*matmul params + "
            "4*L*h*d_head*entries held (Q.K^T and A.V).",
        ]
        table = Table("KV memory and decode compute per sequence", headers, rows, ["r"] * len(headers), notes)
        return table.markdown() if markdown else table.text()

    def plot(self, path: str | Path) -> Path:
        try:
            from matplotlib.figure import Figure
        except ImportError:
            raise KVRescueError("plots need matplotlib: pip install 'kvrescue-local[plot]'") from None
        path = check_writable(path, "--plot")
        x = [p.ctx for p in self.points]
        fig = Figure(figsize=(10, 4), dpi=110)
        series = [
            ("KV cache per sequence (MiB)", [("full-KV base", [p.full_kv / MIB for p in self.points], "#333333", "-"),
                                             ("evicted base", [p.base_kv / MIB for p in self.points], "#7fb3e0", ":"),
                                             ("helper", [p.helper_kv / MIB for p in self.points], "#e08a1e", ":"),
                                             ("evicted base + helper", [p.rescue_kv / MIB for p in self.points],
                                              "#1f6fb2", "-")]),
            ("decode compute (GFLOP / token)", [("full-KV base", [p.full_flops / 1e9 for p in self.points], "#333333", "-"),
                                                ("evicted base + helper", [p.rescue_flops / 1e9 for p in self.points],
                                                 "#1f6fb2", "-")]),
        ]
        for i, (ylabel, lines) in enumerate(series):
            ax = fig.add_subplot(1, 2, i + 1)
            for label, ys, colour, style in lines:
                ax.plot(x, ys, marker="o", color=colour, linestyle=style, label=label)
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in x])
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"{self.base.name} (budget {self.budget}+{self.buffer}) + {self.helper.name} vs full-KV base")
        fig.tight_layout()
        return write_figure(fig, path, "--plot")


def estimate(base: ModelSpec, helper: ModelSpec, budget: int = 64, buffer: int = 128,
             cache: tuple[str, str] = ("f16", "f16"), helper_cache: tuple[str, str] | None = None,
             contexts=DEFAULT_CONTEXTS) -> Estimate:
    """`cache`: the base's (K, V) cache types, llama.cpp's names; the helper's are the same unless helper_cache."""
    if budget < 1 or buffer < 0:
        raise KVRescueError(f"budget must be at least 1 and buffer at least 0 (got {budget}, {buffer})")
    helper_cache = helper_cache or cache
    limit = budget + buffer
    per_token, helper_per_token = base.kv_bytes_per_token(*cache), helper.kv_bytes_per_token(*helper_cache)
    points = []
    for ctx in contexts:
        held = min(ctx, limit)
        points.append(Point(ctx, ctx * per_token, held * per_token, ctx * helper_per_token, base.flops_per_token(ctx),
                            base.flops_per_token(held), helper.flops_per_token(ctx)))
    return Estimate(base, helper, budget, buffer, cache, helper_cache, points)
