"""llama.cpp models, contexts, batches, samplers and the patch's bindings."""

from .context import DEFAULT_FLASH_ATTN, Context, ContextParams
from .lib import library_path, llama, patched
from .model import Model
from .sampling import Sampler, SamplingParams

__all__ = ["DEFAULT_FLASH_ATTN", "Context", "ContextParams", "Model", "Sampler", "SamplingParams", "library_path", "llama",
           "patched"]
