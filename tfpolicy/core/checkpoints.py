"""Variable values streamed, one tensor at a time, between the input's checkpoint and the output's.

A SavedModel keeps its variables' values in a checkpoint (``variables/variables.index``
and its data files), each under the key its object's node in the object graph gives
it (``variables/3/.ATTRIBUTES/VARIABLE_VALUE``). No step of a rewrite needs more than
one value at a time, so the rewrite does not hold them all::

    input   tf.saved_model.load(skip the checkpoint)    variables with a shape and a dtype, no memory
            SavedModelCheckpoint.read(variable)         one tensor: RestoreV2 of the variable's key
    output  ValueWriter.start(dir)                      in a thread, while the save runs: each
                                                        missing value, a shard of them at a time
                                                        (SaveV2), under the key the save will give it
            tf.saved_model.save(root)                   graph, functions, object graph; variables
                                                        without a value are not written
            ValueWriter.finish(dir)                     keys checked, the rest written, all merged
                                                        (MergeV2Checkpoints) into variables/variables

Peak memory is TensorFlow's own plus about one shard (:data:`SHARD_BYTES`) and the
tensors that produce its largest value.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pathlib
import shutil
import threading
from typing import Any, Callable, Iterable, Optional

import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2

from tfpolicy.core import tf_internals
from tfpolicy.errors import SavedModelError, cause_line

logger = logging.getLogger(__name__)

VARIABLE_VALUE = "VARIABLE_VALUE"
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
SHARD_BYTES = 32 << 20
"""Values are written in shards of about this many bytes (one value may exceed it)."""

ValueOf = Callable[[Any, str], Optional[Callable[[], tf.Tensor]]]
"""(object, attribute) -> what makes its value, or None: the value ``tf.saved_model.save`` wrote."""


def checkpoint_prefix(saved_model_dir: pathlib.Path) -> str:
    return str(pathlib.Path(saved_model_dir) / "variables" / "variables")


def has_checkpoint(saved_model_dir: pathlib.Path) -> bool:
    return os.path.exists(checkpoint_prefix(saved_model_dir) + ".index")


class SavedModelCheckpoint:
    """The checkpoint of the SavedModel at ``saved_model_dir``, keyed by the objects of ``root``.

    ``root`` is that SavedModel loaded (or the root it was saved from): each of its
    checkpointed objects is found by TensorFlow's own walk of the object graph.
    """

    def __init__(self, saved_model_dir: pathlib.Path, root: object) -> None:
        self.prefix = checkpoint_prefix(saved_model_dir)
        reader = tf.train.load_checkpoint(self.prefix)
        self.dtypes = reader.get_variable_to_dtype_map()
        graph = trackable_object_graph_pb2.TrackableObjectGraph()
        graph.ParseFromString(reader.get_tensor(OBJECT_GRAPH_KEY))
        self.object_graph = graph
        self.found = tf_internals.checkpointed_objects(root, graph)
        """Node id of the object graph -> the object of ``root`` it names."""
        self._keys: dict[int, dict[str, str]] = {}
        self._last: Optional[tuple[str, tf.Tensor]] = None  # the value read last, by key
        self.unmatched: list[str] = []  # keys of objects the walk did not reach
        for node_id, node in enumerate(graph.nodes):
            keys = {a.name: a.checkpoint_key for a in node.attributes}
            if node_id not in self.found:
                self.unmatched += keys.values()
            elif keys:
                self._keys[id(self.found[node_id])] = keys

    def keys_of(self, obj: Any) -> dict[str, str]:
        """Attribute name -> checkpoint key, for ``obj`` (empty when it has none)."""
        return self._keys.get(id(obj), {})

    def has(self, obj: Any, attribute: str = VARIABLE_VALUE) -> bool:
        key = self.keys_of(obj).get(attribute)
        return key is not None and key in self.dtypes

    def read(self, obj: Any, attribute: str = VARIABLE_VALUE) -> tf.Tensor:
        """One value, read from disk now (only its bytes are read), or again as it was read last.

        The last value read is kept until the next read: the output's writer
        reads a kernel and, right after, the statistics taken from it read it
        again (see ``assemble.NewVariable.derived_from``).
        """
        key = self._keys[id(obj)][attribute]
        last = self._last
        if last is not None and last[0] == key:
            return last[1]
        value = saved_value(self, key)
        self._last = (key, value)
        return value

    def restore(self, objects: Iterable[Any]) -> None:
        """Give each of ``objects`` its values from the checkpoint, one object at a time."""
        for obj in objects:
            keys = self.keys_of(obj)
            if keys and all(key in self.dtypes for key in keys.values()):
                tf_internals.restore_object(obj, {name: self.read(obj, name) for name in keys})


class ValueWriter:
    """Writes the values ``tf.saved_model.save(root)`` leaves out, mostly while it runs.

    :meth:`start`, before the save, writes in a thread every variable's value
    that ``value_of(variable, VARIABLE_VALUE)`` makes, under the key the save
    will give it (:func:`tf_internals.variable_checkpoint_keys`): reading,
    converting and writing overlap the save's tracing. :meth:`finish`, after
    the save, checks those keys against the saved object graph (all of them
    are written again if one differs), writes what is left, and merges it all
    into ``variables/variables``. :meth:`cancel` stops the thread.
    """

    def __init__(self, root: object, value_of: ValueOf) -> None:
        self.root, self.value_of = root, value_of
        self._early: dict[str, Any] = {}  # checkpoint key -> the object whose value was written
        self._early_prefixes: list[str] = []
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._stop = threading.Event()
        self.written_while_saving = 0
        """After :meth:`finish`: how many values were written while the save ran."""

    def start(self, saved_model_dir: pathlib.Path) -> None:
        planned = []
        for variable, key in tf_internals.variable_checkpoint_keys(self.root):
            produce = self.value_of(variable, VARIABLE_VALUE)
            if produce is not None:
                planned.append((key, variable, produce))
        if not planned:
            return
        parts_dir = _parts_dir(saved_model_dir)
        parts_dir.mkdir()

        def write() -> None:
            try:
                written = _write_shards(parts_dir, "early", [(key, produce) for key, _, produce in planned], self._stop)
                self._early_prefixes = written
                self._early = {key: variable for key, variable, _ in planned}
            except BaseException as exc:  # noqa: BLE001 - raised again by finish()
                self._error = exc

        self._thread = threading.Thread(target=write, name="tfpolicy-values", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def finish(self, saved_model_dir: pathlib.Path) -> int:
        """Complete the checkpoint the save wrote; returns the number of values written.

        Every attribute of the object graph whose ``value_of(object, attribute)``
        gives a producer is written with the producer's tensor, in place of what
        the save wrote for it, if anything; every other keeps the saved value,
        which must exist.
        """
        if self._thread is not None:
            self._thread.join()
            if self._error is not None:
                raise self._error
        saved = SavedModelCheckpoint(saved_model_dir, self.root)
        planned: list[tuple[str, Any, Callable[[], tf.Tensor]]] = []
        kept: list[str] = [OBJECT_GRAPH_KEY]
        for node_id, node in enumerate(saved.object_graph.nodes):
            obj = saved.found.get(node_id)
            for attribute in node.attributes:
                produce = self.value_of(obj, attribute.name) if obj is not None else None
                if produce is not None:
                    planned.append((attribute.checkpoint_key, obj, produce))
                elif attribute.checkpoint_key in saved.dtypes:
                    kept.append(attribute.checkpoint_key)
                else:
                    raise RuntimeError(f"no value to write for checkpoint key {attribute.checkpoint_key!r}")
        parts_dir = _parts_dir(saved_model_dir)
        if self._early and {key: id(obj) for key, obj, _ in planned if key in self._early} != {
            key: id(obj) for key, obj in self._early.items()
        }:
            logger.debug("the save named variables otherwise than predicted; writing every value again")
            shutil.rmtree(parts_dir)
            self._early, self._early_prefixes = {}, []
        if not planned:
            return 0
        parts_dir.mkdir(exist_ok=True)
        prefixes = [str(parts_dir / "kept")]
        _save(prefixes[0], kept, [saved_value(saved, key) for key in kept])
        rest = [(key, produce) for key, _, produce in planned if key not in self._early]
        prefixes += self._early_prefixes + _write_shards(parts_dir, "part", rest, None)
        variables_dir = pathlib.Path(saved.prefix).parent
        for name in os.listdir(variables_dir):
            if name.startswith("variables."):
                os.remove(variables_dir / name)
        tf.raw_ops.MergeV2Checkpoints(
            checkpoint_prefixes=prefixes, destination_prefix=saved.prefix, delete_old_dirs=True
        )
        shutil.rmtree(parts_dir, ignore_errors=True)
        self.written_while_saving = len(self._early)
        logger.debug(
            "wrote %d values (%d while saving) in %d shards to %s",
            len(planned), len(self._early), len(prefixes) - 1, saved.prefix,
        )
        return len(planned)


def _parts_dir(saved_model_dir: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(saved_model_dir) / "tfpolicy-parts"


def _write_shards(
    parts_dir: pathlib.Path,
    stem: str,
    planned: list[tuple[str, Callable[[], tf.Tensor]]],
    stop: Optional[threading.Event],
) -> list[str]:
    """Write ``planned`` values in shards of about :data:`SHARD_BYTES`; returns the shards' prefixes."""
    prefixes: list[str] = []
    names: list[str] = []
    tensors: list[tf.Tensor] = []
    pending = 0
    for done, (key, produce) in enumerate(planned, start=1):
        if stop is not None and stop.is_set():
            break
        tensor = produce()
        names.append(key)
        tensors.append(tensor)
        pending += tensor.shape.num_elements() * tensor.dtype.size
        if pending >= SHARD_BYTES or done == len(planned):
            prefixes.append(str(parts_dir / f"{stem}-{len(prefixes)}"))
            _save(prefixes[-1], names, tensors)
            names, tensors, pending = [], [], 0
            _release_freed_memory()
            logger.debug("wrote %s shard %d (%d of %d values)", stem, len(prefixes) - 1, done, len(planned))
    return prefixes


def saved_value(checkpoint: SavedModelCheckpoint, key: str) -> tf.Tensor:
    try:
        with tf.device("CPU:0"):
            return tf.raw_ops.RestoreV2(
                prefix=checkpoint.prefix, tensor_names=[key], shape_and_slices=[""], dtypes=[checkpoint.dtypes[key]]
            )[0]
    except tf.errors.OpError as exc:
        raise SavedModelError(f"cannot read '{key}' from checkpoint '{checkpoint.prefix}': {cause_line(exc.message)}") from exc


def _release_freed_memory() -> None:
    """Hand memory freed by the last shard back to the system (glibc keeps it otherwise)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to trim
        return None


_LIBC = _libc()


def _save(prefix: str, names: list[str], tensors: list[tf.Tensor]) -> None:
    with tf.device("CPU:0"):
        tf.raw_ops.SaveV2(prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names), tensors=tensors)
