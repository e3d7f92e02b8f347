"""A loaded GGUF model and its vocabulary."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from ..errors import KVRescueError
from .. import interrupts
from .lib import device_list, llama, load_progress, patched

GGUF_MAGIC = b"GGUF"


def check_gguf_file(path: Path) -> Path:
    """Fail with a one-line fix before llama.cpp sees a path that cannot be a GGUF."""
    if not path.exists():
        raise KVRescueError(f"GGUF file not found: {path}; pass the path of an existing .gguf file or a preset name")
    if path.is_dir():
        raise KVRescueError(f"{path} is a directory; pass the .gguf file inside it")
    if not path.is_file():  # read, a FIFO would block (llama.cpp's load too) and a device never end
        raise KVRescueError(f"{path} is not a regular file (a FIFO, device or socket); pass the path of a .gguf file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise KVRescueError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
                            "download it again or convert the checkpoint to GGUF")
    return path


@dataclass
class Model:
    """A llama.cpp model; free() releases it (also done when garbage-collected)."""

    path: Path
    n_gpu_layers: int = 0
    rpc: tuple[str, ...] = ()  # RPC servers (host:port) its offloaded layers go to, instead of local devices
    devices: tuple[str, ...] = ()  # local devices (e.g. CUDA0) its offloaded layers go to; () = llama.cpp's choice
    handle: ctypes.c_void_p = field(init=False, repr=False)
    vocab: ctypes.c_void_p = field(init=False, repr=False)

    def __post_init__(self) -> None:
        low = llama()
        patched()  # refuse a stock build before loading anything
        self.path = check_gguf_file(Path(self.path))
        params = low.llama_model_default_params()
        params.n_gpu_layers = self.n_gpu_layers
        if self.rpc:
            from .rpc import rpc_devices

            params.devices = ctypes.cast(rpc_devices(self.rpc), ctypes.c_void_p)
        elif self.devices:
            chosen = device_list(self.devices)  # llama.cpp copies the list while loading
            params.devices = ctypes.cast(chosen, ctypes.c_void_p)
        params.progress_callback = load_progress
        self.handle = low.llama_model_load_from_file(str(self.path).encode(), params)
        interrupts.raise_pending()  # a Ctrl-C during the load stopped it
        if not self.handle:
            raise KVRescueError(f"llama.cpp could not load {self.path}: the file is truncated, corrupt or of an "
                                "architecture this llama.cpp does not know; download or convert it again")
        self.vocab = low.llama_model_get_vocab(self.handle)
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}

    def free(self) -> None:
        if getattr(self, "handle", None):
            llama().llama_model_free(self.handle)
            self.handle = None

    def __del__(self) -> None:
        self.free()

    # --- model constants -------------------------------------------------
    @property
    def name(self) -> str:
        """The file's name, as messages name a model."""
        return self.path.name

    @property
    def n_vocab(self) -> int:
        return llama().llama_vocab_n_tokens(self.vocab)

    @cached_property
    def longest_token_bytes(self) -> int:
        """The most bytes one token spells: a text of B bytes takes at least B / this many tokens (read once, from
        every token of the vocabulary)."""
        return max(len(self.detokenize_bytes([token])) for token in range(self.n_vocab))

    @property
    def n_embd(self) -> int:
        return llama().llama_model_n_embd(self.handle)

    @property
    def n_layer(self) -> int:
        return llama().llama_model_n_layer(self.handle)

    @property
    def n_params(self) -> int:
        return llama().llama_model_n_params(self.handle)

    @property
    def n_head(self) -> int:
        return llama().llama_model_n_head(self.handle)

    @property
    def n_head_kv(self) -> int:
        return llama().llama_model_n_head_kv(self.handle)

    @cached_property
    def n_embd_k_gqa(self) -> int:
        """Width of one K row: the key head size (the GGUF's key_length, else n_embd / n_head) times the KV heads."""
        head_k = self.n_embd // self.n_head
        arch = self.metadata("general.architecture")
        key_length = self.metadata(f"{arch}.attention.key_length") if arch else None
        if key_length:
            head_k = int(key_length)
        return head_k * self.n_head_kv

    @property
    def n_ctx_train(self) -> int:
        return llama().llama_model_n_ctx_train(self.handle)

    @property
    def supports_partial_removal(self) -> bool:
        """Eviction needs `seq_rm` of a middle range, which recurrent and hybrid memories refuse."""
        low = llama()
        return not (low.llama_model_is_recurrent(self.handle) or low.llama_model_is_hybrid(self.handle))

    def describe(self) -> str:
        buf = ctypes.create_string_buffer(256)
        llama().llama_model_desc(self.handle, buf, len(buf))
        return buf.value.decode()

    def metadata(self, key: str) -> str | None:
        """A GGUF metadata value as text (None when the file has no such key)."""
        size = llama().llama_model_meta_val_str(self.handle, key.encode(), None, 0)
        if size < 0:
            return None
        buf = ctypes.create_string_buffer(size + 1)
        llama().llama_model_meta_val_str(self.handle, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    # --- vocabulary ------------------------------------------------------
    @property
    def bos(self) -> int:
        return llama().llama_vocab_bos(self.vocab)

    @property
    def eos(self) -> int:
        return llama().llama_vocab_eos(self.vocab)

    def is_eog(self, token: int) -> bool:
        """Whether token ends a generation (cached: called for every sampled token)."""
        eog = self._eog.get(token)
        if eog is None:
            eog = self._eog[token] = bool(llama().llama_vocab_is_eog(self.vocab, token))
        return eog

    def tokenize(self, text: str, special: bool = True, add_special: bool = False) -> np.ndarray:
        """Token ids of text; with special=True control tokens written in the text (<|im_start|>) are parsed, with
        add_special=True the vocabulary's own BOS/EOS are added where it asks for them (prompts carry their own)."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        out = (ctypes.c_int32 * capacity)()
        n = llama().llama_tokenize(self.vocab, data, len(data), out, capacity, add_special, special)
        if n < 0:
            raise KVRescueError(f"tokenizer needed {-n} tokens for {len(data)} bytes")
        return np.frombuffer(out, dtype=np.int32, count=n).copy()

    def detokenize(self, tokens, special: bool = True) -> str:
        return self.detokenize_bytes(tokens, special).decode("utf-8", "replace")

    def detokenize_bytes(self, tokens, special: bool = True) -> bytes:
        """Raw bytes: a byte-level token may hold half of a UTF-8 character."""
        ids = np.ascontiguousarray(tokens, dtype=np.int32)
        arr = ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        capacity = max(64, 16 * len(ids))
        while True:
            buf = ctypes.create_string_buffer(capacity)
            n = llama().llama_detokenize(self.vocab, arr, len(ids), buf, capacity, False, special)
            if n >= 0:
                return buf.raw[:n]
            capacity = -n

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token (cached: called for every sampled token)."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.detokenize_bytes([token])
        return piece
