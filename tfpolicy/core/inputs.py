"""Input arrays for a signature: read, check, batch and generate them.

Validation data, calibration data and warmup requests all arrive as a dict of
numpy arrays keyed by a signature's input names, batch first (a scalar input,
such as a decoding loop's step count, goes with every batch), string inputs as
numpy bytes arrays (``dtype='S...'``)::

    data.npz  --load_npz-->  {"features": float32 (N, 16)}
              --check_inputs(arrays, "serving_default", signature)-->  ok / InputDataError
              --iter_batches(arrays, 32)-->  {"features": (32, 16)}, ..., {"features": (N % 32, 16)}

Every problem with the data is an :class:`~tfpolicy.errors.InputDataError`
whose message is one line naming the data, the signature, the input, what was
expected and what was received. Nothing here runs a model.
"""

from __future__ import annotations

import os
import pathlib
import zipfile
from typing import Any, Iterable, Iterator, Mapping, Optional, Union

import numpy as np
import tensorflow as tf

from tfpolicy.errors import InputDataError, exception_line

UNKNOWN_DIM = 8
"""Size :func:`generate_inputs` gives a ``None`` dimension other than the batch."""

GENERATED_INTEGER_LIMIT = 4
"""Generated integers are drawn from ``[0, 4)`` unless the input indexes a smaller table."""

STRING_TOKENS = (b"the", b"cat", b"sat", b"on", b"mat", b"tfpolicy")
"""Tokens :func:`generate_inputs` draws string inputs from."""

InputSource = Union[str, "os.PathLike[str]", Mapping[str, Any], Iterable[Any]]
"""An npz path, one dict of arrays, or an iterable (e.g. a ``tf.data.Dataset``) of dicts."""


def load_npz(path: Union[str, "os.PathLike[str]"], *, what: str = "validation data") -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file, keyed by name, loaded without pickle.

    Unicode string arrays (``dtype='U...'``) are encoded to UTF-8 bytes. A
    missing, unreadable or non-npz file, an object array, an array without a
    batch dimension or arrays of different batch sizes raise :class:`InputDataError`.
    """
    file = pathlib.Path(path)
    label = f"{what} '{path}'"
    if not file.exists():
        raise InputDataError(f"{label} does not exist")
    if not file.is_file():
        raise InputDataError(f"{label} is not a file")
    try:
        loaded = np.load(file, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise InputDataError(f"{label} is not a readable .npz file: {exception_line(exc)}") from exc
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise InputDataError(f"{label} is a single .npy array; save named arrays with numpy.savez(path, name=array)")
    arrays: dict[str, np.ndarray] = {}
    with loaded:
        if not loaded.files:
            raise InputDataError(f"{label} holds no arrays")
        for name in sorted(loaded.files):
            try:
                array = loaded[name]
            except ValueError as exc:  # object arrays need pickle
                raise InputDataError(
                    f"{label}: array '{name}' is an object array, which is not loaded (no pickle);"
                    " store strings as bytes, e.g. numpy.array(values, dtype='S')"
                ) from exc
            except (OSError, zipfile.BadZipFile, EOFError) as exc:
                raise InputDataError(f"{label}: array '{name}' cannot be read: {exception_line(exc)}") from exc
            arrays[name] = _normalized(array, f"{label}: array '{name}'")
    try:
        batch_rows(arrays)
    except InputDataError as exc:
        raise InputDataError(f"{label}: {exc}") from None
    return arrays


def input_specs(function: Any) -> dict[str, tf.TensorSpec]:
    """Input name -> TensorSpec of a signature ConcreteFunction (keyword inputs)."""
    args, kwargs = function.structured_input_signature
    specs = {spec.name: spec for spec in tf.nest.flatten(args) if isinstance(spec, tf.TensorSpec)}
    for name, spec in (kwargs or {}).items():
        if isinstance(spec, tf.TensorSpec):
            specs[name] = spec
    return dict(sorted(specs.items()))


def describe_spec(spec: tf.TensorSpec) -> str:
    """``float32 of shape (None, 16)``."""
    return f"{spec.dtype.name} of shape {_shape_text(spec.shape)}"


def describe_array(array: np.ndarray) -> str:
    """``float64 of shape (10, 16)``; bytes arrays are ``string``."""
    return f"{_dtype_text(array.dtype)} of shape {tuple(array.shape)}"


def check_inputs(arrays: Mapping[str, np.ndarray], signature_key: str, function: Any, *, what: str) -> None:
    """Raise :class:`InputDataError` unless ``arrays`` fit the signature exactly.

    ``function`` is the loaded signature (its ``structured_input_signature``
    gives names, dtypes and shapes). Checks: the same names, each dtype, the
    rank and every dimension the signature fixes. ``what`` names the data in
    the message (``"validation data 'val.npz'"``).
    """
    specs = input_specs(function)
    missing = [name for name in specs if name not in arrays]
    if missing:
        name = missing[0]
        raise InputDataError(
            f"{what}: signature '{signature_key}' input '{name}' ({describe_spec(specs[name])}) is missing;"
            f" received {_names(arrays)}"
        )
    extra = [name for name in arrays if name not in specs]
    if extra:
        raise InputDataError(
            f"{what}: signature '{signature_key}' has no input '{extra[0]}'; it takes {_names(specs)}"
        )
    for name, spec in specs.items():
        array = arrays[name]
        if not _dtype_fits(array.dtype, spec.dtype) or not _shape_fits(array.shape, spec.shape):
            raise InputDataError(
                f"{what}: signature '{signature_key}' input '{name}' expects {describe_spec(spec)},"
                f" received {describe_array(array)}"
            )


def conform(arrays: Mapping[str, np.ndarray], function: Any) -> dict[str, np.ndarray]:
    """``arrays`` with floats and integers cast to the signature's own width.

    NumPy's defaults (float64, int64) then feed a float32 or int32 input; any
    other mismatch is left for :func:`check_inputs` to name.
    """
    specs = input_specs(function)
    conformed = dict(arrays)
    for name, array in arrays.items():
        spec = specs.get(name)
        if spec is None or spec.dtype == tf.string:
            continue
        want = np.dtype(spec.dtype.as_numpy_dtype)
        same_kind = (array.dtype.kind == "f" and want.kind == "f") or (array.dtype.kind in "iu" and want.kind in "iu")
        if array.dtype != want and same_kind:
            conformed[name] = array.astype(want)
    return conformed


def iter_batches(arrays: Mapping[str, np.ndarray], batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    """Consecutive slices of ``batch_size`` rows (the last may be shorter).

    Every array must have the same first dimension.
    """
    if batch_size < 1:
        raise InputDataError(f"batch size must be at least 1, got {batch_size}")
    rows = batch_rows(arrays)
    for start in range(0, rows, batch_size):
        yield {name: array[start : start + batch_size] if np.ndim(array) else array for name, array in arrays.items()}


def batch_rows(arrays: Mapping[str, np.ndarray]) -> int:
    """The common first dimension of ``arrays``; InputDataError if they differ.

    A scalar (a decoding loop's ``steps``) is no batch: it goes with every batch as it is.
    """
    if not arrays:
        raise InputDataError("no input arrays given")
    sizes = {name: np.shape(array)[0] for name, array in arrays.items() if np.ndim(array)}
    if not sizes:
        raise InputDataError(f"every input is a scalar ({_names(arrays)}); give at least one batch-first array")
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"'{name}' has {size}" for name, size in sizes.items())
        raise InputDataError(f"inputs differ in their first (batch) dimension: {listed}")
    return next(iter(sizes.values()))


def generate_inputs(
    function: Any, *, batch: int = 4, seed: int = 0, integer_limits: Optional[Mapping[str, int]] = None
) -> dict[str, np.ndarray]:
    """Seeded inputs that fit the signature ``function``.

    Floats are standard normal, integers drawn from ``[0, 4)``, or from
    ``[0, integer_limits[name])`` when that is smaller (the size of the table
    the input indexes: see :mod:`tfpolicy.analysis.index_limits`), bools fair coins,
    strings drawn from :data:`STRING_TOKENS`.
    The first ``None`` dimension is ``batch``, other ``None`` dimensions are
    :data:`UNKNOWN_DIM`.
    """
    return generate_for_specs(input_specs(function), batch=batch, seed=seed, integer_limits=integer_limits)


def generate_for_specs(
    specs: Mapping[str, tf.TensorSpec],
    *,
    batch: int = 4,
    seed: int = 0,
    integer_limits: Optional[Mapping[str, int]] = None,
) -> dict[str, np.ndarray]:
    """:func:`generate_inputs` for input name -> TensorSpec (e.g. from a SignatureDef)."""
    rng = np.random.default_rng(seed)
    limits = integer_limits or {}
    return {name: _generate(name, specs[name], rng, batch, limits.get(name)) for name in sorted(specs)}


def batches_from(
    source: InputSource, *, what: str, batch_size: int = 32, max_batches: Optional[int] = None
) -> list[dict[str, np.ndarray]]:
    """Batches of numpy arrays from an npz path, one dict of arrays, or an iterable.

    An iterable (a list, a generator, a ``tf.data.Dataset``) yields one batch per
    element: a dict of arrays or tensors, or an ``(inputs, labels)`` pair whose
    first item is such a dict. Strings become bytes arrays. All are read now
    (:class:`BatchStream` reads them as they are used).
    """
    return list(BatchStream(source, what=what, batch_size=batch_size, max_batches=max_batches))


class BatchStream:
    """Batches read one at a time, as :func:`batches_from` reads them, the first at once.

    The first batch is read when the stream is made, so that bad data fails
    before any model work; the others when iterated, so that a dataset larger
    than memory can be run through (an ``.npz`` is loaded whole and sliced).
    ``total`` is the number of batches when it is known (a path, a dict, a
    sized iterable, a dataset of known cardinality, or ``max_batches``), else None.
    """

    def __init__(self, source: InputSource, *, what: str, batch_size: int = 32, max_batches: Optional[int] = None):
        self.what = what
        if isinstance(source, (str, os.PathLike)) or isinstance(source, Mapping):
            arrays = (load_npz(source, what=what) if not isinstance(source, Mapping) else
                      {name: _normalized(_to_numpy(value), f"{what}: input '{name}'") for name, value in source.items()})
            rows = batch_rows(arrays)
            total = -(-rows // batch_size) if batch_size >= 1 else 0
            elements: Iterator[Any] = iter_batches(arrays, batch_size)
        elif isinstance(source, Iterable):
            total = _known_length(source)
            elements = iter(source)
        else:
            raise InputDataError(
                f"{what} must be an .npz path, a dict of arrays or an iterable of dicts, not {type(source).__name__}"
            )
        if max_batches is not None:
            total = max_batches if total is None else min(total, max_batches)
        self.total = total
        self._elements = elements
        self._limit = max_batches
        self.first = self._read(0)
        if self.first is None:
            raise InputDataError(f"{what} holds no examples")

    def _read(self, position: int) -> Optional[dict[str, np.ndarray]]:
        if self._limit is not None and position >= self._limit:
            return None
        element = next(self._elements, None)
        if element is None:
            return None
        return _element_arrays(element, f"{self.what}: element {position}")

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        yield self.first
        position = 1
        while (batch := self._read(position)) is not None:
            yield batch
            position += 1


class NonFiniteCount:
    """NaN and infinite values seen in batches of inputs, per input name, with the batches they were in."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.batches: dict[str, list[int]] = {}

    def add(self, batch: Mapping[str, np.ndarray], number: int) -> None:
        for name, value in batch.items():
            if value.dtype.kind not in "fc":
                continue
            count = int(value.size - np.count_nonzero(np.isfinite(value)))
            if count:
                self.counts[name] = self.counts.get(name, 0) + count
                self.batches.setdefault(name, []).append(number)

    def __bool__(self) -> bool:
        return bool(self.counts)

    def describe(self) -> str:
        """``3 non-finite values (NaN or Inf): 2 in input 'x' (batch 1), 1 in input 'y' (batches 2, 5)``."""
        def where(numbers: list[int]) -> str:
            shown = ", ".join(str(n) for n in numbers[:5]) + (", ..." if len(numbers) > 5 else "")
            return f"batch {shown}" if len(numbers) == 1 else f"batches {shown}"

        parts = [f"{count} in input '{name}' ({where(self.batches[name])})" for name, count in sorted(self.counts.items())]
        return f"{sum(self.counts.values())} non-finite value(s) (NaN or Inf): " + ", ".join(parts)


def _known_length(source: Iterable) -> Optional[int]:
    cardinality = getattr(source, "cardinality", None)
    if callable(cardinality):  # a tf.data.Dataset: negative when infinite or unknown
        count = int(cardinality())
        return count if count >= 0 else None
    try:
        return len(source)  # type: ignore[arg-type]
    except TypeError:
        return None


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _element_arrays(element: Any, label: str) -> dict[str, np.ndarray]:
    if isinstance(element, tuple) and element and isinstance(element[0], Mapping):
        element = element[0]  # (inputs, labels) as Keras datasets yield them
    if not isinstance(element, Mapping):
        raise InputDataError(f"{label} is a {type(element).__name__}, not a dict of input name -> array")
    arrays = {name: _normalized(_to_numpy(value), f"{label}: input '{name}'") for name, value in element.items()}
    batch_rows(arrays)
    return arrays


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "numpy"):
        value = value.numpy()
    return np.asarray(value)


def _normalized(array: np.ndarray, label: str) -> np.ndarray:
    """Unicode -> UTF-8 bytes, object arrays of bytes/str -> bytes; other objects refused."""
    if array.dtype.kind == "U":
        return np.char.encode(array, "utf-8")
    if array.dtype.kind == "O":
        flat = array.reshape(-1)
        if all(isinstance(v, (bytes, str)) for v in flat):
            return np.array([v.encode("utf-8") if isinstance(v, str) else v for v in flat], dtype=np.bytes_).reshape(
                array.shape
            )
        raise InputDataError(f"{label} is an object array; use numeric arrays or bytes (dtype 'S')")
    return array


def _dtype_fits(array_dtype: np.dtype, spec_dtype: tf.DType) -> bool:
    if spec_dtype == tf.string:
        return array_dtype.kind == "S"
    try:
        return np.dtype(spec_dtype.as_numpy_dtype) == array_dtype
    except TypeError:
        return False


def _shape_fits(shape: tuple[int, ...], spec_shape: tf.TensorShape) -> bool:
    if spec_shape.rank is None:
        return len(shape) >= 1
    if len(shape) != spec_shape.rank:
        return False
    return all(want is None or want == got for want, got in zip(spec_shape.as_list(), shape))


def _generate(
    name: str, spec: tf.TensorSpec, rng: np.random.Generator, batch: int, integer_limit: Optional[int] = None
) -> np.ndarray:
    if spec.shape.rank is None:
        shape: tuple[int, ...] = (batch,)
    else:
        dims = spec.shape.as_list()
        shape = tuple(
            (batch if i == 0 else UNKNOWN_DIM) if d is None else int(d) for i, d in enumerate(dims)
        )
    dtype = spec.dtype
    if dtype == tf.string:
        return np.array(STRING_TOKENS, dtype=np.bytes_)[rng.integers(0, len(STRING_TOKENS), size=shape)]
    if dtype == tf.bool:
        return rng.random(shape) < 0.5
    if dtype.is_floating or dtype.is_complex:
        return rng.standard_normal(shape).astype(dtype.as_numpy_dtype)
    if dtype.is_integer:
        high = min(GENERATED_INTEGER_LIMIT, integer_limit) if integer_limit else GENERATED_INTEGER_LIMIT
        return rng.integers(0, high, size=shape).astype(dtype.as_numpy_dtype)
    raise InputDataError(f"cannot generate a value for input '{name}' of dtype {dtype.name}")


def _names(items: Mapping[str, Any]) -> str:
    return ", ".join(f"'{name}'" for name in items) if items else "no inputs"


def _shape_text(shape: tf.TensorShape) -> str:
    if shape.rank is None:
        return "(unknown rank)"
    dims = shape.as_list()
    return "(" + ", ".join(str(d) for d in dims) + ("," if len(dims) == 1 else "") + ")"


def _dtype_text(dtype: np.dtype) -> str:
    if dtype.kind == "S":
        return "string"
    if dtype.kind == "U":
        return "unicode string"
    return dtype.name
