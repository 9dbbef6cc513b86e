"""Tests for tfpolicy.analysis.policy_map, with Keras's own DTypePolicyMap as the oracle."""

from __future__ import annotations

import json
import signal
import time
import logging
from pathlib import Path

import keras
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfpolicy.analysis.policy_map import PolicyMap, PolicyMatch, describe_policy, is_quantized
from tfpolicy.errors import AmbiguousPathError, PolicyMapError

dp = keras.dtype_policies

PLAIN = {
    "default_policy": "float32",
    "policy_map": {
        "encoder/.*": "mixed_bfloat16",
        "head": "float32",
        "ffn/.*": {"name": "float8_from_mixed_bfloat16", "amax_history_length": 16},
        "dense_1": "int8_from_mixed_bfloat16",
    },
}


def _keras_map() -> dp.DTypePolicyMap:
    """A Keras map with one value of every kind tfpolicy must carry."""
    m = dp.DTypePolicyMap(default_policy="mixed_bfloat16")
    m["dense_1"] = "int8_from_mixed_bfloat16"
    m["ffn/.*"] = dp.QuantizedFloat8DTypePolicy(
        mode="float8", source_name="mixed_bfloat16", amax_history_length=16
    )
    m["head"] = "float32"
    return m


def _serialized(m: dp.DTypePolicyMap) -> str:
    return json.dumps(keras.saving.serialize_keras_object(m), indent=2)


def _write(tmp_path: Path, text: str, name: str = "map.json") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _assert_same_policy(ours: dp.DTypePolicy, theirs: dp.DTypePolicy) -> None:
    assert type(ours) is type(theirs)
    assert ours == theirs
    assert describe_policy(ours) == describe_policy(theirs)


# ------------------------------------------------------------------ the forms


@pytest.mark.parametrize("via", ["dict", "file", "text"])
def test_plain_form(tmp_path: Path, via: str) -> None:
    if via == "dict":
        pm = PolicyMap.load(PLAIN)
    elif via == "file":
        pm = PolicyMap.load(_write(tmp_path, json.dumps(PLAIN, indent=2)))
    else:
        pm = PolicyMap.from_json_text(json.dumps(PLAIN))
    assert pm.keys == ("encoder/.*", "head", "ffn/.*", "dense_1")
    assert pm.default_policy.name == "float32"
    assert pm.lookup("encoder/attn").policy.name == "mixed_bfloat16"
    assert pm.lookup("encoder/attn").key == "encoder/.*"
    ffn = pm.lookup("ffn/up").policy
    assert isinstance(ffn, dp.QuantizedFloat8DTypePolicy)
    assert ffn.amax_history_length == 16
    assert describe_policy(ffn) == "float8_from_mixed_bfloat16(amax_history_length=16)"
    assert pm.lookup("dense_1").policy.name == "int8_from_mixed_bfloat16"
    assert pm.lookup("decoder") == PolicyMatch("decoder", None, pm.default_policy)


def test_plain_form_from_str_path(tmp_path: Path) -> None:
    path = _write(tmp_path, json.dumps(PLAIN))
    assert PolicyMap.load(str(path)).keys == PolicyMap.load(path).keys


@pytest.mark.parametrize("via", ["dict", "file"])
def test_keras_serialized_form_matches_keras_deserialization(tmp_path: Path, via: str) -> None:
    text = _serialized(_keras_map())
    pm = (
        PolicyMap.load(json.loads(text))
        if via == "dict"
        else PolicyMap.load(_write(tmp_path, text))
    )
    theirs = keras.saving.deserialize_keras_object(json.loads(text))
    assert pm.keys == tuple(theirs)
    _assert_same_policy(pm.default_policy, theirs.default_policy)
    for key in theirs:
        _assert_same_policy(pm.lookup(key).policy, theirs[key])
    assert pm.lookup("ffn/x").policy.amax_history_length == 16


def test_keras_form_with_null_default_uses_global_policy(caplog: pytest.LogCaptureFixture) -> None:
    m = dp.DTypePolicyMap()
    m["a"] = "bfloat16"
    m["q"] = "int8_from_mixed_bfloat16"
    document = json.loads(_serialized(m))  # Keras nulls the value names here.
    with caplog.at_level(logging.WARNING, logger="tfpolicy.analysis.policy_map"):
        pm = PolicyMap.load(document)
    theirs = dp.DTypePolicyMap.from_config(document["config"])
    assert pm.default_policy == keras.config.dtype_policy()
    for key in ("a", "q"):
        _assert_same_policy(pm.lookup(key).policy, theirs[key])
    assert "has no name" in caplog.text


def test_plain_form_with_missing_default_uses_global_policy() -> None:
    pm = PolicyMap.load({"policy_map": {"a": "bfloat16"}})
    assert pm.default_policy == keras.config.dtype_policy()
    assert PolicyMap.load({}).keys == ()


def test_plain_form_accepts_keras_serialized_values() -> None:
    value = keras.saving.serialize_keras_object(dp.get("int8_from_float32"))
    pm = PolicyMap.load({"policy_map": {"a": value}, "default_policy": value})
    assert pm.lookup("a").policy.name == "int8_from_float32"
    assert pm.default_policy.name == "int8_from_float32"


def test_quantized_policies_are_parsed_not_refused() -> None:
    names = ["int8_from_float32", "float8_from_bfloat16", "int4/128_from_float32",
             "gptq/4/128_from_float32", "int4_from_mixed_bfloat16"]
    pm = PolicyMap.load({"policy_map": {f"k{i}": n for i, n in enumerate(names)}})
    assert [pm.lookup(f"k{i}").policy.name for i in range(len(names))] == names
    assert all(is_quantized(pm.lookup(k).policy) for k in pm.keys)
    assert not is_quantized(dp.get("mixed_bfloat16"))


def test_float8_amax_history_length_default_and_explicit() -> None:
    pm = PolicyMap.load({"policy_map": {
        "a": "float8_from_float32",
        "b": {"name": "float8_from_float32"},
        "c": {"name": "float8_from_float32", "amax_history_length": 16},
    }})
    assert pm.lookup("a").policy.amax_history_length == 1024
    assert pm.lookup("b").policy.amax_history_length == 1024
    assert pm.lookup("c").policy.amax_history_length == 16
    assert describe_policy(pm.lookup("a").policy) == "float8_from_float32"
    assert describe_policy(pm.lookup("c").policy) == "float8_from_float32(amax_history_length=16)"
    assert PolicyMap.describe_policy(dp.get("mixed_bfloat16")) == "mixed_bfloat16"


# ----------------------------------------------------------- keras instances


def test_keras_instance_is_copied_and_never_mutated() -> None:
    m = dp.DTypePolicyMap()  # default None: Keras's get_config would null names
    m["dense_1"] = "bfloat16"
    m["enc/.*"] = "int8_from_mixed_bfloat16"
    pm = PolicyMap.load(m)
    assert m["dense_1"].name == "bfloat16"
    assert m["enc/x"].name == "int8_from_mixed_bfloat16"
    assert m._default_policy_arg is None
    assert pm.lookup("dense_1").policy is not m["dense_1"]
    del m["dense_1"]  # later edits of the user's map do not reach ours
    assert pm.lookup("dense_1").policy.name == "bfloat16"
    assert pm.keys == ("dense_1", "enc/.*")


def test_keras_instance_with_unvalidated_values() -> None:
    # The constructor does not validate policy_map; tfpolicy does.
    assert PolicyMap.load(dp.DTypePolicyMap(policy_map={"a": "bfloat16"})).lookup(
        "a"
    ).policy.name == "bfloat16"
    with pytest.raises(PolicyMapError, match="policy map key 'a': invalid dtype policy 'bf17'"):
        PolicyMap.load(dp.DTypePolicyMap(policy_map={"a": "bf17"}))
    with pytest.raises(PolicyMapError, match="not a valid regular expression"):
        PolicyMap.load(dp.DTypePolicyMap(policy_map={"a(": "bfloat16"}))


def test_policy_map_is_returned_as_is() -> None:
    pm = PolicyMap.load(PLAIN)
    assert PolicyMap.load(pm) is pm


def test_to_keras_is_a_fresh_equivalent_copy() -> None:
    pm = PolicyMap.load({"policy_map": {"a": "bfloat16", "enc/.*": "float16"}})
    k = pm.to_keras()
    assert isinstance(k, dp.DTypePolicyMap)
    assert k["a"].name == "bfloat16" and k["enc/x"].name == "float16"
    k.get_config()  # would null names if it shared our policies
    del k["a"]
    k["b"] = "float64"
    assert pm.lookup("a").policy.name == "bfloat16"
    assert pm.keys == ("a", "enc/.*")
    assert pm.to_keras() is not k


# -------------------------------------------------------------------- lookup


def _docstring_maps() -> tuple[PolicyMap, dp.DTypePolicyMap]:
    spec = {
        "encoder/layer_0/dense": "bfloat16",
        "encoder/.*": "float16",
        "decoder": "bfloat16",
    }
    theirs = dp.DTypePolicyMap(default_policy="float32")
    for key, value in spec.items():
        theirs[key] = value
    return PolicyMap.load({"default_policy": "float32", "policy_map": spec}), theirs


def test_keras_docstring_examples() -> None:
    pm, theirs = _docstring_maps()
    exact = pm.lookup("encoder/layer_0/dense")  # also fullmatches "encoder/.*"
    assert (exact.key, exact.policy.name) == ("encoder/layer_0/dense", "bfloat16")
    child = pm.lookup("encoder/attention/query")
    assert (child.key, child.policy.name) == ("encoder/.*", "float16")
    no_prefix = pm.lookup("decoder/attention")
    assert (no_prefix.key, no_prefix.policy.name, no_prefix.is_default) == (None, "float32", True)
    for path in ("encoder/layer_0/dense", "encoder/attention/query", "decoder/attention"):
        assert pm.lookup(path).policy.name == theirs[path].name


def test_ambiguous_path_names_path_and_both_keys() -> None:
    spec = {"encoder/.*": "float16", "encoder/attention/.*": "bfloat16"}
    pm = PolicyMap.load({"default_policy": "float32", "policy_map": spec})
    with pytest.raises(AmbiguousPathError) as info:
        pm.lookup("encoder/attention/query")
    message = str(info.value)
    assert "\n" not in message
    assert "'encoder/attention/query'" in message
    assert "'encoder/.*'" in message and "'encoder/attention/.*'" in message
    assert info.value.keys == ("encoder/.*", "encoder/attention/.*")
    assert isinstance(info.value, PolicyMapError)
    # An exact key resolves the ambiguity, as in Keras.
    spec["encoder/attention/query"] = "float64"
    assert PolicyMap.load({"policy_map": spec}).lookup("encoder/attention/query").key == (
        "encoder/attention/query"
    )


def test_lookup_none_path_gets_default() -> None:
    pm = PolicyMap.load({"default_policy": "mixed_bfloat16", "policy_map": {".*": "float32"}})
    assert pm.lookup(None) == PolicyMatch(None, None, pm.default_policy)
    assert pm.lookup("").key == ".*"


def test_unused_keys() -> None:
    pm = PolicyMap.load({"policy_map": {
        "dense_1": "bfloat16", "enc/.*": "float16", "head": "float32", "(a|b)/c": "float16",
    }})
    paths = ["dense_12", "enc/ffn", "b/c", None]
    assert pm.unused_keys(paths) == ["dense_1", "head"]
    assert pm.unused_keys(iter(["dense_1", "head"])) == ["enc/.*", "(a|b)/c"]
    assert pm.unused_keys([]) == list(pm.keys)


# -------------------------------------------------------------------- errors


def _load_error(tmp_path: Path, text: str) -> str:
    with pytest.raises(PolicyMapError) as info:
        PolicyMap.load(_write(tmp_path, text))
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '{\n  "policy_map": {\n    "encoder/(": "float32"\n  }\n}',
            "policy map key 'encoder/(' at line 3 of {f} is not a valid regular "
            "expression: missing ), unterminated subpattern at position 8",
        ),
        (
            '{"default_policy": "float32",\n "policy_map": {\n  "head": "float32",\n'
            '  "dense_1": "bfloat17"}}',
            "policy map key 'dense_1' at line 4 of {f}: invalid dtype policy 'bfloat17': "
            "Cannot convert 'bfloat17'",
        ),
        (
            '{"policy_map": {\n"dense_1": "int8_from_mixed_float16"}}',
            "policy map key 'dense_1' at line 2 of {f}: invalid dtype policy "
            "'int8_from_mixed_float16': Quantization mode='int8' doesn't work well with "
            "compute_dtype='float16'.",
        ),
        (
            '{"policy_map": {\n  "a": "float32",\n  "b": "float32",\n  "a": "bfloat16"}}',
            "policy map {f}: duplicate key 'a' at line 4 (first at line 2)",
        ),
        ('{"policy_map": {\n  "a": "float32",\n}}', "policy map {f} is not valid JSON: "
         "Expecting property name enclosed in double quotes at line 3 column 1"),
        ("", "policy map {f} is not valid JSON: Expecting value at line 1 column 1"),
        ('["float32"]', "policy map {f}: expected a JSON object at the top level, got an array"),
        ('{"default": "float32"}', "policy map {f}: unknown field(s) 'default'"),
        ('{"policy_map": ["a"]}', "policy map policy_map at line 1 of {f}: expected an object"),
        ('{"default_policy": "mixed_bfloat17"}',
         "policy map default_policy at line 1 of {f}: invalid dtype policy 'mixed_bfloat17'"),
        ('{"default_policy": {"class_name": "DTypePolicyMap", "config": {}}}',
         "policy map default_policy at line 1 of {f}: a policy must not itself be a "
         "DTypePolicyMap"),
        ('{"policy_map": {"a": {"class_name": "DTypePolicyMap", "config": {}}}}',
         "must not itself be a DTypePolicyMap"),
        ('{"policy_map": {"a": {"class_name": "NoSuchPolicy", "config": {}}}}',
         "policy map key 'a' at line 1 of {f}: "
         '{"class_name": "NoSuchPolicy", "config": {}} is not a dtype policy'),
        ('{"policy_map": {"a": {"class_name": "DTypePolicy", "config": {"nme": "float32"}}}}',
         "unexpected keyword argument 'nme'"),
        ('{"policy_map": {"a": null}}', "policy map key 'a' at line 1 of {f}: expected a "
         "policy name or an object, got null"),
        ('{"policy_map": {"a": 3}}', "expected a policy name or an object, got a number 3"),
        ('{"policy_map": {"a": {"name": "float32", "amax_history_length": 16}}}',
         "amax_history_length applies only to float8 policies, not 'float32'"),
        ('{"policy_map": {"a": {"name": "float8_from_float32", "amax_history_length": 0}}}',
         "amax_history_length must be a positive integer, got 0"),
        ('{"policy_map": {"a": {"name": "float8_from_float32", "amax_history_length": "16"}}}',
         "amax_history_length must be a positive integer, got '16'"),
        ('{"policy_map": {"a": {"name": "float8_from_float32", "amax": 16}}}',
         "unknown field(s) 'amax'"),
        ('{"class_name": "DTypePolicy", "config": {"name": "float32"}}',
         "policy map {f}: expected class_name 'DTypePolicyMap', got 'DTypePolicy'"),
        ('{"class_name": "DTypePolicyMap", "config": {"policy_map": {}, "x": 1}}',
         "policy map {f}: 'config': unknown field(s) 'x'"),
        ('{"class_name": "DTypePolicyMap", "config": {"policy_map": {\n"a(": "float32"}}}',
         "policy map key 'a(' at line 2 of {f} is not a valid regular expression"),
    ],
)
def test_error_is_one_line_and_located(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "map.json"
    assert expected.replace("{f}", str(path)) in _load_error(tmp_path, text)


def test_unreadable_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    with pytest.raises(PolicyMapError, match=r"cannot read policy map .*missing\.json: "):
        PolicyMap.load(missing)
    with pytest.raises(PolicyMapError, match="cannot read policy map"):
        PolicyMap.load(tmp_path)  # a directory
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00{")
    with pytest.raises(PolicyMapError, match="cannot read policy map"):
        PolicyMap.load(binary)


def test_dict_errors_have_no_line() -> None:
    with pytest.raises(PolicyMapError) as info:
        PolicyMap.load({"policy_map": {"encoder/(": "float32"}})
    assert str(info.value).startswith("policy map key 'encoder/(' is not a valid regular")
    with pytest.raises(PolicyMapError, match=r"policy map key 3 must be a string, got int"):
        PolicyMap.load({"policy_map": {3: "float32"}})
    with pytest.raises(PolicyMapError, match="policy map key 'd': invalid dtype policy 'bf'"):
        PolicyMap.load({"policy_map": {"d": "bf"}})
    with pytest.raises(PolicyMapError, match="cannot load a policy map from a list"):
        PolicyMap.load(["float32"])  # type: ignore[arg-type]
    with pytest.raises(PolicyMapError, match="expected a JSON object at the top level"):
        PolicyMap.from_json_text("3")


# ---------------------------------------------------- Keras as the oracle

_KEY_POOL = [
    "dense_1", "dense_12", "enc/ffn", "enc/attn", "head", "b/c",
    "dense_.*", "enc/.*", "(a|b)/c", ".*/ffn", "dense_1.*", ".*", "enc/(ffn|attn)",
]
_PATHS = [
    "dense_1", "dense_12", "dense_", "enc/ffn", "enc/attn", "enc", "enc/ffn/x",
    "a/c", "b/c", "c", "head", "x/ffn", "", "dense_.*", "enc/.*",
]
_POLICIES = ["float32", "bfloat16", "float16", "mixed_bfloat16", "mixed_float16", "float64"]


@settings(max_examples=200, deadline=None)
@given(
    spec=st.dictionaries(st.sampled_from(_KEY_POOL), st.sampled_from(_POLICIES), max_size=6),
    default=st.sampled_from(_POLICIES),
)
def test_lookup_agrees_with_keras(spec: dict[str, str], default: str) -> None:
    theirs = dp.DTypePolicyMap(default_policy=default)
    for key, value in spec.items():
        theirs[key] = value
    ours = PolicyMap.load({"default_policy": default, "policy_map": spec})
    used = set()
    for path in _PATHS:
        try:
            expected = theirs[path].name
        except ValueError:
            with pytest.raises(AmbiguousPathError):
                ours.lookup(path)
            continue
        match = ours.lookup(path)
        assert match.policy.name == expected
        assert (spec[match.key] if match.key is not None else default) == expected
        if match.key is not None:
            used.add(match.key)
    assert used.isdisjoint(ours.unused_keys(_PATHS))


# ---------------------------------------------------------------- hostile maps


def test_a_catastrophically_backtracking_key_is_an_error_naming_it_not_a_hang():
    pm = PolicyMap.load({"default_policy": "float32", "policy_map": {"(a+)+": "mixed_bfloat16", "dense": "float32"}})
    started = time.monotonic()
    with pytest.raises(PolicyMapError, match=r"key '\(a\+\)\+' takes over 2 s to match the layer path 'a+b'"):
        pm.lookup("a" * 40 + "b")
    assert time.monotonic() - started < 10
    with pytest.raises(PolicyMapError, match="backtracks catastrophically"):
        pm.unused_keys(["a" * 40 + "b"])
    assert pm.lookup("aaaa").key == "(a+)+"  # the limit leaves ordinary matches alone
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_deeply_nested_json_map_is_an_error_not_a_recursion_error(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(PolicyMapError, match="nests arrays or objects more than 32 levels deep"):
        PolicyMap.load(path)
    # Brackets inside strings are not nesting.
    text = json.dumps({"default_policy": "float32", "policy_map": {"\\[" * 50 + "x": "float32"}})
    assert PolicyMap.from_json_text(text).keys == ("\\[" * 50 + "x",)


@pytest.mark.parametrize("length", [10**12, 0, 2**20 + 1])
def test_amax_history_lengths_that_cannot_be_built_are_errors_in_both_forms(length):
    plain = {"default_policy": "float32",
             "policy_map": {"d": {"name": "float8_from_float32", "amax_history_length": length}}}
    with pytest.raises(PolicyMapError, match="amax_history_length must be"):
        PolicyMap.load(plain)
    if length < 1:
        return  # Keras itself refuses it when the serialized form is deserialized
    keras_map = dp.DTypePolicyMap(default_policy="float32")
    keras_map["d"] = dp.QuantizedFloat8DTypePolicy(mode="float8", source_name="float32", amax_history_length=length)
    text = json.dumps(keras.saving.serialize_keras_object(keras_map))
    with pytest.raises(PolicyMapError, match=f"amax_history_length must be between 1 and {2**20}.*got {length}"):
        PolicyMap.from_json_text(text)


def test_an_int4_block_too_large_to_build_is_an_error():
    with pytest.raises(PolicyMapError, match="int4 block size must be at most 65536.*got 100000000000000000000"):
        PolicyMap.load({"default_policy": "float32", "policy_map": {"d": "int4/100000000000000000000_from_float32"}})
    assert PolicyMap.load({"default_policy": "int4/128_from_float32"}).default_policy.block_size == 128
