"""llama.cpp models, contexts, batches, samplers and the patch's bindings."""

from .context import Context, ContextParams
from .lib import library_path, llama, patched
from .model import Model
from .sampling import Sampler, SamplingParams

__all__ = ["Context", "ContextParams", "Model", "Sampler", "SamplingParams", "library_path", "llama", "patched"]
