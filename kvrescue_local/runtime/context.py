"""A llama.cpp context: multi-sequence batched decode and per-sequence KV memory.

Sequences are llama.cpp sequence ids; their positions are llama.cpp's own
(`seq_pos_max + 1` is the next one), so nothing here shadows the KV state.
"""

from __future__ import annotations

import ctypes
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import interrupts
from ..errors import KVRescueError
from .lib import llama, patched
from .model import Model

FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


@dataclass(frozen=True)
class CacheType:
    """A KV cache type of llama.cpp (its -ctk/-ctv name): the ggml type, and `block` values stored in `block_bytes`."""

    ggml_type: int
    block: int
    block_bytes: int

    @property
    def quantized(self) -> bool:
        return self.block > 1

    @property
    def element_bytes(self) -> float:
        return self.block_bytes / self.block


# the cache types llama.cpp's -ctk/-ctv accept (common/arg.cpp kv_cache_types), with ggml's sizes (ggml.c type_traits)
CACHE_TYPES = {"f32": CacheType(0, 1, 4), "f16": CacheType(1, 1, 2), "bf16": CacheType(30, 1, 2),
               "q8_0": CacheType(8, 32, 34), "q4_0": CacheType(2, 32, 18), "q4_1": CacheType(3, 32, 20),
               "iq4_nl": CacheType(20, 32, 18), "q5_0": CacheType(6, 32, 22), "q5_1": CacheType(7, 32, 24)}
# llama.cpp rounds n_ctx up to a multiple of this (docs/design.md §3)
N_CTX_PAD = 256


def default_threads() -> int:
    """llama.cpp threads when none are asked for: KVRESCUE_THREADS if set, else all physical cores but one."""
    value = os.environ.get("KVRESCUE_THREADS", "")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise KVRescueError(f"KVRESCUE_THREADS={value!r} is not a positive thread count: set it to 1 or more, or unset it")
        return int(value)
    return max(1, physical_cores() - 1)


def physical_cores() -> int:
    """Cores this process may run on, hyper-threads of one core counted once.

    Why not all of them: llama.cpp's threads busy-wait for each other at every barrier of a graph, so when
    one core is taken by another process, every decode waits on a descheduled thread (10-1000x slower,
    perf/contention_perf.py). One core left free absorbs a competing process at a small cost when idle."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return len(cores) or 1


def kv_bytes_per_cell(model: Model, type_k: str, type_v: str) -> int:
    """K and V of one position in every layer: L · h_kv · d_head · (bytes per K element + bytes per V element)."""
    values = model.n_layer * model.n_head_kv * head_dim(model)
    return int(values * CACHE_TYPES[type_k].element_bytes + values * CACHE_TYPES[type_v].element_bytes)


def head_dim(model: Model) -> int:
    return model.n_embd // model.n_head


def check_cache_types(type_k: str, type_v: str, flash_attn: str, option_k: str = "type_k",
                      option_v: str = "type_v") -> None:
    """Refuse what llama.cpp refuses, before any model loads: an unknown type, and a quantized V cache with flash
    attention off (llama.cpp stores V transposed without it, which quantized blocks cannot be)."""
    for option, name in ((option_k, type_k), (option_v, type_v)):
        if name not in CACHE_TYPES:
            raise KVRescueError(f"{option} {name!r} is not a KV cache type: use one of {', '.join(CACHE_TYPES)}")
    if CACHE_TYPES[type_v].quantized and flash_attn == "off":
        raise KVRescueError(f"{option_v} {type_v} quantizes the V cache, which llama.cpp allows only with flash "
                            f"attention: pass -fa on (or {option_v} f16)")


def check_cache_blocks(model: Model, type_k: str, type_v: str, option_k: str = "type_k",
                       option_v: str = "type_v") -> None:
    """Refuse, before a context is made, a quantized cache whose blocks do not tile a head of this model (llama.cpp
    refuses it with flash attention on and asserts with it off)."""
    for option, name in ((option_k, type_k), (option_v, type_v)):
        block = CACHE_TYPES[name].block
        if head_dim(model) % block:
            fits = ", ".join(n for n, t in CACHE_TYPES.items() if head_dim(model) % t.block == 0)
            raise KVRescueError(f"{option} {name} stores blocks of {block} values, which do not divide the head size "
                                f"{head_dim(model)} of {model.path.name}: use {fits} for this model")


# llama.cpp's CPU flash-attention kernel handles multi-sequence batches poorly (batched decode of 8
# candidates: 5.4x faster than 8 calls with it off, 1.9x with it on), so every context of the project
# (candidates, helper, PRM) starts with it off; `--flash-attn on|auto` for GPU builds.
DEFAULT_FLASH_ATTN = "off"


@dataclass(frozen=True)
class ContextParams:
    n_ctx: int = 4096
    n_seq_max: int = 1
    n_batch: int = 512
    kv_unified: bool = True  # every sequence sees all n_ctx cells; forks share cells
    flash_attn: str = DEFAULT_FLASH_ATTN
    type_k: str = "f16"  # llama.cpp's cache type names (CACHE_TYPES); "f32" for bit-parity tests
    type_v: str = "f16"
    embeddings: bool = False  # hidden states after the final norm (PRM backbones)
    n_threads: int = 0  # 0 = default_threads()


class Batch:
    """A llama_batch whose arrays are numpy-owned, so filling it is vectorised. A token may belong to up to
    `width` sequences (one cell they all hold: llama_batch's n_seq_id)."""

    def __init__(self, capacity: int, width: int = 1) -> None:
        low = llama()
        self.capacity = capacity
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.seq_id = np.zeros((capacity, width), np.int32)
        self.logits = np.zeros(capacity, np.int8)
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)()  # row i's address, written in one go:
        np.frombuffer(self._seq_ptrs, np.uintp)[:] = (  # a context per lane makes many of these
            self.seq_id.ctypes.data + self.seq_id.strides[0] * np.arange(capacity, dtype=np.uintp))
        self.struct = low.llama_batch()
        self.struct.token = self.token.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.embd = None
        self.struct.pos = self.pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)))
        self.struct.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, tokens: np.ndarray, positions: np.ndarray, seq_ids, outputs: np.ndarray) -> None:
        """seq_ids: one sequence per token (an array), or a tuple of sequences per token."""
        n = len(tokens)
        self.token[:n] = tokens
        self.pos[:n] = positions
        if isinstance(seq_ids, np.ndarray):
            self.seq_id[:n, 0] = seq_ids
            self.n_seq_id[:n] = 1
        else:
            for i, seqs in enumerate(seq_ids):
                self.seq_id[i, :len(seqs)] = seqs
                self.n_seq_id[i] = len(seqs)
        self.logits[:n] = outputs
        self.struct.n_tokens = n


class Context:
    """One llama.cpp context over a model; free() releases it."""

    def __init__(self, model: Model, params: ContextParams = ContextParams()) -> None:
        low = llama()
        if params.flash_attn not in FLASH_ATTN:
            raise KVRescueError(f"flash_attn must be one of {sorted(FLASH_ATTN)}, not {params.flash_attn!r}")
        check_cache_types(params.type_k, params.type_v, params.flash_attn)
        check_cache_blocks(model, params.type_k, params.type_v)
        if params.n_seq_max < 1:
            raise KVRescueError("n_seq_max must be at least 1")
        self.model = model
        self.params = params
        cp = low.llama_context_default_params()
        cp.n_ctx = params.n_ctx
        cp.n_batch = params.n_batch
        cp.n_ubatch = params.n_batch
        cp.n_seq_max = params.n_seq_max
        cp.kv_unified = params.kv_unified
        cp.flash_attn_type = FLASH_ATTN[params.flash_attn]
        cp.type_k = CACHE_TYPES[params.type_k].ggml_type
        cp.type_v = CACHE_TYPES[params.type_v].ggml_type
        cp.embeddings = params.embeddings
        if params.embeddings:
            cp.pooling_type = low.LLAMA_POOLING_TYPE_NONE
        threads = params.n_threads or default_threads()
        cp.n_threads = cp.n_threads_batch = threads
        self.handle = low.llama_init_from_model(model.handle, cp)
        interrupts.raise_pending()  # a Ctrl-C while llama.cpp logged its allocations
        if not self.handle:
            raise KVRescueError(f"llama.cpp could not create a context (n_ctx={params.n_ctx}, n_seq_max={params.n_seq_max}): "
                                "lower N (-n) or --max-tokens, or free memory")
        self.memory = low.llama_get_memory(self.handle)
        self.n_ctx = low.llama_n_ctx(self.handle)
        self.n_seq_max = params.n_seq_max
        self.n_vocab = model.n_vocab
        self.n_embd = model.n_embd
        self.batch = Batch(params.n_batch, params.n_seq_max)
        self.decode_seconds = 0.0  # wall time inside llama_decode, for cost reports
        self.decoded_tokens = 0  # tokens llama_decode was given, for cost reports and tests
        self.sample_seconds = 0.0  # wall time in llama.cpp's samplers (see Sampler.sample)
        self.memory_seconds = 0.0  # wall time in llama.cpp's memory and the patch's calls (see `call`)
        self._decode = low.llama_decode
        self._logits_ith = low.llama_get_logits_ith
        self._logits_all = low.llama_get_logits
        self.n_outputs = 0  # rows flagged for output in the last decode
        self._embeddings_ith = low.llama_get_embeddings_ith
        self._pos_max = low.llama_memory_seq_pos_max

    def free(self) -> None:
        if getattr(self, "handle", None):
            llama().llama_free(self.handle)
            self.handle = None

    def __del__(self) -> None:
        self.free()

    def call(self, function, *args):
        """function(*args), a llama.cpp or patch call, its wall time added to memory_seconds: with decoding and
        sampling, the whole of llama.cpp's share in cost reports (the engine's share is what is left)."""
        started = time.perf_counter()
        result = function(*args)
        self.memory_seconds += time.perf_counter() - started
        return result

    @property
    def llama_seconds(self) -> float:
        """Wall time inside llama.cpp on this context so far: decoding, sampling, memory and patch calls."""
        return self.decode_seconds + self.sample_seconds + self.memory_seconds

    # --- sequences -------------------------------------------------------
    def check_seq(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.n_seq_max:
            raise KVRescueError(f"sequence id {seq_id} needs n_seq_max >= {seq_id + 1}, but this context has "
                                f"n_seq_max={self.n_seq_max}: create it with a larger n_seq_max")

    def pos_max(self, seq_id: int) -> int:
        """Largest position seq_id holds, -1 when empty."""
        self.check_seq(seq_id)
        return self.call(self._pos_max, self.memory, seq_id)

    def fork(self, src: int, dst: int) -> None:
        """Make dst an exact copy of src; they share cells until they diverge."""
        self.check_seq(src)
        self.check_seq(dst)
        low = llama()
        self.call(low.llama_memory_seq_rm, self.memory, dst, -1, -1)
        self.call(low.llama_memory_seq_cp, self.memory, src, dst, -1, -1)

    def keep(self, seq_id: int) -> None:
        """Drop every other sequence (the winner of a round stays)."""
        self.check_seq(seq_id)
        self.call(llama().llama_memory_seq_keep, self.memory, seq_id)

    def drop(self, seq_id: int) -> None:
        self.check_seq(seq_id)
        self.call(llama().llama_memory_seq_rm, self.memory, seq_id, -1, -1)

    def remove(self, seq_id: int, p0: int, p1: int) -> None:
        """Remove positions [p0, p1) from seq_id; both bounds explicit (p1 < 0 would mean 'to the end')."""
        self.check_seq(seq_id)
        if not 0 <= p0 <= p1:
            raise KVRescueError(f"remove needs 0 <= p0 <= p1, got [{p0}, {p1})")
        if not self.call(llama().llama_memory_seq_rm, self.memory, seq_id, p0, p1):
            raise KVRescueError("this model's memory cannot remove a partial range (recurrent or hybrid model): "
                                "KV eviction needs a pure-attention model")

    def cells(self, seq_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(cell indices, positions) that seq_id holds, ordered by position (the patch's cell map)."""
        self.check_seq(seq_id)
        lib = patched()
        n = self.call(lib.llama_kvr_seq_cells, self.memory, seq_id, None, None, 0)
        if n == -1:
            raise KVRescueError("this context's memory is not a plain attention KV cache: the cell map needs one")
        cells = np.zeros(n, np.int32)
        pos = np.zeros(n, np.int32)
        self.call(lib.llama_kvr_seq_cells, self.memory, seq_id, cells.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                  pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n)
        return cells, pos

    def used_cells(self, seq_ids) -> int:
        """Cells held by any of seq_ids (forks share cells, so this is what they occupy together)."""
        held = np.zeros(self.n_ctx, bool)
        for s in seq_ids:
            held[self.cells(int(s))[0]] = True
        return int(np.count_nonzero(held))

    @property
    def kv_bytes_per_cell(self) -> int:
        return kv_bytes_per_cell(self.model, self.params.type_k, self.params.type_v)

    def n_cells(self, seq_id: int) -> int:
        """How many cells seq_id can attend to."""
        self.check_seq(seq_id)
        return self.call(patched().llama_kvr_seq_cells, self.memory, seq_id, None, None, 0)

    # --- decoding --------------------------------------------------------
    @contextmanager
    def hidden_states(self):
        """Decodes inside give hidden states (`embedding`) as well as logits, in a context made without
        embeddings=True. llama.cpp then outputs every token of a batch, so its other decodes stay without."""
        self.call(llama().llama_set_embeddings, self.handle, True)
        try:
            yield
        finally:
            self.call(llama().llama_set_embeddings, self.handle, self.params.embeddings)

    def decode(self, tokens, positions, seq_ids, outputs) -> None:
        """One llama_decode of at most n_batch tokens; rows flagged in outputs get logits (or embeddings). seq_ids:
        one sequence per token, or a tuple per token (a cell the sequences share: llama.cpp requires that they
        hold the same positions before it)."""
        n = len(tokens)
        if n > self.batch.capacity:
            raise KVRescueError(f"a batch of {n} tokens exceeds n_batch={self.batch.capacity}")
        self.batch.fill(tokens, positions, seq_ids, outputs)
        self.n_outputs = int(np.count_nonzero(outputs))
        self.decoded_tokens += n
        started = time.perf_counter()
        status = self._decode(self.handle, self.batch.struct)
        interrupts.raise_pending()  # a Ctrl-C while llama.cpp logged from the decode
        self.decode_seconds += time.perf_counter() - started
        if status == 1:
            raise KVRescueError(f"the KV cache is full: no room for {n} more tokens in n_ctx={self.n_ctx} cells; "
                                "raise n_ctx, lower the number of sequences, or evict")
        if status != 0:
            raise KVRescueError(f"llama_decode failed with status {status} (invalid batch or backend error)")

    def prefill(self, seq_id: int, tokens) -> int:
        """Append tokens to seq_id in n_batch chunks; returns the batch row holding the last token's logits."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if len(tokens) == 0:
            raise KVRescueError("nothing to decode: the token list is empty")
        self.check_vocab(tokens)
        start = self.pos_max(seq_id) + 1
        step = self.batch.capacity
        for offset in range(0, len(tokens), step):
            chunk = tokens[offset:offset + step]
            outputs = np.zeros(len(chunk), np.int8)
            if offset + step >= len(tokens):
                outputs[-1] = 1
            self.decode(chunk, np.arange(start + offset, start + offset + len(chunk), dtype=np.int32),
                        np.full(len(chunk), seq_id, np.int32), outputs)
        return len(tokens) - 1 - offset

    def step(self, seq_ids, tokens) -> None:
        """Decode one token for each sequence in one call; row i of the output belongs to seq_ids[i]."""
        seq_ids = np.asarray(seq_ids, dtype=np.int32)
        tokens = np.asarray(tokens, dtype=np.int32)
        for s in seq_ids:
            self.check_seq(int(s))
        self.check_vocab(tokens)
        positions = np.fromiter((self.call(self._pos_max, self.memory, int(s)) + 1 for s in seq_ids), np.int32,
                                len(seq_ids))
        self.decode(tokens, positions, seq_ids, np.ones(len(tokens), np.int8))

    def check_vocab(self, tokens: np.ndarray) -> None:
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= self.n_vocab):
            raise KVRescueError(f"token id out of range [0, {self.n_vocab}): the tokens come from another model's vocabulary")

    def logits(self, row: int = -1) -> np.ndarray:
        """A copy of the logits of batch row `row` of the last decode (-1: the last row flagged for output)."""
        ptr = self._logits_ith(self.handle, row)
        if not ptr:
            raise KVRescueError(f"no logits for batch row {row}: that row was not flagged for output")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def output_logits(self) -> np.ndarray:
        """The logits of every row flagged for output in the last decode, in batch order: [n_outputs, n_vocab], a
        view valid until the next decode (llama.cpp puts its outputs back in batch order when asked for them all)."""
        ptr = self.call(self._logits_all, self.handle)
        if not ptr or self.n_outputs == 0:
            raise KVRescueError("no logits: the last decode flagged no row for output")
        return np.ctypeslib.as_array(ptr, shape=(self.n_outputs, self.n_vocab))

    def embedding(self, row: int) -> np.ndarray:
        """A copy of the final hidden state of batch row `row` (context made with embeddings=True)."""
        ptr = self._embeddings_ith(self.handle, row)
        if not ptr:
            raise KVRescueError(f"no hidden state for batch row {row}: create the context with embeddings=True")
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy()
