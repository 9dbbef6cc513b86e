"""The device-kernel check: which ops of a SavedModel would leave the GPU.

TF Serving places each op on the GPU when TensorFlow has a GPU kernel for it
with those dtypes, and on the host CPU otherwise (a copy each way, and the
host's arithmetic). Ops inside a function marked for XLA compilation
(``_XlaMustCompile``) are compiled for the device instead. TensorFlow's
kernel registry lists GPU kernels even in a CPU-only build, so this runs on
any machine::

    signature outputs --ancestors--> nodes --calls--> function bodies (not XLA-marked)
        --registry--> op + dtypes with no GPU (or DEFAULT) kernel

:func:`missing_gpu_kernels` lists them per signature, as ``Op (dtypes)``.
The serving checks compare the output's list with the input's: an op that
had no GPU kernel before the rewrite (a string lookup, say) is the model's,
not the rewrite's.
"""

from __future__ import annotations

import collections
from typing import Any, Iterable, Mapping

import tensorflow as tf

from tfpolicy.core import tf_internals

_DEVICE_TYPES = ("GPU", "DEFAULT")
_CALL_ATTRS = ("f", "then_branch", "else_branch", "cond", "body", "branches")


def missing_gpu_kernels(meta_graph: Any) -> dict[str, collections.Counter]:
    """Signature key -> ``Counter({"Op (dtypes)": count})`` of ops that would run off the GPU."""
    library = {f.signature.name: f for f in meta_graph.graph_def.library.function}
    nodes = {n.name: n for n in meta_graph.graph_def.node}
    result: dict[str, collections.Counter] = {}
    for key, signature in meta_graph.signature_def.items():
        if key.startswith("__"):  # __saved_model_init_op: run once at load time, on the host
            continue
        missing: collections.Counter = collections.Counter()
        outputs = [info.name.split(":")[0] for info in signature.outputs.values()]
        for node in _ancestors(outputs, nodes):
            _check_node(node, library, missing, set())
        result[key] = missing
    return result


def _ancestors(names: Iterable[str], nodes: Mapping[str, Any]) -> list[Any]:
    seen, stack, found = set(), list(names), []
    while stack:
        name = stack.pop()
        if name in seen or name not in nodes:
            continue
        seen.add(name)
        found.append(nodes[name])
        stack.extend(i.lstrip("^").split(":")[0] for i in nodes[name].input)
    return found


def _check_node(node: Any, library: Mapping[str, Any], missing: collections.Counter, visited: set[str]) -> None:
    called = [node.op] if node.op in library else []
    for attr in _CALL_ATTRS:
        if attr in node.attr:
            value = node.attr[attr]
            called += [value.func.name] if value.HasField("func") else [f.name for f in value.list.func]
    if called:
        for name in called:
            _check_function(name, library, missing, visited)
        if node.op in library:
            return
    if not has_gpu_kernel(node.op, node.attr):
        missing[f"{node.op} ({_dtypes(node.attr)})"] += 1


def _check_function(name: str, library: Mapping[str, Any], missing: collections.Counter, visited: set[str]) -> None:
    function = library.get(name)
    if function is None or name in visited:
        return
    visited.add(name)
    if function.attr.get(tf_internals.XLA_MUST_COMPILE) is not None and function.attr[tf_internals.XLA_MUST_COMPILE].b:
        return  # compiled for the device as a whole
    for node in function.node_def:
        _check_node(node, library, missing, visited)


def has_gpu_kernel(op: str, attrs: Mapping[str, Any]) -> bool:
    """Whether TensorFlow registers a GPU (or any-device) kernel for ``op`` with these type attributes."""
    kernels = [k for k in tf_internals.registered_kernels(op) if k.device_type in _DEVICE_TYPES]
    defaults = _type_defaults(op)
    for kernel in kernels:
        if all(_allowed(constraint, attrs, defaults) for constraint in kernel.constraint):
            return True
    return False


def _allowed(constraint: Any, attrs: Mapping[str, Any], defaults: Mapping[str, int]) -> bool:
    allowed = set(constraint.allowed_values.list.type)
    if not allowed:
        return True
    if constraint.name in attrs:
        value = attrs[constraint.name]
        types = [value.type] if value.type else list(value.list.type)
    else:
        types = [defaults[constraint.name]] if constraint.name in defaults else []
    return all(t in allowed for t in types)


def _type_defaults(op: str) -> dict[str, int]:
    op_def = tf_internals.op_def(op)
    if op_def is None:
        return {}
    return {a.name: a.default_value.type for a in op_def.attr if a.type == "type" and a.HasField("default_value")}


def _dtypes(attrs: Mapping[str, Any]) -> str:
    names = []
    for name in sorted(attrs):
        value = attrs[name]
        if name.startswith("_"):
            continue
        if value.type:
            names.append(f"{name}={tf.dtypes.as_dtype(value.type).name}")
    return ", ".join(names)


def new_missing(output: Mapping[str, collections.Counter], source: Mapping[str, collections.Counter]) -> dict[str, list[str]]:
    """Per signature, the ``Op (dtypes) xN`` entries the output has and the input did not."""
    before: collections.Counter = collections.Counter()
    for counts in source.values():
        before.update(set(counts))
    return {
        key: [f"{entry} x{n}" for entry, n in sorted(counts.items()) if entry not in before]
        for key, counts in sorted(output.items())
        if any(entry not in before for entry in counts)
    }
