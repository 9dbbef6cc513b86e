"""Planning, apart from rewriting: policy map x layer index -> frozen records.

``plan(policy_map, layer_index)`` resolves each layer path once, with the map's
Keras lookup, into a :class:`LayerPlan`. Passes consume the plan; ``--explain``
prints it. Nothing here touches a graph.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tfpolicy.analysis.layer_index import LayerIndex
from tfpolicy.analysis.policy_map import PolicyMap, describe_policy
from tfpolicy.core import tf_names
from tfpolicy.core.tf_names import DT_BFLOAT16, DT_DOUBLE, DT_FLOAT, DT_HALF, DT_INVALID

OUTSIDE_LAYERS = "(outside every layer)"
"""How tables and messages show ``path=None``: the ops no layer owns."""

_DTYPE_ENUMS = {
    "float32": DT_FLOAT,
    "float64": DT_DOUBLE,
    "bfloat16": DT_BFLOAT16,
    "float16": DT_HALF,
}


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What one layer path resolves to. ``path=None`` is "outside every layer"."""

    path: Optional[str]
    key: Optional[str]
    policy: str
    compute_dtype: str
    variable_dtype: str
    quantization_mode: Optional[str]
    amax_history_length: Optional[int]
    is_normalization: bool
    variable_count: int
    op_count: int
    # int4: rows per scale group along the contracted axis (Keras's ``int4/<block>_``
    # policies); None for one scale per output channel (``int4_``, ``int4/-1_``).
    block_size: Optional[int] = None

    @property
    def compute_enum(self) -> int:
        return dtype_enum(self.compute_dtype)

    @property
    def variable_enum(self) -> int:
        return dtype_enum(self.variable_dtype)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def dtype_enum(name: str) -> int:
    try:
        return _DTYPE_ENUMS[name]
    except KeyError:
        return tf_names.DTYPE_BY_NAME.get(name, DT_INVALID)


@dataclasses.dataclass(frozen=True)
class Plan:
    layers: dict[Optional[str], LayerPlan]
    unused_keys: tuple[str, ...]
    # Unused keys that name layers without a path in Keras: key -> their scopes.
    pathless_keys: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def unused_key_warnings(self) -> list[str]:
        """One line per unused key, saying why it reaches nothing."""
        default = self.layers[None].policy
        lines = []
        for key in self.unused_keys:
            scopes = self.pathless_keys.get(key)
            if scopes:
                lines.append(
                    f"policy map key '{key}' names {', '.join(repr(s) for s in scopes)}, a layer Keras builds at"
                    f" construction (Activation, Dropout, Softmax, Reshape, pooling): it has no path, so no map key"
                    f" reaches it, and it computes in the policy of the layer around it or the default ({default})"
                )
            else:
                lines.append(f"policy map key '{key}' matches no layer")
        return lines

    def for_layer(self, path: Optional[str]) -> LayerPlan:
        return self.layers.get(path, self.layers[None])

    @property
    def quantized(self) -> list[LayerPlan]:
        return [p for p in self.layers.values() if p.quantization_mode and (p.op_count or p.variable_count)]

    def rows(self) -> list[LayerPlan]:
        named = sorted((p for p in self.layers.values() if p.path is not None), key=lambda p: p.path)
        return named + [self.layers[None]]


def plan(policy_map: PolicyMap, index: LayerIndex, outside_op_count: int = 0) -> Plan:
    """Resolve every layer path of ``index`` (and the default) against the map."""
    layers: dict[Optional[str], LayerPlan] = {}
    for path in index.paths:
        info = index.layers[path]
        layers[path] = _layer_plan(policy_map, path, len(info.variables), info.op_count, info.is_normalization)
    layers[None] = _layer_plan(policy_map, None, 0, outside_op_count, False)
    unused = tuple(policy_map.unused_keys(index.paths))
    pathless = {}
    for key in unused:
        named = tuple(s for s in sorted(index.pathless_scopes) if policy_map.key_names(key, s))
        if named:
            pathless[key] = named
    return Plan(layers, unused, pathless)


def _layer_plan(
    policy_map: PolicyMap, path: Optional[str], variables: int, ops: int, normalization: bool
) -> LayerPlan:
    match = policy_map.lookup(path)
    policy = match.policy
    return LayerPlan(
        path=path,
        key=match.key,
        policy=describe_policy(policy),
        compute_dtype=str(policy.compute_dtype),
        variable_dtype=str(policy.variable_dtype),
        quantization_mode=policy.quantization_mode,
        amax_history_length=getattr(policy, "amax_history_length", None),
        is_normalization=normalization,
        variable_count=variables,
        op_count=ops,
        block_size=_block_size(policy),
    )


def _block_size(policy) -> Optional[int]:
    block = getattr(policy, "block_size", None)
    return None if block is None or block <= 0 else int(block)
