"""The policy map's JSON forms: reading, validating and explaining what is wrong.

:class:`tfpolicy.analysis.policy_map.PolicyMap` loads through these helpers.
Every error names the key and, for JSON text, its line::

    policy map map.json: key 'encoder/(' at line 3 is not a valid regular
    expression: missing ), unterminated subpattern at position 8

Policies are parsed by Keras (``keras.dtype_policies.get``, Keras's own
deserialization for a serialized policy); this module only says where.
"""

from __future__ import annotations

import bisect
import json
import logging
import re
from typing import Any, Mapping, Optional, Tuple

import keras

from tfpolicy.errors import PolicyMapError, one_line

logger = logging.getLogger(__name__)

DTypePolicy = keras.dtype_policies.DTypePolicy
KerasPolicyMap = keras.dtype_policies.DTypePolicyMap

_PLAIN_TOP_KEYS = ("default_policy", "policy_map")
_KERAS_TOP_KEYS = ("module", "class_name", "config", "registered_name")
_KERAS_CONFIG_KEYS = ("default_policy", "policy_map")
_NAME_FORM_KEYS = ("name", "amax_history_length")
# A position in the JSON document: the chain of object keys from the root
# (None for an array element).
JsonPath = Tuple[Optional[str], ...]


def is_quantized(policy: DTypePolicy) -> bool:
    """Whether ``policy`` is a quantized policy (int8, float8, int4, ...)."""
    return policy.quantization_mode is not None


def describe_policy(policy: DTypePolicy) -> str:
    """A stable, human-readable name for ``policy``.

    ``mixed_bfloat16``, ``int8_from_mixed_bfloat16``; a float8 policy whose
    amax history length differs from Keras's default gets it appended:
    ``float8_from_mixed_bfloat16(amax_history_length=16)``.
    """
    name = str(policy.name)
    if isinstance(policy, keras.dtype_policies.QuantizedFloat8DTypePolicy):
        length = policy.amax_history_length
        if length != policy.default_amax_history_length:
            return f"{name}(amax_history_length={length})"
    return name


# ---------------------------------------------------------------- validation


def document_body(
    document: Mapping[str, Any], origin: str
) -> tuple[Mapping[str, Any], JsonPath]:
    """The object holding ``default_policy``/``policy_map``, and its JSON path.

    Keras form: ``{"class_name": "DTypePolicyMap", "config": {...}}`` -> ``config``;
    plain form: the document itself.
    """
    if "class_name" not in document:
        check_fields(document, _PLAIN_TOP_KEYS, f"policy map {origin}")
        return document, ()
    check_fields(document, _KERAS_TOP_KEYS, f"policy map {origin}")
    if document["class_name"] != "DTypePolicyMap":
        raise PolicyMapError(
            f"policy map {origin}: expected class_name 'DTypePolicyMap', "
            f"got {document['class_name']!r}"
        )
    body = document.get("config")
    if not isinstance(body, Mapping):
        raise PolicyMapError(
            f"policy map {origin}: 'config' must be an object, got {json_type(body)}"
        )
    check_fields(body, _KERAS_CONFIG_KEYS, f"policy map {origin}: 'config'")
    return body, ("config",)


MAX_JSON_DEPTH = 32
"""A Keras-serialized map nests 6 levels deep; Python's JSON parser recurses once per level."""
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def check_depth(text: str, origin: str) -> None:
    """Refuse JSON nested deeper than :data:`MAX_JSON_DEPTH` before parsing it (a recursive parse could fail)."""
    depth = deepest = 0
    for char in _JSON_STRING.sub('""', text):
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_JSON_DEPTH:
                raise PolicyMapError(
                    f"policy map {origin} nests arrays or objects more than {MAX_JSON_DEPTH} levels deep;"
                    " a policy map needs at most 6"
                )
        elif char in "]}":
            depth -= 1


def compile_key(key: object, where: str) -> re.Pattern[str]:
    """Check that ``key`` is a string and a valid regular expression."""
    if not isinstance(key, str):
        raise PolicyMapError(
            f"policy map key {key!r}{where} must be a string, got {type(key).__name__}"
        )
    try:
        return re.compile(key)
    except re.error as exc:
        raise PolicyMapError(
            f"policy map key {key!r}{where} is not a valid regular expression: "
            f"{one_line(exc)}"
        ) from exc


def parse_policy(raw: object, what: str) -> DTypePolicy:
    """Turn one map value (or default) into a non-map Keras policy.

    ``what`` opens every message, e.g. ``policy map key 'dense_1' at line 3 of m.json``.
    """
    if isinstance(raw, Mapping) and "class_name" not in raw:
        policy = parse_name_form(raw, what)
    elif isinstance(raw, (str, Mapping, DTypePolicy)):
        if isinstance(raw, Mapping):
            check_fields(raw, _KERAS_TOP_KEYS, f"{what}: serialized policy")
            if raw["class_name"] == "DTypePolicyMap":
                raise PolicyMapError(f"{what}: a policy must not itself be a DTypePolicyMap")
            warn_if_nameless(raw, what)
        try:
            policy = keras.dtype_policies.get(dict(raw) if isinstance(raw, Mapping) else raw)
        except Exception as exc:  # Keras raises ValueError, TypeError, ...
            raise PolicyMapError(
                f"{what}: invalid dtype policy {show(raw)}: {keras_message(exc)}"
            ) from exc
    else:
        raise PolicyMapError(
            f"{what}: expected a policy name or an object, got {json_type(raw)} {show(raw)}"
        )
    check_policy(policy, what, raw)
    return policy


def parse_name_form(raw: Mapping[str, Any], what: str) -> DTypePolicy:
    """``{"name": ..., "amax_history_length": n}`` -> policy."""
    check_fields(raw, _NAME_FORM_KEYS, what)
    name = raw.get("name")
    if not isinstance(name, str):
        raise PolicyMapError(f"{what}: 'name' must be a policy name string, got {show(name)}")
    policy = parse_policy(name, what)
    if "amax_history_length" not in raw:
        return policy
    length = raw["amax_history_length"]
    if not isinstance(policy, keras.dtype_policies.QuantizedFloat8DTypePolicy):
        raise PolicyMapError(
            f"{what}: amax_history_length applies only to float8 policies, not {name!r}"
        )
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise PolicyMapError(
            f"{what}: amax_history_length must be a positive integer, got {show(length)}"
        )
    mode, source_name = name.split("_from_")  # get() has checked the shape.
    return keras.dtype_policies.QuantizedFloat8DTypePolicy(
        mode=mode, source_name=source_name, amax_history_length=length
    )


MAX_AMAX_HISTORY_LENGTH = 2**20
"""Keras's default is 1024; each float8 layer keeps two float32 histories of this length."""
MAX_INT4_BLOCK_SIZE = 2**16
"""Keras pads a kernel's rows to a whole block in memory before quantizing: real blocks are 32-256."""


def check_policy(policy: object, what: str, raw: object = None) -> None:
    """A map value or default must be a plain (non-map) ``DTypePolicy`` of a size that can be built."""
    if isinstance(policy, KerasPolicyMap):
        raise PolicyMapError(f"{what}: a policy must not itself be a DTypePolicyMap")
    if not isinstance(policy, DTypePolicy):
        # keras.dtype_policies.get returns an unknown class_name as a bare string.
        shown = show(raw) if raw is not None else show(policy)
        raise PolicyMapError(f"{what}: {shown} is not a dtype policy")
    length = getattr(policy, "amax_history_length", None)
    if isinstance(length, (int, float)) and not 1 <= length <= MAX_AMAX_HISTORY_LENGTH:
        raise PolicyMapError(
            f"{what}: amax_history_length must be between 1 and {MAX_AMAX_HISTORY_LENGTH} (Keras's default is"
            f" 1024; each float8 layer keeps two float32 histories that long), got {show(length)}"
        )
    block = getattr(policy, "block_size", None)
    if isinstance(block, (int, float)) and block > MAX_INT4_BLOCK_SIZE:
        raise PolicyMapError(
            f"{what}: int4 block size must be at most {MAX_INT4_BLOCK_SIZE} (Keras pads each kernel to a whole"
            f" block before quantizing; usual blocks are 32-256), got {show(block)}"
        )


def check_fields(obj: Mapping[str, Any], allowed: tuple[str, ...], what: str) -> None:
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        raise PolicyMapError(
            f"{what}: unknown field(s) {', '.join(repr(k) for k in unknown)}; "
            f"expected {', '.join(repr(k) for k in allowed)}"
        )


def warn_if_nameless(raw: Mapping[str, Any], what: str) -> None:
    """Keras drops policy names when serializing a map with ``default_policy=None``."""
    config = raw.get("config")
    if isinstance(config, Mapping) and any(
        field in config and config[field] is None for field in ("name", "source_name")
    ):
        logger.warning(
            "%s: serialized policy has no name (Keras drops it when serializing a map "
            "whose default_policy is None); it resolves to the global policy %r",
            what, describe_policy(keras.config.dtype_policy()),
        )


# ------------------------------------------------------------------ JSON text


class DuplicateKeyError(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for ``json.loads``: a repeated key is an error."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise DuplicateKeyError(key)
        result[key] = value
    return result


def describe_duplicate(text: str, key: str) -> str:
    for json_path, lines in key_lines(text).items():
        if json_path[-1] == key and len(lines) > 1:
            return f"duplicate key {key!r} at line {lines[1]} (first at line {lines[0]})"
    return f"duplicate key {key!r}"


def key_lines(text: str) -> dict[JsonPath, list[int]]:
    """Lines (1-based) of every object key in valid JSON ``text``, by JSON path.

    ``{"policy_map": {"a": 1}}`` gives ``{("policy_map",): [1], ("policy_map", "a"): [1]}``.
    """
    newlines = [i for i, char in enumerate(text) if char == "\n"]
    stack: list[list[Any]] = []  # one [is_object, current_key] frame per container
    found: dict[JsonPath, list[int]] = {}
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        if char == '"':
            value, end = json.decoder.scanstring(text, i + 1)
            j = end
            while j < n and text[j] in " \t\r\n":
                j += 1
            if j < n and text[j] == ":" and stack and stack[-1][0]:
                stack[-1][1] = value
                json_path = tuple(frame[1] for frame in stack)
                found.setdefault(json_path, []).append(bisect.bisect_left(newlines, i) + 1)
            i = end
            continue
        if char in "{[":
            stack.append([char == "{", None])
        elif char in "}]":
            stack.pop()
        i += 1
    return found


def json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    return f"a {type(value).__name__}"


def show(value: object) -> str:
    """A one-line rendering of a map value for messages."""
    if isinstance(value, str):
        return repr(value)
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return one_line(repr(value))


def keras_message(exc: Exception) -> str:
    """Keras's reason, without the boilerplate its deserializer wraps around it."""
    text = str(exc)
    marker = "Exception encountered:"
    if marker in text:
        text = text.split(marker, 1)[1]
    return one_line(text)


