"""The reward head that sits on a PRM backbone's final hidden states, in numpy.

Stored beside the backbone GGUF as `<backbone>.head.npz`: weight/bias arrays per linear
layer (HF (out, in) layout), ReLU between layers, and a JSON string naming the format and, for a
head trained here, the fingerprint of the model file whose hidden states it was trained on.
"""

from __future__ import annotations

import io
import json
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import KVRescueError
from ..files import check_input_file, write_output
from .formats import prm_format


def head_path(backbone: str | Path) -> Path:
    backbone = Path(backbone)
    return backbone.with_name(backbone.name.removesuffix(".gguf") + ".head.npz")


@dataclass
class RewardHead:
    weights: list[np.ndarray]
    biases: list[np.ndarray]
    format: str
    backbone: str | None = None  # fingerprint (bench.results_file.file_hash) of the GGUF it was trained on
    prompt: str | None = None  # the prompt template it was trained on, where it is not its format's

    def __post_init__(self) -> None:
        prm_format(self.format)
        outputs = self.weights[-1].shape[0]
        expected = 2 if prm_format(self.format).output == "softmax1" else 1
        if outputs != expected:
            raise KVRescueError(f"reward head has {outputs} outputs but format {self.format!r} needs {expected}: "
                                "convert the PRM again")

    @property
    def hidden_size(self) -> int:
        return self.weights[0].shape[1]

    def rewards(self, hidden: np.ndarray) -> np.ndarray:
        """Rewards for rows of final hidden states [n, hidden]."""
        x = np.asarray(hidden, dtype=np.float32)
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            x = x @ w.T + b
            if i < len(self.weights) - 1:
                x = np.maximum(x, 0.0)
        if prm_format(self.format).output == "sigmoid":
            return 1.0 / (1.0 + np.exp(-x[:, 0]))
        return 1.0 / (1.0 + np.exp(x[:, 0] - x[:, 1]))  # softmax(x)[1] of two logits

    def save(self, path: str | Path) -> Path:
        arrays = {f"weight{i}": w for i, w in enumerate(self.weights)}
        arrays.update({f"bias{i}": b for i, b in enumerate(self.biases)})
        meta = json.dumps({"format": self.format, "layers": len(self.weights),
                           **({"backbone": self.backbone} if self.backbone else {}),
                           **({"prompt": self.prompt} if self.prompt else {})})
        buffer = io.BytesIO()
        np.savez(buffer, meta=np.array(meta), **arrays)
        return write_output(path, buffer.getvalue(), "the head file")

    @classmethod
    def load(cls, path: str | Path, hidden_size: int | None = None) -> "RewardHead":
        path = Path(path)
        if not path.exists():
            raise KVRescueError(f"reward head not found: {path}; `kvrescue-local models convert-prm` writes one beside "
                                "a converted backbone, `kvrescue-local prm train` trains one for a preset")
        check_input_file(path, "reward head", "pass a .head.npz file")
        try:
            with np.load(path) as data:
                meta = json.loads(str(data["meta"]))
                weights = [data[f"weight{i}"].astype(np.float32) for i in range(meta["layers"])]
                biases = [data[f"bias{i}"].astype(np.float32) for i in range(meta["layers"])]
            head = cls(weights, biases, meta["format"], meta.get("backbone"), meta.get("prompt"))
        except KVRescueError:
            raise
        # a truncated or foreign file fails in the zip reader, the array reader or the metadata
        except (OSError, KeyError, IndexError, TypeError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
            raise KVRescueError(f"reward head {path} is unreadable ({type(exc).__name__}: {exc}): convert the PRM "
                                "again, or retrain its head with `kvrescue-local prm train`") from None
        for name, array in [*((f"weight{i}", w) for i, w in enumerate(head.weights)),
                            *((f"bias{i}", b) for i, b in enumerate(head.biases))]:
            if not np.isfinite(array).all():  # every reward would be NaN, and NaN is not JSON
                raise KVRescueError(f"reward head {path}: {name} holds a number that is not finite (NaN or infinity): "
                                    "convert the PRM again, or retrain its head with `kvrescue-local prm train`")
        if hidden_size is not None and head.hidden_size != hidden_size:
            raise KVRescueError(f"reward head {path} expects hidden size {head.hidden_size} but the backbone has "
                                f"{hidden_size}: the head belongs to another model; convert the PRM again")
        return head
