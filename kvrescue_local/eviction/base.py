"""What an eviction policy sees, the registry of policies by name, and policy specs ("rkv:lam=0.1")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from ..errors import KVRescueError


@dataclass(frozen=True)
class EvictionInputs:
    """One sequence's resident entries at compression time, in increasing position order."""

    positions: np.ndarray  # int32 [n]
    forced: np.ndarray | None = None  # bool [n]: kept whatever the scores (sinks, recent window, protected prompt)
    n_choose: int = 0  # how many of the other entries the budget keeps
    # [n_layer, n] (shared set) or [n_layer, n_head_kv, n] (per head): attention from the last `window` queries
    window_attention: np.ndarray | None = None
    cumulative_attention: np.ndarray | None = None  # [n]: attention summed since each entry arrived, all layers
    keys: np.ndarray | None = None  # [n_layer, n_head_kv, n, head_dim]: post-RoPE keys
    # Per head, entry i of (layer, head) is that head's i-th entry in position order (the cell holding it
    # differs between heads once compacted); forced is the same in every head.
    head_positions: np.ndarray | None = None  # per head: [n_layer, n_head_kv, n] each head's entries, increasing


@dataclass(frozen=True)
class Policy:
    """Scores resident entries: the budget keeps the highest-scoring ones (plus the forced ones).

    `n_sink` is the policy's default number of first entries always kept (what its reference does);
    a KVBudget's n_sink overrides it.
    """

    needs_attention = False  # the attention of the observation window (the last `window` queries)
    needs_cumulative_attention = False  # the attention since each entry arrived (every query observed)
    needs_keys = False
    n_sink = 0
    per_head = False  # chooses per (layer, KV head) with head_scores, not one set with score

    def head_scores(self, inputs: EvictionInputs) -> np.ndarray:
        """[n_layer, n_head_kv, n_free]: each (layer, KV head)'s score of the entries not forced."""
        raise NotImplementedError

    @property
    def reads_attention(self) -> bool:
        return self.needs_attention or self.needs_cumulative_attention

    def score(self, inputs: EvictionInputs) -> np.ndarray:
        raise NotImplementedError


POLICIES: dict[str, type[Policy]] = {}


def register(name: str):
    def add(cls: type[Policy]) -> type[Policy]:
        POLICIES[name] = cls
        cls.name = name
        return cls
    return add


# the widest max-pooling kernel: the references pool over 7 neighbours, and a kernel as wide as a sequence's
# entries pools them all to one value
MAX_KERNEL = 1024


def ranged(default: int | float, low: int | float, high: int | float):
    """A numeric policy option and the values it takes, low to high: a spec outside them is refused when parsed,
    before it could size a loop or an array (a kernel of 10^9 would pool for hours)."""
    return field(default=default, metadata={"range": (low, high)})


def check_ranges(policy: Policy) -> None:
    """Every ranged option of policy within its range (NaN is in none), else a ValueError naming the option, its
    range and a value to write."""
    for option in dataclasses.fields(policy):
        if "range" not in option.metadata:
            continue
        low, high = option.metadata["range"]
        value = getattr(policy, option.name)
        if not low <= value <= high:
            raise ValueError(f"{option.name}={value} is out of range: {policy.name}'s {option.name} takes {low:,} to "
                             f"{high:,}; write e.g. {policy.name}:{option.name}={option.default}")


def parse_option(cls: type[Policy], name: str, key: str, text: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if key not in fields:
        known = ", ".join(fields) or "none"
        raise KVRescueError(f"policy {name} has no option {key!r}: its options are {known}")
    kind = type(fields[key].default)  # every option has a default of its type
    try:
        return kind(text)
    except ValueError:
        raise KVRescueError(f"policy option {name}:{key}={text!r} is not a {kind.__name__}: "
                            f"write e.g. {name}:{key}={fields[key].default}") from None


def make_policy(spec: str) -> Policy:
    """A policy from its spec: a name, optionally with options, e.g. `rkv` or `rkv:lam=0.1,kernel=7`."""
    name, _, options = spec.partition(":")
    if name not in POLICIES:
        raise KVRescueError(f"unknown eviction policy {name!r}: use one of {', '.join(sorted(POLICIES))}")
    cls = POLICIES[name]
    values = {}
    for item in filter(None, options.split(",")):
        key, eq, text = item.partition("=")
        if not eq or not text:
            raise KVRescueError(f"policy option {item!r} needs a value: write {name}:{key.strip()}=VALUE")
        values[key.strip()] = parse_option(cls, name, key.strip(), text.strip())
    try:
        return cls(**values)
    except ValueError as error:
        raise KVRescueError(f"policy {spec!r}: {error}") from None


def policy_specs(text: str) -> list[str]:
    """Comma-separated policy specs, each checked: an item with `=` and no `:` is an option of the spec
    before it, so `rkv:lam=0.1,kernel=7,snapkv` is two specs."""
    specs: list[str] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if "=" in item and ":" not in item and specs:
            specs[-1] += "," + item
        else:
            specs.append(item)
    if not specs:
        raise KVRescueError(f"no eviction policy in {text!r}: use one of {', '.join(sorted(POLICIES))}")
    for spec in specs:
        make_policy(spec)
    return specs


HEADS = ("per", "shared")


def check_heads(name: str, heads: str) -> None:
    if heads not in HEADS:
        raise ValueError(f"{name} needs heads=per (its own entries in each layer and KV head) or heads=shared "
                         f"(one set of positions for all), got heads={heads}")


def max_pool(x: np.ndarray, kernel: int) -> np.ndarray:
    """Same-length max pooling along the last axis (SnapKV's clustering of neighbouring positions): entry i
    takes the max of entries i - kernel // 2 .. i + (kernel - 1) // 2 that exist (edge padding never wins).
    A shift past the sequence's end reaches no entry, so the shifts stop there: a kernel wider than the
    sequence pools it as one that spans it, at the same cost."""
    n = x.shape[-1]
    if kernel <= 1 or n == 0:
        return x
    out = x.copy()
    left = kernel // 2
    for shift in range(1, min(left, n - 1) + 1):  # a shifted np.maximum per neighbour: no padded copy, no window view
        np.maximum(out[..., shift:], x[..., :-shift], out=out[..., shift:])
    for shift in range(1, min(kernel - left, n)):
        np.maximum(out[..., :-shift], x[..., shift:], out=out[..., :-shift])
    return out
