"""Real architectures through tfpolicy, measured against Keras applying the same map.

    python tools/realmodels.py [--models bert,llama,...] [--maps bf16,int8,...] [--target gpu]
                               [--workdir DIR] [--json OUT] [--markdown]

For every (model, map) it exports the float32 model once (``model.export``,
tf-keras ``save_format="tf"``), rewrites it with tfpolicy's default settings
(serving checks on), and runs the input, the output and, for Keras 3 models,
the same model with the map applied natively (``layer.dtype_policy =
pm[layer.path]``) on the same batch. It prints one row per pair::

    model       map    ok  e_tool   e_keras  ratio  rewrite s  floor s
    bert        bf16   ok  0.0061   0.0058   1.05   3.1        1.2

``e_tool`` and ``e_keras`` are ``max|y - y_fp32| / max|y_fp32|`` over every
output; Keras's model runs as a graph (``tf.function``), as its own export
serves it. The floor is TensorFlow's own load + save of the same SavedModel.

The models (random weights, tiny configs so that the whole table runs on two
CPU cores in minutes): keras_hub ``BertBackbone``, ``DistilBertBackbone``,
``GPT2Backbone``, ``LlamaBackbone``, ``T5Backbone`` (2 layers, hidden 64,
vocabulary 1000, sequence 32); keras.applications ``ResNet50``, ``MobileNetV3Small``,
``ConvNeXtTiny`` (64x64x3, 10 classes, logits, BatchNorm statistics set from
data); tf-keras ``MobileNetV2``. The maps: all ``mixed_bfloat16``;
``int8_from_mixed_bfloat16`` on every Dense/EinsumDense/Conv layer (whose
convolutions both Keras and tfpolicy keep in ``mixed_bfloat16``, Keras having
no int8 convolution), and ``int8conv``, the same map with
``int8_convolutions=True`` (CNNs only; the Keras side still keeps them);
``int4/128_from_mixed_bfloat16`` on the Dense/EinsumDense layers;
``float8_from_mixed_bfloat16`` (history 16) on the Dense/EinsumDense layers,
calibrated; and a per-layer mix of exact and regex keys over the model's real
layer paths.

``--target`` rewrites with that serving target. With ``gpu`` the serving
checks include the device-kernel check, and each row adds what XLA receives
for ``serving_default`` (the output's HLO): its dots on ``s8`` operands and its
converts to ``f8e4m3fn``, the int8 and float8 GEMM patterns.

The module is also the tests' real-model zoo (``tests/test_real_models.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Optional

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

SEQUENCE = 32
VOCABULARY = 1000
IMAGE = (64, 64, 3)
BATCH = 4
CALIBRATION_BATCHES = 4
TEXT_MODELS = ("bert", "distilbert", "gpt2", "llama", "t5", "deberta", "gemma", "whisper", "mixtral")
MELS = 16
MODELS = (*TEXT_MODELS, "resnet50", "mobilenetv3small", "convnexttiny", "tfkeras_mobilenetv2", "decoding_loop")
MAPS = ("bf16", "int8", "int8conv", "int4", "float8", "mix")
# The maps' rewrite options: int8conv is int8's map with the convolutions quantized too.
REWRITE_OPTIONS = {"int8conv": {"int8_convolutions": True}}
INT4_POLICY = "int4/128_from_mixed_bfloat16"  # Keras's default int4 block, as its setter quantizes
FLOAT8_POLICY = {"name": "float8_from_mixed_bfloat16", "amax_history_length": 16}
DENSE_CLASSES = ("Dense", "EinsumDense")
CONV_CLASSES = ("Conv1D", "Conv2D", "DepthwiseConv2D", "Conv2DTranspose", "SeparableConv2D")


@dataclasses.dataclass
class RealModel:
    """One exported model and what the comparisons need."""

    name: str
    saved_model_dir: pathlib.Path
    inputs: dict[str, np.ndarray]  # serving_default inputs, one batch
    calibration: list[dict[str, np.ndarray]]
    layers: dict[str, str]  # Keras layer path -> class name (layers with a path)
    rebuild: Optional[Callable[[str], Any]]  # Keras 3: a fresh copy under a global policy, same weights
    owners: frozenset[str] = frozenset()  # Keras 3: paths of the layers that own variables


# -- builders ---------------------------------------------------------------------


def _token_inputs(rng: np.random.Generator, batch: int, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Token ids, padding masks and segment ids, for each input named so (T5: ``encoder_token_ids``, ...)."""
    arrays = {}
    for name in names:
        if name.endswith("token_ids"):
            arrays[name] = rng.integers(1, VOCABULARY, size=(batch, SEQUENCE)).astype("int32")
        elif name.endswith("padding_mask"):
            mask = np.ones((batch, SEQUENCE), dtype="int32")
            mask[: batch // 2, SEQUENCE * 3 // 4 :] = 0  # some padding, hidden by the mask
            arrays[name] = mask
        elif name == "encoder_features":  # log-mel frames, twice the sequence (the encoder halves it)
            arrays[name] = rng.normal(0, 1, size=(batch, 2 * SEQUENCE, MELS)).astype("float32")
        elif name == "segment_ids":
            arrays[name] = (np.arange(SEQUENCE)[None, :] >= SEQUENCE // 2).astype("int32").repeat(batch, 0)
        else:
            raise KeyError(f"no test input for {name!r}")
    return arrays


def _keras_hub(name: str) -> Callable[[], Any]:
    def build() -> Any:
        import keras  # noqa: PLC0415
        import keras_hub  # noqa: PLC0415

        keras.utils.set_random_seed(7)
        common = dict(vocabulary_size=VOCABULARY, num_layers=2, hidden_dim=64, intermediate_dim=128)
        if name == "llama":
            return keras_hub.models.LlamaBackbone(num_query_heads=4, num_key_value_heads=2, **common)
        if name == "t5":  # an encoder-decoder whose TF variable names collide (eleven ``..._layer_0/kernel``)
            return keras_hub.models.T5Backbone(num_heads=4, key_value_dim=16, **common)
        if name == "deberta":  # disentangled attention: relative embeddings with their own LayerNorm
            return keras_hub.models.DebertaV3Backbone(num_heads=4, max_sequence_length=SEQUENCE, bucket_size=16,
                                                      dropout=0.0, **common)
        if name == "gemma":  # RoPE, GeGLU, (1 + scale) RMSNorm, a scaled embedding
            return keras_hub.models.GemmaBackbone(num_query_heads=4, num_key_value_heads=1, head_dim=16, **common)
        if name == "whisper":  # an audio encoder-decoder: log-mel frames in, strided convolutions first
            return keras_hub.models.WhisperBackbone(num_heads=4, num_mels=MELS, max_encoder_sequence_length=2 * SEQUENCE,
                                                    max_decoder_sequence_length=SEQUENCE, **common)
        if name == "mixtral":  # a mixture of experts with a sliding window
            return keras_hub.models.MixtralBackbone(num_query_heads=4, num_key_value_heads=2, num_experts=4,
                                                    sliding_window=16, **common)
        cls = {"bert": "BertBackbone", "distilbert": "DistilBertBackbone", "gpt2": "GPT2Backbone"}[name]
        return getattr(keras_hub.models, cls)(num_heads=4, max_sequence_length=SEQUENCE, **common)

    return build


def _fresh_names(keras: Any) -> None:
    """Restart Keras's automatic layer names, so that a rebuilt copy's layers have the export's paths.

    keras_hub leaves many layers to their automatic names (``dense_3``,
    ``t5_layer_norm_4``), which count up per process: without this, the copy
    the oracle builds would be ``dense_57`` and the map's keys would miss it.
    """
    keras.backend.clear_session()  # also resets the global dtype policy


def _application(name: str) -> Callable[[], Any]:
    def build() -> Any:
        import keras  # noqa: PLC0415

        keras.utils.set_random_seed(7)
        cls = {"resnet50": "ResNet50", "mobilenetv3small": "MobileNetV3Small", "convnexttiny": "ConvNeXtTiny"}[name]
        return getattr(keras.applications, cls)(
            weights=None, input_shape=IMAGE, classes=10, classifier_activation=None
        )

    return build


RESIDUAL_GAMMA = 0.6
"""Scale of the BatchNorm gammas that feed a residual Add (see :func:`_condition`)."""


def _condition(model: Any, images: np.ndarray) -> None:
    """Make a random-weight CNN a meaningful test of precision.

    Random BatchNorm networks are chaotic: at initialisation a ResNet50 turns
    bfloat16's 0.4% rounding into 70% output error, in Keras as in tfpolicy,
    and errors measure the chaos, not the precision. Damping each residual
    branch's last BatchNorm after setting the moving statistics from data
    (gamma x 0.6, as zero-init residuals and ConvNeXt's layer scale do) gives
    outputs that vary with the image and errors of a few percent.
    """
    _set_batchnorm_statistics(model, images)
    for layer in _residual_norms(model):
        layer.gamma.assign(np.asarray(layer.gamma) * RESIDUAL_GAMMA)


def _residual_norms(model: Any) -> list[Any]:
    found = []
    for layer in model.layers:
        if type(layer).__name__ != "Add":
            continue
        for node in layer._inbound_nodes:
            histories = [t._keras_history for t in node.input_tensors]
            sources = [getattr(h, "operation", None) or h.layer for h in histories]  # Keras 3, tf-keras
            found.extend(s for s in sources if "BatchNormalization" in type(s).__name__ and s not in found)
    return found


def _set_batchnorm_statistics(model: Any, images: np.ndarray) -> None:
    """Moving statistics from one training-mode pass, so random-weight outputs vary."""
    norms = [layer for layer in model._flatten_layers() if "BatchNormalization" in type(layer).__name__]
    for layer in norms:
        layer.momentum = 0.0
    model(images, training=True)
    for layer in norms:
        layer.momentum = 0.99


def _images(rng: np.random.Generator, batch: int) -> np.ndarray:
    """Smooth random pictures in [0, 255] that differ from each other (uniform
    noise pools to the same features for every image)."""
    import tensorflow as tf  # noqa: PLC0415

    coarse = rng.uniform(0, 255, size=(batch, 4, 4, IMAGE[2])).astype("float32")
    smooth = tf.image.resize(coarse, IMAGE[:2], method="bicubic").numpy()
    return np.clip(smooth + rng.normal(0, 8, size=smooth.shape), 0, 255).astype("float32")


def _keras3(name: str, directory: pathlib.Path) -> RealModel:
    import keras  # noqa: PLC0415

    rng = np.random.default_rng(11)
    text = name in TEXT_MODELS
    build = _keras_hub(name) if text else _application(name)
    _fresh_names(keras)
    model = build()
    if text:
        names = tuple(sorted(model.input.keys())) if isinstance(model.input, dict) else ("token_ids",)
        inputs = _token_inputs(rng, BATCH, names)
        calibration = [_token_inputs(rng, BATCH, names) for _ in range(CALIBRATION_BATCHES)]
    else:
        _condition(model, _images(rng, 16))
        inputs = {"inputs": _images(rng, BATCH)}
        calibration = [{"inputs": _images(rng, BATCH)} for _ in range(CALIBRATION_BATCHES)]
    model.export(str(directory), verbose=False)
    rebuild = rebuilder(build, [np.array(w) for w in model.get_weights()], fresh_names=True)
    inputs = _signature_names(directory, inputs)
    calibration = [_signature_names(directory, batch) for batch in calibration]
    sublayers = [layer for layer in model._flatten_layers(include_self=False) if layer.path]
    layers = {layer.path: type(layer).__name__ for layer in sublayers}
    owners = frozenset(layer.path for layer in sublayers if layer._trainable_variables or layer._non_trainable_variables)
    return RealModel(name, directory, inputs, calibration, layers, rebuild, owners)


def _signature_names(directory: pathlib.Path, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Keras names a single image input after its layer; match the signature's names."""
    import tensorflow as tf  # noqa: PLC0415

    specs = tf.saved_model.load(str(directory)).signatures["serving_default"].structured_input_signature[1]
    if set(specs) == set(arrays):
        return arrays
    if len(specs) == 1 and len(arrays) == 1:
        return {next(iter(specs)): next(iter(arrays.values()))}
    raise ValueError(f"inputs {sorted(arrays)} do not fit the signature's {sorted(specs)}")


def _tfkeras_mobilenetv2(directory: pathlib.Path) -> RealModel:
    import tf_keras  # noqa: PLC0415

    tf_keras.utils.set_random_seed(7)
    model = tf_keras.applications.MobileNetV2(
        weights=None, input_shape=IMAGE, classes=10, classifier_activation=None
    )
    rng = np.random.default_rng(11)
    _condition(model, _images(rng, 16))
    model.save(str(directory), save_format="tf")
    inputs = _signature_names(directory, {"input": _images(rng, BATCH)})
    calibration = [_signature_names(directory, {"input": _images(rng, BATCH)}) for _ in range(CALIBRATION_BATCHES)]
    layers = {layer.name: type(layer).__name__ for layer in model.layers if layer.weights}
    return RealModel("tfkeras_mobilenetv2", directory, inputs, calibration, layers, None)


LOOP_STEPS = 4
LOOP_WIDTH = 16
LOOP_VOCABULARY = 50


def decoding_loop_module() -> Any:
    """A ``tf.Module`` serving greedy decoding: a ``tf.while_loop`` with a ``tf.cond`` in its body.

    ``decode(state, steps)`` loops; ``unrolled(state)`` runs the same ops
    :data:`LOOP_STEPS` times outside any loop (the oracle of
    ``tests/test_control_flow.py``). Layers, by name scope: ``embed``, ``cell``, ``head``.
    """
    import tensorflow as tf  # noqa: PLC0415

    STEPS, WIDTH, VOCABULARY = LOOP_STEPS, LOOP_WIDTH, LOOP_VOCABULARY  # noqa: N806

    class DecodingLoop(tf.Module):
        """Greedy decoding: embed the last token, a tanh cell, a head; every other step halves the state."""

        def __init__(self) -> None:
            super().__init__(name="decoder")
            rng = np.random.default_rng(0)
            with tf.name_scope("embed"):
                self.embed = tf.Variable(rng.standard_normal((VOCABULARY, WIDTH)).astype("float32") * 0.3, name="embeddings")
            with tf.name_scope("cell"):
                self.cell = tf.Variable(rng.standard_normal((2 * WIDTH, WIDTH)).astype("float32") * 0.3, name="kernel")
            with tf.name_scope("head"):
                self.head = tf.Variable(rng.standard_normal((WIDTH, VOCABULARY)).astype("float32") * 0.3, name="kernel")

        def _step(self, i, state, token, halve):
            with tf.name_scope("embed"):
                e = tf.gather(self.embed, token)
            with tf.name_scope("cell"):
                h = tf.tanh(tf.matmul(tf.concat([state, e], -1), self.cell))
            h = halve(h)
            with tf.name_scope("head"):
                out = tf.matmul(h, self.head)
            return h, tf.argmax(out, -1, output_type=tf.int32), out

        @tf.function(input_signature=[tf.TensorSpec([None, WIDTH], tf.float32), tf.TensorSpec([], tf.int32)])
        def decode(self, state, steps):
            logits = tf.TensorArray(tf.float32, size=steps)
            token = tf.zeros([tf.shape(state)[0]], tf.int32)

            def body(i, state, token, logits):
                halve = lambda h: tf.cond(i % 2 == 0, lambda: h, lambda: h * 0.5)  # noqa: E731
                state, token, out = self._step(i, state, token, halve)
                return i + 1, state, token, logits.write(i, out)

            _, state, _, logits = tf.while_loop(lambda i, *_: i < steps, body, [0, state, token, logits])
            return {"logits": tf.transpose(logits.stack(), [1, 0, 2]), "state": state}

        @tf.function(input_signature=[tf.TensorSpec([None, WIDTH], tf.float32)])
        def unrolled(self, state):
            token = tf.zeros([tf.shape(state)[0]], tf.int32)
            logits = []
            for i in range(STEPS):
                state, token, out = self._step(i, state, token, lambda h, i=i: h if i % 2 == 0 else h * 0.5)
                logits.append(out)
            return {"logits": tf.stack(logits, 1), "state": state}

    return DecodingLoop()


def _decoding_loop(directory: pathlib.Path) -> RealModel:
    import tensorflow as tf  # noqa: PLC0415

    module = decoding_loop_module()
    tf.saved_model.save(module, str(directory), signatures={"serving_default": module.decode})
    rng = np.random.default_rng(11)

    def batch() -> dict[str, np.ndarray]:
        return {"state": rng.standard_normal((BATCH, LOOP_WIDTH)).astype("float32"), "steps": np.int32(LOOP_STEPS)}

    layers = {"embed": "Embedding", "cell": "Dense", "head": "Dense"}
    return RealModel("decoding_loop", directory, batch(), [batch() for _ in range(CALIBRATION_BATCHES)], layers, None)


def build(name: str, directory: pathlib.Path) -> RealModel:
    """Export model ``name`` (one of :data:`MODELS`) under ``directory``."""
    directory = pathlib.Path(directory)
    if directory.exists():
        shutil.rmtree(directory)
    if name == "tfkeras_mobilenetv2":
        return _tfkeras_mobilenetv2(directory)
    if name == "decoding_loop":
        return _decoding_loop(directory)
    if name not in MODELS:
        raise KeyError(f"no real model {name!r}; known: {', '.join(MODELS)}")
    return _keras3(name, directory)


# -- maps ---------------------------------------------------------------------------


def policy_map(model: RealModel, which: str) -> dict:
    """The plain-form policy map ``which`` (one of :data:`MAPS`) for ``model``'s layers."""
    dense = sorted(p for p, c in model.layers.items() if c in DENSE_CLASSES)
    conv = sorted(p for p, c in model.layers.items() if c in CONV_CLASSES)
    if which == "bf16":
        return {"default_policy": "mixed_bfloat16"}
    if which in ("int8", "int8conv"):
        return {"default_policy": "mixed_bfloat16",
                "policy_map": {p: "int8_from_mixed_bfloat16" for p in dense + conv}}
    if which == "int4":
        return {"default_policy": "mixed_bfloat16", "policy_map": {p: INT4_POLICY for p in dense}}
    if which == "float8":
        return {"default_policy": "mixed_bfloat16", "policy_map": {p: FLOAT8_POLICY for p in dense}}
    if which == "mix" and model.name in BLOCK_MIX:
        # Whole blocks: float32 for the first, float16 for the second (their
        # sublayers by a regex), where Keras cannot mix dtypes inside a block.
        blocks = [p for p in model.layers if "/" not in p and any(q.startswith(p + "/") for q in model.layers)]
        return {"default_policy": "mixed_bfloat16",
                "policy_map": {f"{_escape(blocks[0])}(/.*)?": "float32", f"{_escape(blocks[1])}(/.*)?": "mixed_float16"}}
    if which == "mix":
        # The second Dense/Conv layer in model order exactly, the next three by a
        # regex: float32 and float16 layers inside a bfloat16 model.
        ordered = [p for p, c in model.layers.items() if c in DENSE_CLASSES + CONV_CLASSES]
        mapping = {ordered[1]: "float32"}
        if len(ordered) > 2:
            mapping["|".join(_escape(p) for p in ordered[2:5])] = "mixed_float16"
        return {"default_policy": "mixed_bfloat16", "policy_map": mapping}
    raise KeyError(f"no map {which!r}; known: {', '.join(MAPS)}")


def quantizes_convolutions(model: RealModel, which: str) -> bool:
    """Whether map ``which`` quantizes a convolution, which Keras cannot (it keeps the source policy)."""
    return REWRITE_OPTIONS.get(which, {}).get("int8_convolutions", False) and any(
        model.layers.get(key) in CONV_CLASSES for key in policy_map(model, which).get("policy_map", {})
    )


BLOCK_MIX = frozenset({"gemma"})
"""Models whose blocks combine their sublayers' outputs with plain ops (Gemma's gated feed-forward
multiplies two projections): Keras raises TypeError when those differ in dtype, so their mix is per block."""
UNSEEN_CASTS = {
    ("llama", "mix"): "keras_hub's Llama casts its SiLU gate to the block's compute dtype before multiplying it"
                      " with the intermediate projection; in a float32 export that cast is float32 to float32,"
                      " absent from the graph, so a gate layer mapped to float32 inside a bfloat16 block is"
                      " rounded in Keras where tfpolicy cannot see it (max error 1.16x Keras's, RMS 0.92-0.94x)",
}
"""(model, map) pairs where Keras rounds in code a float32 export does not show: in the table, not the tests."""
KERAS_CANNOT = {
    ("t5", "mix"): "keras_hub's T5 multiplies its gate and input projections and hands the first layer's"
                   " position bias to every other as a plain tensor: Keras raises TypeError when the layers"
                   " differ in dtype, per layer or per block (tfpolicy casts, as for any mixed map)",
}
"""(model, map) pairs that Keras itself cannot run, so there is no oracle to compare with."""


def applies(model: RealModel, which: str) -> bool:
    """Whether map ``which`` means something on ``model`` (int8conv: a model with convolutions) and Keras can run it."""
    if (model.name, which) in KERAS_CANNOT:
        return False
    return which != "int8conv" or quantizes_convolutions(model, which)


def _escape(path: str) -> str:
    import re  # noqa: PLC0415

    return re.escape(path)


def keras_map(plain: dict, model: RealModel) -> Any:
    """The Keras DTypePolicyMap for the Keras side: conv layers keep the source policy."""
    import keras  # noqa: PLC0415

    mapping = {}
    for key, policy in plain.get("policy_map", {}).items():
        if model.layers.get(key) in CONV_CLASSES and str(policy).startswith("int8_from_"):
            policy = policy[len("int8_from_") :]
        mapping[key] = _float8(policy) if isinstance(policy, dict) else keras.dtype_policies.get(policy)
    return keras.dtype_policies.DTypePolicyMap(default_policy=plain["default_policy"], policy_map=mapping)


def _float8(spec: dict) -> Any:
    import keras  # noqa: PLC0415

    return keras.dtype_policies.QuantizedFloat8DTypePolicy(
        "float8", spec["name"][len("float8_from_") :], amax_history_length=spec["amax_history_length"]
    )


def keras_native(model: RealModel, plain: dict, scales: Optional[dict[str, float]] = None,
                 policy_map: Any = None) -> dict[str, np.ndarray]:
    """Outputs of the model with the map applied in Keras itself.

    ``scales`` (float8): variable path -> value copied into the Keras layers
    after quantization (the tool's calibrated ``inputs_scale`` / ``kernel_scale``).
    ``policy_map``: a Keras ``DTypePolicyMap`` to apply as it is (``plain``
    gives only its default), instead of :func:`keras_map` of ``plain``.
    """
    import keras  # noqa: PLC0415

    if policy_map is not None:
        native = keras_applied(model.rebuild, policy_map)
    else:
        # Built under the map's default policy, as a model built with ``dtype=pm``
        # is: layers without a path (Dropout, Activation, Softmax) take the
        # default, and the float32 pins of keras_hub's code stay; then every
        # layer with a path gets ``pm[layer.path]`` (the setter quantizes).
        native = model.rebuild(plain["default_policy"])
        pm = keras_map(plain, model)
        for layer in native._flatten_layers(include_self=False):
            if layer.path:
                layer.dtype_policy = pm[layer.path]
    if scales:
        for variable in native.variables:
            if variable.path in scales:
                variable.assign(np.asarray(scales[variable.path], dtype=variable.dtype))
    # As a graph, the way Keras's own export serves it: grappler fuses ops
    # (Conv2D + BiasAdd + activation) that eager execution rounds apart, which
    # on a chaotic random-weight CNN moves the bfloat16 error by half.
    import tensorflow as tf  # noqa: PLC0415

    # Traced for the inputs' dynamic shapes, as ``model.export`` traces:
    # keras's einsum picks a different op (BatchMatMul, not Einsum) when the
    # shapes are static, which rounds differently in float16.
    feeds = {k: tf.constant(v) for k, v in model.inputs.items()}
    args = feeds if len(feeds) > 1 else next(iter(feeds.values()))
    spec = keras.tree.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), native.input)
    if isinstance(spec, dict) != isinstance(args, dict):
        raise ValueError(f"{model.name}: inputs {sorted(feeds)} do not fit the model's {spec}")
    outputs = tf.function(lambda x: native(x, training=False), input_signature=[spec])(args)
    return _as_dict(keras.ops.convert_to_numpy, outputs)


def keras_applied(rebuild: Callable[[Any], Any], policy_map: Any) -> Any:
    """The model with a Keras ``DTypePolicyMap`` applied by Keras, from its float weights.

    ``rebuild(policy)`` builds the model under a global policy and sets the
    float weights. Built under the map itself, each quantized policy replaced
    by its source: every layer creates its variables in its own policy's
    dtype (a bfloat16 layer's kernel is bfloat16, where a float32 layer given
    a bfloat16 policy after its build keeps float32 variables and computes in
    float32). Then every layer the map quantizes is given its policy, and the
    setter quantizes the kernel it stores; a layer Keras cannot quantize (no
    ``quantize()``: LayerNormalization, Conv2D, Add) stays in the source
    policy, as it computes built under the quantized one.
    """
    import keras  # noqa: PLC0415

    built_under = unquantized_map(policy_map)
    native = rebuild(built_under)
    for layer in native._flatten_layers(include_self=False):
        if not layer.path or type(layer).quantize is keras.layers.Layer.quantize:
            continue
        if policy_map[layer.path].quantization_mode is not None:
            # quantize() cannot start from a layer that holds a DTypePolicyMap ("Cannot convert
            # 'map_bfloat16'", keras-semantics.md section 6): the layer takes its own policy first.
            layer._dtype_policy = built_under[layer.path]
            layer.dtype_policy = policy_map[layer.path]
    return native


def rebuilder(build: Callable[[], Any], weights: Optional[list] = None,
              fresh_names: bool = False) -> Callable[[Any], Any]:
    """``rebuild(policy)`` for :func:`keras_applied`: ``build()`` under a global policy (a name or a
    ``DTypePolicyMap``), given ``weights`` (default: those of one ``build()`` in float32, ``build``
    seeded). ``fresh_names``: Keras's layer names restarted first, so that they match the export's."""
    import keras  # noqa: PLC0415

    weights = build().get_weights() if weights is None else weights

    def rebuild(policy: Any = "float32") -> Any:
        previous = keras.config.dtype_policy()
        if fresh_names:
            _fresh_names(keras)  # before the policy: it resets the global policy too
        keras.config.set_dtype_policy(policy)
        try:
            fresh = build()
        finally:
            keras.config.set_dtype_policy(previous)
        fresh.set_weights(weights)
        return fresh

    return rebuild


def unquantized_map(policy_map: Any) -> Any:
    """A Keras ``DTypePolicyMap`` with each quantized policy (the default too) replaced by its source."""
    import keras  # noqa: PLC0415

    return keras.dtype_policies.DTypePolicyMap(
        default_policy=_unquantized(policy_map.default_policy),
        policy_map={key: _unquantized(policy) for key, policy in policy_map.items()})


def _unquantized(policy: Any) -> Any:
    """A quantized Keras policy's source policy (``int8_from_bfloat16`` -> ``bfloat16``); others, as they are."""
    import keras  # noqa: PLC0415

    if getattr(policy, "quantization_mode", None) is None:
        return policy
    return keras.dtype_policies.get(policy.name.split("_from_", 1)[1])


def _as_dict(to_numpy: Callable, outputs: Any) -> dict[str, np.ndarray]:
    if isinstance(outputs, dict):
        return {k: np.asarray(to_numpy(v), dtype=np.float32) for k, v in sorted(outputs.items())}
    return {"output_0": np.asarray(to_numpy(outputs), dtype=np.float32)}


def run_saved_model(directory: pathlib.Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import tensorflow as tf  # noqa: PLC0415

    return run_signature(tf.saved_model.load(str(directory)).signatures["serving_default"], inputs)


def run_signature(fn: Callable[..., Any], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A loaded signature's outputs on ``inputs``, as float32 arrays in sorted key order."""
    import tensorflow as tf  # noqa: PLC0415

    out = fn(**{k: tf.constant(v) for k, v in inputs.items()})
    return {k: np.asarray(v.numpy(), dtype=np.float32) for k, v in sorted(out.items())}


def relative_error(y: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> float:
    """``max|y - ref| / max|ref|`` over all outputs, matched in sorted order."""
    worst = 0.0
    for a, b in zip((y[k] for k in sorted(y)), (reference[k] for k in sorted(reference))):
        worst = max(worst, float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(b).max(), 1e-12)))
    return worst


# -- the table ------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    model: str
    map: str
    ok: str
    e_tool: Optional[float] = None
    e_keras: Optional[float] = None
    rewrite_s: Optional[float] = None
    floor_s: Optional[float] = None
    keras_keeps_convolutions: bool = False  # int8conv: convolutions quantized, which Keras cannot
    hlo: str = ""  # --target gpu: "s8 dots / all dots, float8 converts" of serving_default's HLO

    @property
    def ratio(self) -> Optional[float]:
        if self.e_tool is None or not self.e_keras or self.keras_keeps_convolutions:
            return None
        return self.e_tool / self.e_keras


def float8_scales(output_dir: pathlib.Path) -> dict[str, float]:
    """The tool's float8 scales as Keras variable paths (``<layer>/inputs_scale``)."""
    import tensorflow as tf  # noqa: PLC0415

    loaded = tf.saved_model.load(str(output_dir))
    found = {}
    for variable in getattr(getattr(loaded, "tfpolicy", None), "variables", []):
        name = variable.name.split(":")[0]
        if name.endswith(("inputs_scale", "kernel_scale")) and variable.shape.rank == 0:
            found[name] = float(variable.numpy())
    return found


def hlo_patterns(directory: pathlib.Path, inputs: dict[str, np.ndarray]) -> str:
    """``"s8 dots/dots, float8 converts"`` of ``serving_default``'s HLO under ``jit_compile=True``."""
    import re  # noqa: PLC0415

    import tensorflow as tf  # noqa: PLC0415

    loaded = tf.saved_model.load(str(directory))
    function = loaded.signatures["serving_default"]
    compiled = tf.function(lambda **kw: function(**kw), jit_compile=True)
    feeds = {k: tf.constant(v) for k, v in inputs.items()}
    hlo = compiled.experimental_get_compiler_ir(**feeds)(stage="hlo")
    dots = [line for line in hlo.splitlines() if re.search(r" (dot|convolution)\(", line)]
    s8 = sum(1 for line in dots if re.search(r"\(s8\[[^)]*s8\[", line))
    f8 = sum(1 for line in hlo.splitlines() if re.search(r"= f8e4m3fn\[[^ ]* convert\(", line))
    return f"{s8}/{len(dots)} s8, {f8} f8"


def measure(model: RealModel, which: str, workdir: pathlib.Path, floor_s: Optional[float] = None,
            target: Optional[str] = None) -> Row:
    import tfpolicy  # noqa: PLC0415

    plain = policy_map(model, which)
    out = workdir / f"{model.name}_{which}"
    started = time.monotonic()
    try:
        tfpolicy.rewrite(
            model.saved_model_dir, out, plain, overwrite=True,
            calibration_data=model.calibration if which == "float8" else None, target=target,
            **REWRITE_OPTIONS.get(which, {}),
        )
    except tfpolicy.TfPolicyError as exc:
        return Row(model.name, which, f"error: {exc}")
    rewrite_s = time.monotonic() - started
    y_ref = run_saved_model(model.saved_model_dir, model.inputs)
    y_tool = run_saved_model(out, model.inputs)
    row = Row(model.name, which, "ok", relative_error(y_tool, y_ref), None, rewrite_s, floor_s,
              quantizes_convolutions(model, which))
    if not all(np.isfinite(v).all() for v in y_tool.values()):
        row.ok = "non-finite output"
    if model.rebuild is not None:
        scales = float8_scales(out) if which == "float8" else None
        try:
            row.e_keras = relative_error(keras_native(model, plain, scales), y_ref)
        except (TypeError, ValueError) as exc:  # Keras itself cannot run this map on this model
            row.ok = f"ok; Keras fails: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:60]}"
    if target == "gpu":
        row.hlo = hlo_patterns(out, model.inputs)
    shutil.rmtree(out, ignore_errors=True)
    return row


def load_and_save_seconds(model: RealModel, workdir: pathlib.Path) -> float:
    import tensorflow as tf  # noqa: PLC0415

    started = time.monotonic()
    loaded = tf.saved_model.load(str(model.saved_model_dir))
    tf.saved_model.save(loaded, str(workdir / "floor"), signatures=loaded.signatures)
    seconds = time.monotonic() - started
    shutil.rmtree(workdir / "floor", ignore_errors=True)
    return seconds


def _format(rows: list[Row], markdown: bool) -> str:
    header = ("model", "map", "ok", "e_tool", "e_keras", "ratio", "rewrite s", "floor s") + (
        ("XLA HLO",) if any(r.hlo for r in rows) else ())
    lines = []
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    body = [
        (r.model, r.map, r.ok, fmt(r.e_tool, ".2e"), fmt(r.e_keras, ".2e"),
         "(conv)" if r.keras_keeps_convolutions else fmt(r.ratio, ".2f"),
         fmt(r.rewrite_s, ".1f"), fmt(r.floor_s, ".1f")) + ((r.hlo,) if any(x.hlo for x in rows) else ())
        for r in rows
    ]
    if markdown:
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---" for _ in header) + "|")
        lines.extend("| " + " | ".join(cells) + " |" for cells in body)
    else:
        widths = [max(len(str(c)) for c in col) for col in zip(header, *body)]
        for cells in (header, *body):
            lines.append("  ".join(str(c).ljust(w) for c, w in zip(cells, widths)))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, from: " + ", ".join(MODELS))
    parser.add_argument("--maps", default=",".join(MAPS), help="comma-separated, from: " + ", ".join(MAPS))
    parser.add_argument("--workdir", default=None, help="where exports go (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table (for the README)")
    parser.add_argument("--target", default=None, choices=["cpu", "gpu", "tpu"], help="rewrite for this serving target")
    args = parser.parse_args(argv)
    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="tfpolicy-realmodels-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models.split(","):
        print(f"building {name}", file=sys.stderr, flush=True)
        model = build(name, workdir / name)
        floor = load_and_save_seconds(model, workdir)
        for which in (m for m in args.maps.split(",") if applies(model, m)):
            rows.append(measure(model, which, workdir, floor, args.target))
            print(_format(rows[-1:], False), file=sys.stderr, flush=True)
    print(_format(rows, args.markdown))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps([dataclasses.asdict(r) | {"ratio": r.ratio} for r in rows], indent=1))
    return 0 if all(r.ok == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    sys.exit(main())
