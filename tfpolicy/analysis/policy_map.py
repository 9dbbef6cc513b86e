"""Load and validate a Keras ``DTypePolicyMap`` and resolve layer paths with it.

The policy map is the user's input: layer path (or regex over layer paths) ->
Keras dtype policy. This module turns any accepted spelling of it into a
:class:`PolicyMap`, which holds a real ``keras.dtype_policies.DTypePolicyMap``
and answers :meth:`PolicyMap.lookup` with exactly Keras's rules::

    map.json / dict / keras DTypePolicyMap
        --parse + validate-->  PolicyMap(default, {key: DTypePolicy})
        --lookup("enc/ffn")->  PolicyMatch(path="enc/ffn", key="enc/.*",
                                           policy=<DTypePolicy "mixed_bfloat16">)

Two JSON forms are accepted, from a file, a string or a dict:

1. Keras's own serialization,
   ``json.dumps(keras.saving.serialize_keras_object(policy_map))``.
2. A plain form::

       {"default_policy": "float32",
        "policy_map": {"encoder/.*": "mixed_bfloat16",
                       "ffn/.*": {"name": "float8_from_mixed_bfloat16",
                                  "amax_history_length": 16}}}

   A value is a policy name (anything ``keras.dtype_policies.get`` accepts), a
   ``{"name": ..., "amax_history_length": n}`` object, or a Keras-serialized
   policy (an object with ``"class_name"``).

Lookup is Keras's (``DTypePolicyMap.__getitem__``): an exact key wins, else
every key is tried with ``re.fullmatch``; two or more matches are an error, none
gives the default policy. Unlike Keras, every key and value is validated when
the map is loaded, and errors name the key and, for JSON text, its line.
Quantized policies (int8, float8, ...) are parsed here, not refused.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Union

import keras

from tfpolicy.analysis import policy_json, regex_limit
from tfpolicy.analysis.policy_json import JsonPath, describe_policy, is_quantized  # noqa: F401  (re-exported)
from tfpolicy.errors import AmbiguousPathError, PolicyMapError, one_line

logger = logging.getLogger(__name__)

DTypePolicy = keras.dtype_policies.DTypePolicy
KerasPolicyMap = keras.dtype_policies.DTypePolicyMap

PolicyMapSource = Union[str, "os.PathLike[str]", Mapping[str, Any], KerasPolicyMap, "PolicyMap"]




@dataclass(frozen=True)
class PolicyMatch:
    """The result of resolving one layer path against a :class:`PolicyMap`.

    Attributes:
        path: The layer path looked up (None for an op outside every layer).
        key: The map key that matched, or None when the default policy applies.
        policy: The resolved Keras dtype policy (the map's own instance).
    """

    path: Optional[str]
    key: Optional[str]
    policy: DTypePolicy

    @property
    def is_default(self) -> bool:
        """True when no key matched and the default policy applies."""
        return self.key is None


class PolicyMap:
    """Validated wrapper around ``keras.dtype_policies.DTypePolicyMap``.

    Build one with :meth:`load` or :meth:`from_json_text`. The wrapped Keras map
    is private; :meth:`to_keras` hands out a fresh copy.
    """

    describe_policy = staticmethod(describe_policy)

    def __init__(
        self,
        default_policy: DTypePolicy,
        policies: Mapping[str, DTypePolicy],
        *,
        origin: str = "<dict>",
        key_lines: Optional[Mapping[str, int]] = None,
    ) -> None:
        """Wrap already-parsed policies; prefer :meth:`load`.

        Args:
            default_policy: The policy for paths no key matches (not a map).
            policies: Key -> policy, in the order keys should be reported.
            origin: Where the map came from, for messages (a file name).
            key_lines: Key -> line in the JSON text, for messages.
        """
        self._origin = origin
        self._key_lines = dict(key_lines or {})
        policy_json.check_policy(default_policy, f"policy map {origin}: default_policy")
        self._patterns = {}
        for key, policy in policies.items():
            self._patterns[key] = policy_json.compile_key(key, self._where(key))
            policy_json.check_policy(policy, f"policy map key {key!r}{self._where(key)}")
        self._default = default_policy
        self._policies = dict(policies)
        self._keras_map = KerasPolicyMap(default_policy=default_policy)
        for key, policy in self._policies.items():
            self._keras_map[key] = policy

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(cls, source: PolicyMapSource) -> PolicyMap:
        """Load a policy map from a JSON file, a dict, a Keras map or a PolicyMap.

        Args:
            source: A path (``str`` or ``os.PathLike``) to a JSON file; a
                ``keras.dtype_policies.DTypePolicyMap`` (never mutated); a dict
                in either JSON form; or a :class:`PolicyMap` (returned as is).

        Raises:
            PolicyMapError: The source cannot be read, parsed or validated.
        """
        if isinstance(source, PolicyMap):
            return source
        if isinstance(source, KerasPolicyMap):
            return cls._from_keras(source)
        if isinstance(source, Mapping):
            return cls._from_document(source, origin="<dict>", lines=None)
        if isinstance(source, (str, os.PathLike)):
            origin = os.fspath(source)
            try:
                with open(source, encoding="utf-8-sig") as handle:
                    text = handle.read()
            except (OSError, UnicodeDecodeError) as exc:
                raise PolicyMapError(
                    f"cannot read policy map {origin}: {one_line(exc)}"
                ) from exc
            return cls.from_json_text(text, origin=origin)
        raise PolicyMapError(
            "cannot load a policy map from a "
            f"{type(source).__name__}: expected a JSON file path, a dict, "
            "a keras.dtype_policies.DTypePolicyMap or a PolicyMap"
        )

    @classmethod
    def from_json_text(cls, text: str, *, origin: str = "<string>") -> PolicyMap:
        """Parse JSON text in either accepted form; ``origin`` names it in errors."""
        policy_json.check_depth(text, origin)
        try:
            document = json.loads(text, object_pairs_hook=policy_json.reject_duplicate_keys)
        except json.JSONDecodeError as exc:
            raise PolicyMapError(
                f"policy map {origin} is not valid JSON: {exc.msg} "
                f"at line {exc.lineno} column {exc.colno}"
            ) from exc
        except policy_json.DuplicateKeyError as exc:
            raise PolicyMapError(
                f"policy map {origin}: {policy_json.describe_duplicate(text, exc.key)}"
            ) from None
        if not isinstance(document, dict):
            raise PolicyMapError(
                f"policy map {origin}: expected a JSON object at the top level, "
                f"got {policy_json.json_type(document)}"
            )
        return cls._from_document(document, origin=origin, lines=policy_json.key_lines(text))

    @classmethod
    def _from_keras(cls, keras_map: KerasPolicyMap) -> PolicyMap:
        """Copy and validate a live Keras map (its ``get_config`` would mutate it)."""
        origin = "<keras DTypePolicyMap>"
        default = policy_json.parse_policy(keras_map.default_policy, f"policy map {origin}: default_policy")
        policies = {}
        for key in keras_map:
            what = f"policy map key {key!r}"
            policy_json.compile_key(key, "")
            policies[key] = copy.deepcopy(policy_json.parse_policy(keras_map[key], what))
        return cls(copy.deepcopy(default), policies, origin=origin)

    @classmethod
    def _from_document(
        cls,
        document: Mapping[str, Any],
        *,
        origin: str,
        lines: Optional[Mapping[JsonPath, list]],
    ) -> PolicyMap:
        """Build from a decoded JSON object in the Keras or the plain form."""
        body, prefix = policy_json.document_body(document, origin)

        def line_of(*json_path: str) -> Optional[int]:
            found = (lines or {}).get(prefix + json_path)
            return found[0] if found else None

        def where(line: Optional[int]) -> str:
            return f" at line {line} of {origin}" if line is not None else ""

        def field(name: str) -> str:
            line = line_of(name)
            if line is None:
                return f"policy map {origin}: {name}"
            return f"policy map {name} at line {line} of {origin}"

        raw_default = body.get("default_policy")
        if raw_default is None:
            default = copy.deepcopy(keras.config.dtype_policy())
            logger.info(
                "policy map %s has no default_policy; using Keras's global policy %r",
                origin, describe_policy(default),
            )
        else:
            default = policy_json.parse_policy(raw_default, field("default_policy"))

        raw_map = body.get("policy_map")
        if raw_map is None:
            raw_map = {}
        if not isinstance(raw_map, Mapping):
            raise PolicyMapError(
                f"{field('policy_map')}: expected an object, got {policy_json.json_type(raw_map)}"
            )
        policies = {}
        key_lines = {}
        for key, raw in raw_map.items():
            line = line_of("policy_map", key) if isinstance(key, str) else None
            policy_json.compile_key(key, where(line))
            if raw is None:
                raise PolicyMapError(
                    f"policy map key {key!r}{where(line)}: expected a policy name or "
                    "an object, got null"
                )
            policies[key] = policy_json.parse_policy(raw, f"policy map key {key!r}{where(line)}")
            if line is not None:
                key_lines[key] = line
        result = cls(default, policies, origin=origin, key_lines=key_lines)
        logger.debug("loaded %r", result)
        return result

    # --------------------------------------------------------------- accessors

    @property
    def default_policy(self) -> DTypePolicy:
        """The policy for paths no key matches (Keras's global one if unset)."""
        return self._default

    @property
    def keys(self) -> tuple[str, ...]:
        """The map's keys, in insertion (document) order."""
        return tuple(self._policies)

    @property
    def origin(self) -> str:
        """Where the map came from: a file name, ``<string>``, ``<dict>``, ..."""
        return self._origin

    def items(self) -> tuple[tuple[str, DTypePolicy], ...]:
        """``(key, policy)`` pairs in insertion order."""
        return tuple(self._policies.items())

    def __len__(self) -> int:
        return len(self._policies)

    def __repr__(self) -> str:
        entries = ", ".join(f"{k!r}: {describe_policy(p)}" for k, p in self._policies.items())
        return (
            f"PolicyMap(origin={self._origin!r}, default={describe_policy(self._default)}, "
            f"{{{entries}}})"
        )

    # ------------------------------------------------------------------ lookup

    def lookup(self, path: Optional[str]) -> PolicyMatch:
        """Resolve a layer path with ``DTypePolicyMap``'s rules.

        ``None`` (an op outside every layer) gets the default policy.

        Raises:
            AmbiguousPathError: ``path`` is not a key and fully matches two or
                more regex keys.
        """
        if path is None:
            return PolicyMatch(path=None, key=None, policy=self._default)
        if not isinstance(path, str):
            raise TypeError(f"layer path must be a str or None, got {type(path).__name__}")
        try:
            with regex_limit.time_limit():
                policy = self._keras_map[path]
        except ValueError as exc:
            raise self._ambiguous(path, self._regex_matches(path)) from exc
        except regex_limit.RegexTimeout:
            self._regex_matches(path)  # names the key that backtracks
            raise PolicyMapError(f"policy map {self._origin}: its keys take over {regex_limit.SECONDS:g} s to match"
                                 f" the layer path {path!r}; simplify the regexes") from None
        if path in self._policies:
            key: Optional[str] = path
        else:
            matches = self._regex_matches(path)
            if len(matches) > 1:  # Keras did not object: its rules have changed.
                raise self._ambiguous(path, matches)
            key = matches[0] if matches else None
        expected = self._policies[key] if key is not None else self._default
        if policy is not expected:
            raise RuntimeError(
                f"tfpolicy and Keras disagree on layer path {path!r}: key {key!r} "
                f"gives {describe_policy(expected)}, Keras gives {describe_policy(policy)}"
            )
        return PolicyMatch(path=path, key=key, policy=policy)

    def unused_keys(self, paths: Iterable[Optional[str]]) -> list[str]:
        """Keys, in order, that equal or fully match none of ``paths``.

        A regex key that matches only paths which also have an exact key is
        shadowed but counts as used here.
        """
        path_set = {p for p in paths if p is not None}
        return [
            key
            for key in self._patterns
            if key not in path_set and not any(self._fullmatch(key, p) for p in path_set)
        ]

    def key_names(self, key: str, path: str) -> bool:
        """Whether ``key`` is ``path`` or fully matches it as a regex."""
        return key == path or self._fullmatch(key, path)

    def _fullmatch(self, key: str, path: str) -> bool:
        """``re.fullmatch(key, path)`` within :mod:`regex_limit`'s time, else a map error naming the key."""
        try:
            with regex_limit.time_limit():
                return self._patterns[key].fullmatch(path) is not None
        except regex_limit.RegexTimeout:
            raise PolicyMapError(
                f"policy map key {key!r}{self._where(key)} takes over {regex_limit.SECONDS:g} s to match the layer"
                f" path {path!r}: the regex backtracks catastrophically (nested repetition such as '(a+)+');"
                " write it without a repeated group that can match the same text in several ways"
            ) from None

    def to_keras(self) -> KerasPolicyMap:
        """A fresh ``DTypePolicyMap`` with copied policies, safe to mutate."""
        result = KerasPolicyMap(default_policy=copy.deepcopy(self._default))
        for key, policy in self._policies.items():
            result[key] = copy.deepcopy(policy)
        return result

    def _regex_matches(self, path: str) -> list[str]:
        return [key for key in self._patterns if self._fullmatch(key, path)]

    def _ambiguous(self, path: str, keys: list[str]) -> AmbiguousPathError:
        error = AmbiguousPathError(
            f"layer path {path!r} matches {len(keys)} keys of policy map {self._origin}: "
            f"{', '.join(repr(k) for k in keys)}; a path may match at most one regex key "
            "(add an exact key for it or make the regexes disjoint)"
        )
        error.path = path  # type: ignore[attr-defined]
        error.keys = tuple(keys)  # type: ignore[attr-defined]
        return error

    def _where(self, key: str) -> str:
        line = self._key_lines.get(key)
        return f" at line {line} of {self._origin}" if line is not None else ""
