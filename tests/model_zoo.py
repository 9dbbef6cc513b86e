"""A corpus of small real models, exported as real SavedModels, for the tests.

Each ``export_<name>(directory)`` builds one model with fixed seeds, exports it
under ``directory`` and returns a :class:`ZooModel` describing what a test needs:
the SavedModel directory, a sample batch per signature, the layer paths tfpolicy
should discover, and (Keras 3 models only) a ``rebuild`` callable returning a
fresh float32 copy with the same weights, for "Keras as oracle" comparisons.

The models are tiny (widths 8-32, a few thousand parameters) so that building
and exporting every one of them stays well under a minute on two CPU cores.

This is a plain module, not a test file; ``tests/conftest.py`` exposes it
through the session-scoped ``zoo`` fixture, which builds each model lazily.
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

import keras

BATCH = 3
"""Batch size of every sample input (stands in for each ``None`` dimension)."""

VOCABULARY = ("the", "cat", "sat", "on", "mat", "dog", "ran")
"""Vocabulary of ``keras3_string_lookup`` (written to a file, exported as an asset)."""

UNKNOWN_TOKEN = "zebra"
"""A token absent from :data:`VOCABULARY`, mapped to the OOV index."""


@dataclass(frozen=True)
class ZooModel:
    """One exported model of the zoo and what tests need to know about it."""

    name: str
    saved_model_dir: pathlib.Path
    sample_inputs: dict[str, dict[str, np.ndarray]]
    """Signature key -> {input name as in ``structured_input_signature`` -> batch}."""
    layer_paths: tuple[str, ...]
    """Keras ``Layer.path`` (or name scope) of every layer that owns variables."""
    rebuild: Callable[[], "keras.Model"] | None
    """Keras 3 only: a fresh float32 copy with the same weights; else ``None``."""


# --------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------


def _seed(seed: int = 1234) -> None:
    keras.utils.set_random_seed(seed)
    tf.random.set_seed(seed)


def _sample_for_spec(
    spec: tf.TensorSpec, rng: np.random.Generator, strings: tuple[str, ...] | None
) -> np.ndarray:
    shape = tuple(BATCH if d is None else int(d) for d in spec.shape.as_list())
    if spec.dtype == tf.string:
        if strings is None:
            raise ValueError(f"string input {spec.name!r} needs a token pool")
        pool = np.array(list(strings), dtype=object)
        values = rng.choice(pool, size=shape)
        # Make sure both a known token and the unknown token are present.
        flat = values.reshape(-1)
        flat[0] = strings[0]
        flat[-1] = strings[-1]
        return values.astype(np.bytes_)
    if spec.dtype.is_floating:
        return rng.standard_normal(shape).astype(spec.dtype.as_numpy_dtype)
    if spec.dtype.is_integer:
        return rng.integers(0, 4, size=shape).astype(spec.dtype.as_numpy_dtype)
    raise ValueError(f"no sample generator for dtype {spec.dtype!r} of {spec.name!r}")


def sample_inputs_for(
    saved_model_dir: pathlib.Path,
    seed: int = 0,
    strings: tuple[str, ...] | None = None,
) -> dict[str, dict[str, np.ndarray]]:
    """Sample batches for every signature, named as the signatures name them."""
    loaded = tf.saved_model.load(str(saved_model_dir))
    rng = np.random.default_rng(seed)
    result: dict[str, dict[str, np.ndarray]] = {}
    for key in sorted(loaded.signatures.keys()):
        _, kwargs = loaded.signatures[key].structured_input_signature
        result[key] = {
            name: _sample_for_spec(spec, rng, strings)
            for name, spec in sorted(kwargs.items())
        }
    return result


def run_signature(
    saved_model_dir: pathlib.Path | str, key: str, inputs: Mapping[str, Any]
) -> dict[str, np.ndarray]:
    """Load ``saved_model_dir`` with ``tf.saved_model.load`` and call signature ``key``."""
    loaded = tf.saved_model.load(str(saved_model_dir))
    fn = loaded.signatures[key]
    outputs = fn(**{name: tf.constant(value) for name, value in inputs.items()})
    return {name: value.numpy() for name, value in outputs.items()}


def apply_policy_map_natively(model: "keras.Model", keras_policy_map: Any) -> "keras.Model":
    """Apply a ``keras.dtype_policies.DTypePolicyMap`` to a built Keras 3 model.

    The documented way (keras-semantics.md section 6): every sublayer with a
    path gets ``pm[layer.path]``; the setter quantizes when the policy asks for
    it. Layers without a path (InputLayer, Softmax, Dropout) keep their policy.
    """
    for layer in model._flatten_layers(include_self=False):
        if layer.path:
            layer.dtype_policy = keras_policy_map[layer.path]
    return model


def _export_keras3(model: "keras.Model", saved_model_dir: pathlib.Path) -> None:
    model.export(str(saved_model_dir), verbose=False)


def _keras3_rebuilder(
    build: Callable[[], "keras.Model"], model: "keras.Model"
) -> Callable[[], "keras.Model"]:
    weights = [np.array(w) for w in model.get_weights()]

    def rebuild() -> "keras.Model":
        fresh = build()
        fresh.set_weights(weights)
        return fresh

    return rebuild


def _variable_layer_paths(model: "keras.Model") -> tuple[str, ...]:
    """Layer paths of every Keras 3 layer that directly owns variables."""
    paths = {v.path.rsplit("/", 1)[0] for v in model.weights}
    return tuple(sorted(paths))


def _finish_keras3(
    name: str,
    directory: pathlib.Path,
    build: Callable[[], "keras.Model"],
    expected_paths: tuple[str, ...],
    strings: tuple[str, ...] | None = None,
) -> ZooModel:
    _seed()
    model = build()
    found = _variable_layer_paths(model)
    if found != tuple(sorted(expected_paths)):
        raise AssertionError(f"{name}: layer paths {found} != expected {expected_paths}")
    saved_model_dir = directory / name
    _export_keras3(model, saved_model_dir)
    return ZooModel(
        name=name,
        saved_model_dir=saved_model_dir,
        sample_inputs=sample_inputs_for(saved_model_dir, strings=strings),
        layer_paths=tuple(expected_paths),
        rebuild=_keras3_rebuilder(build, model),
    )


# --------------------------------------------------------------------------
# Keras 3 models
# --------------------------------------------------------------------------


def build_keras3_mlp() -> "keras.Model":
    inputs = keras.Input(shape=(16,), name="features")
    x = keras.layers.Dense(32, activation="relu", name="dense")(inputs)
    x = keras.layers.Dense(32, activation="relu", name="dense_1")(x)
    outputs = keras.layers.Dense(4, name="head")(x)
    return keras.Model(inputs, outputs, name="mlp")


def export_keras3_mlp(directory: pathlib.Path) -> ZooModel:
    return _finish_keras3(
        "keras3_mlp", directory, build_keras3_mlp, ("dense", "dense_1", "head")
    )


def build_keras3_transformer() -> "keras.Model":
    tokens = keras.Input(shape=(5, 16), name="tokens")
    attn = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, name="mha")(
        tokens, tokens
    )
    x = keras.layers.Add(name="add_1")([tokens, attn])
    x = keras.layers.LayerNormalization(name="ln_1")(x)
    h = keras.layers.Dense(32, activation="gelu", name="ffn_in")(x)
    h = keras.layers.Dense(16, name="ffn_out")(h)
    x = keras.layers.Add(name="add_2")([x, h])
    x = keras.layers.LayerNormalization(name="ln_2")(x)
    outputs = keras.layers.Dense(4, name="head")(x)
    return keras.Model(tokens, outputs, name="transformer")


KERAS3_TRANSFORMER_PATHS = (
    "mha/query",
    "mha/key",
    "mha/value",
    "mha/attention_output",
    "ln_1",
    "ffn_in",
    "ffn_out",
    "ln_2",
    "head",
)


def export_keras3_transformer(directory: pathlib.Path) -> ZooModel:
    return _finish_keras3(
        "keras3_transformer",
        directory,
        build_keras3_transformer,
        KERAS3_TRANSFORMER_PATHS,
    )


def build_keras3_sequential() -> "keras.Model":
    return keras.Sequential(
        [
            keras.Input(shape=(8,), name="x"),
            keras.layers.Dense(16, activation="relu", name="a"),
            keras.layers.Dense(4, name="b"),
        ],
        name="seq",
    )


def export_keras3_sequential(directory: pathlib.Path) -> ZooModel:
    return _finish_keras3(
        "keras3_sequential", directory, build_keras3_sequential, ("seq/a", "seq/b")
    )


class ZooBlock(keras.layers.Layer):
    """A residual feed-forward block owning two Dense layers, ``ffn`` and ``proj``."""

    def __init__(self, width: int, hidden: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.width = width
        self.hidden = hidden
        self.ffn = keras.layers.Dense(hidden, activation="relu", name="ffn")
        self.proj = keras.layers.Dense(width, name="proj")

    def build(self, input_shape: Any) -> None:
        self.ffn.build(input_shape)
        self.proj.build(tuple(input_shape[:-1]) + (self.hidden,))

    def call(self, x: Any) -> Any:
        return x + self.proj(self.ffn(x))

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "width": self.width, "hidden": self.hidden}


class ZooNet(keras.Model):
    """Subclassed model ``net``: two :class:`ZooBlock` and a Dense ``head``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(name="net", **kwargs)
        self.block_0 = ZooBlock(12, 24, name="block_0")
        self.block_1 = ZooBlock(12, 24, name="block_1")
        self.head = keras.layers.Dense(4, name="head")

    def build(self, input_shape: Any) -> None:
        self.block_0.build(input_shape)
        self.block_1.build(input_shape)
        self.head.build(input_shape)

    def call(self, x: Any) -> Any:
        return self.head(self.block_1(self.block_0(x)))


def build_keras3_subclassed() -> "keras.Model":
    model = ZooNet()
    # An explicit build() gives full TF variable names (net/block_0/ffn/kernel:0);
    # building by the first call would give lossy ones (keras-semantics.md 2).
    model.build((None, 12))
    # export() also needs the model to have been called once.
    model(np.zeros((1, 12), dtype="float32"))
    return model


def export_keras3_subclassed(directory: pathlib.Path) -> ZooModel:
    return _finish_keras3(
        "keras3_subclassed",
        directory,
        build_keras3_subclassed,
        (
            "net/block_0/ffn",
            "net/block_0/proj",
            "net/block_1/ffn",
            "net/block_1/proj",
            "net/head",
        ),
    )


def build_keras3_nested() -> "keras.Model":
    inner = keras.Sequential(
        [
            keras.layers.Dense(16, activation="relu", name="a"),
            keras.layers.Dense(8, name="b"),
        ],
        name="inner",
    )
    seq_in = keras.Input(shape=(4, 8), name="seq_in")
    x = inner(seq_in)
    x = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, name="mha")(x, x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = keras.layers.Dense(3, name="head")(x)
    return keras.Model(seq_in, outputs, name="nested")


def export_keras3_nested(directory: pathlib.Path) -> ZooModel:
    return _finish_keras3(
        "keras3_nested",
        directory,
        build_keras3_nested,
        (
            "inner/a",
            "inner/b",
            "mha/query",
            "mha/key",
            "mha/value",
            "mha/attention_output",
            "head",
        ),
    )


def build_keras3_quantizable() -> "keras.Model":
    """Embedding, Dense and EinsumDense (one with a 3-d kernel), for int8 and float8."""
    tokens = keras.Input(shape=(5,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(20, 16, embeddings_initializer=keras.initializers.RandomNormal(stddev=1.0), name="embedding")(tokens)
    x = keras.layers.Dense(32, activation="relu", name="dense_in")(x)
    x = keras.layers.EinsumDense("abc,cde->abde", output_shape=(None, 2, 8), bias_axes="de", name="proj")(x)
    x = keras.layers.Reshape((5, 16), name="merge")(x)
    x = keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, 12), bias_axes="d", name="mix")(x)
    outputs = keras.layers.Dense(4, name="head")(x)
    return keras.Model(tokens, outputs, name="quantizable")


def export_keras3_quantizable(directory: pathlib.Path) -> ZooModel:
    return _finish_keras3(
        "keras3_quantizable",
        directory,
        build_keras3_quantizable,
        ("embedding", "dense_in", "proj", "mix", "head"),
    )


def build_keras3_cnn() -> "keras.Model":
    image = keras.Input(shape=(10, 10, 3), name="image")
    x = keras.layers.Conv2D(8, 3, activation="relu", name="conv")(image)
    x = keras.layers.DepthwiseConv2D(3, name="depthwise")(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = keras.layers.Dense(4, name="head")(x)
    return keras.Model(image, outputs, name="cnn")


def export_keras3_cnn(directory: pathlib.Path) -> ZooModel:
    return _finish_keras3("keras3_cnn", directory, build_keras3_cnn, ("conv", "depthwise", "head"))


def _write_vocabulary(directory: pathlib.Path) -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "keras3_string_lookup_vocab.txt"
    path.write_text("".join(token + "\n" for token in VOCABULARY))
    return path


def _string_lookup_builder(vocab_file: pathlib.Path) -> Callable[[], "keras.Model"]:
    def build() -> "keras.Model":
        words = keras.Input(shape=(6,), dtype="string", name="words")
        ids = keras.layers.StringLookup(vocabulary=str(vocab_file), name="lookup")(words)
        x = keras.layers.Embedding(len(VOCABULARY) + 1, 8, name="embedding")(ids)
        x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
        outputs = keras.layers.Dense(2, name="head")(x)
        return keras.Model(words, outputs, name="text")

    return build


def export_keras3_string_lookup(directory: pathlib.Path) -> ZooModel:
    vocab_file = _write_vocabulary(directory)
    return _finish_keras3(
        "keras3_string_lookup",
        directory,
        _string_lookup_builder(vocab_file),
        ("embedding", "head"),
        strings=VOCABULARY + (UNKNOWN_TOKEN,),
    )


# --------------------------------------------------------------------------
# tf-keras (Keras 2) models
# --------------------------------------------------------------------------


def _tf_keras() -> Any:
    import tf_keras

    tf_keras.backend.clear_session()
    tf_keras.utils.set_random_seed(4321)
    return tf_keras


def _save_tfkeras(model: Any, name: str, directory: pathlib.Path, layer_paths: tuple[str, ...]) -> ZooModel:
    saved_model_dir = directory / name
    model.save(str(saved_model_dir), save_format="tf")
    return ZooModel(
        name=name,
        saved_model_dir=saved_model_dir,
        sample_inputs=sample_inputs_for(saved_model_dir),
        layer_paths=layer_paths,
        rebuild=None,
    )


def export_tfkeras_functional(directory: pathlib.Path) -> ZooModel:
    tfk = _tf_keras()
    inputs = tfk.Input(shape=(10,), name="features")
    x = tfk.layers.Dense(16, activation="relu", name="encoder_dense")(inputs)
    x = tfk.layers.Dense(16, activation="relu", name="encoder_dense_1")(x)
    outputs = tfk.layers.Dense(3, name="head")(x)
    model = tfk.Model(inputs, outputs, name="m2")
    return _save_tfkeras(model, "tfkeras_functional", directory, ("encoder_dense", "encoder_dense_1", "head"))


def export_tfkeras_embedding(directory: pathlib.Path) -> ZooModel:
    """An Embedding read by ``ResourceGather`` (Keras 3 reads the table, then gathers)."""
    tfk = _tf_keras()
    tokens = tfk.Input(shape=(6,), dtype="int32", name="tokens")
    x = tfk.layers.Embedding(12, 8, name="embedding")(tokens)
    x = tfk.layers.Flatten(name="flatten")(x)
    outputs = tfk.layers.Dense(3, name="head")(x)
    model = tfk.Model(tokens, outputs, name="emb")
    return _save_tfkeras(model, "tfkeras_embedding", directory, ("embedding", "head"))


def export_tfkeras_lstm(directory: pathlib.Path) -> ZooModel:
    tfk = _tf_keras()
    inputs = tfk.Input(shape=(6, 4), name="sequence")
    x = tfk.layers.LSTM(8, unroll=False, name="lstm")(inputs)
    outputs = tfk.layers.Dense(2, name="head")(x)
    model = tfk.Model(inputs, outputs, name="rnn")
    # The variables live in the cell: lstm/lstm_cell/{kernel,recurrent_kernel,bias}.
    return _save_tfkeras(model, "tfkeras_lstm", directory, ("lstm/lstm_cell", "head"))


# --------------------------------------------------------------------------
# Plain tf.Module
# --------------------------------------------------------------------------


class EncoderDecoder(tf.Module):
    """Two dense-like blocks with variables and ops under explicit name scopes."""

    def __init__(self) -> None:
        super().__init__(name="encdec")
        init = tf.random.stateless_normal
        with tf.name_scope("encoder"):
            self.enc_kernel = tf.Variable(
                init((8, 16), seed=(1, 2)) * 0.3, name="kernel"
            )
            self.enc_bias = tf.Variable(tf.zeros((16,)) + 0.1, name="bias")
        with tf.name_scope("decoder"):
            self.dec_kernel = tf.Variable(
                init((16, 4), seed=(3, 4)) * 0.3, name="kernel"
            )
            self.dec_bias = tf.Variable(tf.zeros((4,)) - 0.1, name="bias")

    def _encode(self, x: tf.Tensor) -> tf.Tensor:
        with tf.name_scope("encoder"):
            return tf.nn.relu(tf.matmul(x, self.enc_kernel) + self.enc_bias)

    def _decode(self, h: tf.Tensor) -> tf.Tensor:
        with tf.name_scope("decoder"):
            return tf.matmul(h, self.dec_kernel) + self.dec_bias

    @tf.function(input_signature=[tf.TensorSpec((None, 8), tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        h = self._encode(x)
        return {"logits": self._decode(h), "hidden": h}

    @tf.function(input_signature=[tf.TensorSpec((None, 16), tf.float32, name="code")])
    def decode(self, code: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"reconstruction": self._decode(code)}


def export_tf_module(directory: pathlib.Path) -> ZooModel:
    module = EncoderDecoder()
    saved_model_dir = directory / "tf_module"
    tf.saved_model.save(
        module,
        str(saved_model_dir),
        signatures={"serving_default": module.serve, "decode": module.decode},
    )
    return ZooModel(
        name="tf_module",
        saved_model_dir=saved_model_dir,
        sample_inputs=sample_inputs_for(saved_model_dir),
        layer_paths=("encoder", "decoder"),
        rebuild=None,
    )


ALL_BUILDERS: dict[str, Callable[[pathlib.Path], ZooModel]] = {
    "keras3_mlp": export_keras3_mlp,
    "keras3_transformer": export_keras3_transformer,
    "keras3_sequential": export_keras3_sequential,
    "keras3_subclassed": export_keras3_subclassed,
    "keras3_nested": export_keras3_nested,
    "tfkeras_functional": export_tfkeras_functional,
    "tfkeras_lstm": export_tfkeras_lstm,
    "keras3_string_lookup": export_keras3_string_lookup,
    "tf_module": export_tf_module,
    "keras3_quantizable": export_keras3_quantizable,
    "keras3_cnn": export_keras3_cnn,
    "tfkeras_embedding": export_tfkeras_embedding,
}
"""Every zoo model by name -> its ``export_<name>(directory)`` builder."""


# -- small Keras 3 models for the quantization oracles (test_int8_integer, test_int4) --


def quant_dense_mlp(sequence: "int | None") -> "keras.Model":
    inputs = keras.Input((sequence, 20) if sequence else (20,))
    x = keras.layers.Dense(33, activation="relu", name="hidden")(inputs)  # odd width: int4 pads a nibble
    return keras.Model(inputs, keras.layers.Dense(7, name="out")(x))


def quant_einsum_stack(sequence: "int | None") -> "keras.Model":
    inputs = keras.Input((sequence, 16))
    x = keras.layers.EinsumDense("abc,cde->abde", output_shape=(None, 4, 8), bias_axes="de", name="heads")(inputs)
    x = keras.layers.EinsumDense("abde,dec->abc", output_shape=(None, 16), name="merge")(x)
    return keras.Model(inputs, keras.layers.EinsumDense("abc,cd->abd", output_shape=(None, 8), name="ffn")(x))


def quant_transformer_block() -> "keras.Model":
    tokens = keras.Input((5, 16))
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, name="mha")(tokens, tokens)
    x = keras.layers.LayerNormalization(name="ln")(keras.layers.Add()([tokens, attention]))
    h = keras.layers.Dense(16, name="ffn_out")(keras.layers.Dense(32, activation="gelu", name="ffn_in")(x))
    return keras.Model(tokens, keras.layers.Dense(4, name="head")(keras.layers.Add()([x, h])))


QUANT_BUILDERS: dict[str, Callable[[], "keras.Model"]] = {
    "dense_mlp": lambda: quant_dense_mlp(None),
    "dense_sequence": lambda: quant_dense_mlp(6),
    "einsum_static": lambda: quant_einsum_stack(6),  # Keras's einsum emits reshapes around a BatchMatMul
    "einsum_dynamic": lambda: quant_einsum_stack(None),  # an Einsum op, the sequence length unknown
    "transformer_block": quant_transformer_block,  # attention's projections, layer norm, feed-forward
}
