"""Serving checks: will the rewritten SavedModel serve, and on which target?

Run on every rewrite, on the staged output before it is renamed into place::

    staged SavedModel --TF1 session loader, tag "serve"--> run every SignatureDef by tensor name
                      --tf.saved_model.load--> each signature under tf.function(jit_compile=True)

The first is what TF Serving does at load time; a failure there is a
:class:`~tfpolicy.errors.ServingCheckError` and nothing is written. The second
is what TPU serving needs: each signature is lowered to XLA HLO the way
``jit_compile=True`` lowers it, and a signature XLA cannot compile is listed in the
report with the ops it stumbled on, and is an error only for ``target="tpu"``.
(The plan-level half of ``--target``, what a TPU refuses before any work, is
:func:`tfpolicy.analysis.lowering.check_target`.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import pathlib
import re
import threading
import time
from typing import Any, Callable, Mapping, Optional

import numpy as np
import tensorflow as tf

from tfpolicy.analysis.lowering import check_target_name
from tfpolicy.core import inputs, savedmodel_io, tf_internals
from tfpolicy.errors import ServingCheckError, cause_line
from tfpolicy.serving import device_kernels

logger = logging.getLogger(__name__)

SERVE_TAG = "serve"
CHECK_BATCH = 2
"""Batch size of the generated inputs the checks run on."""

_UNSUPPORTED_OP = re.compile(r"(\w+) \(No registered '\w+' OpKernel for XLA_\w+ devices compatible with node \{\{node ([^}]+)\}\}")


@dataclasses.dataclass(frozen=True)
class SignatureCheck:
    """The outcome of both checks for one signature."""

    signature: str
    tf1_ran: bool
    xla_compiles: bool
    xla_unsupported: tuple[str, ...] = ()  # "Op (node)" XLA has no kernel for
    xla_error: str = ""  # first line of the compiler's message when it failed

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"xla_unsupported": list(self.xla_unsupported)}


@dataclasses.dataclass(frozen=True)
class ServingChecks:
    target: Optional[str]
    signatures: tuple[SignatureCheck, ...]
    tf1_seconds: float
    xla_seconds: float
    off_gpu: Optional[dict[str, list[str]]] = None  # --target gpu: ops outside XLA with no GPU kernel, per signature

    @property
    def xla_failures(self) -> list[SignatureCheck]:
        return [s for s in self.signatures if not s.xla_compiles]

    def to_json(self) -> dict:
        return {
            "target": self.target,
            "tf1_loader": all(s.tf1_ran for s in self.signatures),
            "xla": all(s.xla_compiles for s in self.signatures),
            "signatures": [s.to_json() for s in self.signatures],
            "tf1_seconds": round(self.tf1_seconds, 3),
            "xla_seconds": round(self.xla_seconds, 3),
            "off_gpu": self.off_gpu,
        }

    def summary(self) -> str:
        """One line: ``serving checks: TF1 loader ran 2 signatures by tensor name; XLA: ...``."""
        xla = "; ".join(_xla_phrase(s) for s in self.signatures)
        gpu = ""
        if self.off_gpu is not None:
            held = sum(len(v) for v in self.off_gpu.values())
            gpu = ("; GPU kernels: every op outside XLA has one" if not held else
                   f"; GPU kernels: {held} op type(s) the input also runs on the host")
        return (
            f"serving checks ({self.tf1_seconds + self.xla_seconds:.1f}s): TF1 session loader ran "
            f"{len(self.signatures)} signature(s) by tensor name; XLA (jit_compile): {xla}{gpu}"
        )


def _xla_phrase(check: SignatureCheck) -> str:
    if check.xla_compiles:
        return f"{check.signature} compiles"
    what = ", ".join(check.xla_unsupported) if check.xla_unsupported else check.xla_error
    return f"{check.signature} does not compile ({what})"


def run(
    saved_model_dir: pathlib.Path,
    *,
    target: Optional[str] = None,
    seed: int = 0,
    data: Optional[Mapping[str, Mapping[str, np.ndarray]]] = None,
    integer_limits: Optional[Mapping[str, Mapping[str, int]]] = None,
    input_dir: Optional[pathlib.Path] = None,
    shown_as: Optional[pathlib.Path] = None,
    xla: Optional[XlaCheck] = None,
    cpu_only_ops: frozenset[str] = frozenset(),
) -> ServingChecks:
    """Both checks on the SavedModel at ``saved_model_dir``.

    Each signature runs on ``data[key]`` (a batch of real inputs) when given,
    else on generated inputs whose integers stay below ``integer_limits[key]``
    (the tables they index), so that the model is checked on inputs it accepts.
    A signature that does not compile under XLA is an error when the same
    signature of ``input_dir`` (the SavedModel before the rewrite) compiles.
    Errors name ``shown_as`` (the output the user asked for) when the checks
    run on a staged copy. ``xla``, an :class:`XlaCheck` of the functions just
    saved there, gives the XLA outcomes: it is started as the TF1 check runs
    the first signature, and lowers while the session runs it. Without
    it the SavedModel is loaded again and lowered here. The TF1 check always
    loads it from disk, as TF Serving does. A signature that does not compile
    only because of ``cpu_only_ops`` (the CPU-only kernels ``--target cpu``
    chose) is reported, not refused.

    Raises :class:`ServingCheckError` when the TF1 loader cannot load or run a
    signature, and, for ``target="tpu"``, when a signature does not compile
    under XLA.
    """
    check_target_name(target)
    started = time.monotonic()
    feeds = CheckInputs(data or {}, integer_limits or {}, seed)
    # The XLA lowering holds the GIL from start to end; a session's run releases it (grappler,
    # kernels, the forward pass: the TF1 check's longest part), so the lowering starts just before it.
    tf1, digests, meta_graph = _run_tf1(
        saved_model_dir, seed=seed, feeds=feeds, shown_as=shown_as, before_run=xla.start if xla else None)
    tf1_seconds = time.monotonic() - started
    off_gpu = _device_kernel_check(meta_graph, input_dir) if target == "gpu" else None
    if xla is None:
        loaded = tf.saved_model.load(str(saved_model_dir))
        with XlaCheck(loaded.signatures, feeds, same=digests) as xla:
            outcomes = xla.outcomes()
    else:
        outcomes = xla.outcomes()
    checks = ServingChecks(
        target,
        tuple(
            SignatureCheck(key, key in tf1, *outcomes.get(key, (False, (), "signature not loaded by tf.saved_model.load")))
            for key in sorted(set(tf1) | set(outcomes))
        ),
        tf1_seconds,
        xla.seconds,
        off_gpu,
    )
    for failed in checks.xla_failures:
        message = f"signature '{failed.signature}' does not compile under XLA (jit_compile=True): " + (
            ", ".join(failed.xla_unsupported) or failed.xla_error
        )
        if target == "tpu":
            raise ServingCheckError(f"--target tpu: {message}; TPU serving needs every signature to compile")
        if cpu_only_ops and _only_cpu_kernels(failed, cpu_only_ops):
            logger.info("%s: --target cpu chose CPU-only kernels there (%s)", message, ", ".join(sorted(cpu_only_ops)))
            continue
        if input_dir is not None and _compiles(input_dir, failed.signature, feeds):
            raise ServingCheckError(
                f"{message}, but it did before the rewrite; a rewrite must not break compilation"
                " (please report it, with the map)"
            )
        logger.warning(message)
    return checks


def _device_kernel_check(meta_graph: Any, input_dir: Optional[pathlib.Path]) -> dict[str, list[str]]:
    """--target gpu: refuse ops the rewrite left outside XLA that have no GPU kernel; return those the input had too."""
    output = device_kernels.missing_gpu_kernels(meta_graph)
    source_graph = savedmodel_io.read_meta_graph(input_dir) if input_dir is not None else None
    source = device_kernels.missing_gpu_kernels(source_graph) if source_graph is not None else {}
    added = device_kernels.new_missing(output, source)
    if added:
        key, ops = next(iter(added.items()))
        more = f" (and {len(added) - 1} more signature(s))" if len(added) > 1 else ""
        raise ServingCheckError(
            f"--target gpu: signature '{key}' has ops outside XLA-compiled functions with no GPU kernel, which would"
            f" run on the host CPU: {', '.join(ops[:6])}{' ...' if len(ops) > 6 else ''}{more}"
        )
    return {key: [f"{entry} x{n}" for entry, n in sorted(counts.items())] for key, counts in output.items() if counts}


def _only_cpu_kernels(failed: SignatureCheck, cpu_only_ops: frozenset[str]) -> bool:
    """Whether what XLA stumbled on in ``failed`` is only ops of ``cpu_only_ops``."""
    if failed.xla_unsupported:
        return all(entry.split(" ", 1)[0] in cpu_only_ops for entry in failed.xla_unsupported)
    return any(op in failed.xla_error for op in cpu_only_ops)


def _compiles(saved_model_dir: pathlib.Path, key: str, feeds: CheckInputs) -> bool:
    """Whether signature ``key`` of ``saved_model_dir`` lowers to XLA (checked only after a failure)."""
    loaded = tf.saved_model.load(str(saved_model_dir))  # keeps the variables alive while compiling
    function = loaded.signatures.get(key)
    return function is not None and _lower(prepare_xla(key, function, feeds=feeds))[0]


@dataclasses.dataclass(frozen=True)
class CheckInputs:
    """The inputs each signature is checked on: given data, else generated within limits."""

    data: Mapping[str, Mapping[str, np.ndarray]]
    integer_limits: Mapping[str, Mapping[str, int]]
    seed: int

    def for_specs(self, key: str, specs: Mapping[str, tf.TensorSpec]) -> dict[str, np.ndarray]:
        given = self.data.get(key)
        if given is not None and set(given) == set(specs):
            return {name: _first_rows(np.asarray(value)) for name, value in given.items()}
        return inputs.generate_for_specs(
            specs, batch=CHECK_BATCH, seed=self.seed, integer_limits=self.integer_limits.get(key)
        )


def _first_rows(value: np.ndarray) -> np.ndarray:
    """The first ``CHECK_BATCH`` rows of a batched input; a scalar input (a step count) as it is."""
    return value[:CHECK_BATCH] if value.ndim else value


_CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})


def computations(meta_graph: Any) -> dict[str, str]:
    """Signature key -> a digest of what it computes, equal for signatures that compute the same.

    Keras exports ``serve`` and ``serving_default`` as two wrappers of one
    function, which the rewrite keeps alike: the checks run each distinct
    computation once. The digest covers the inputs' names, dtypes and shapes,
    and for each output the function that produces it (by content, the
    functions it calls included) and what that call is fed.
    """
    library = {f.signature.name: f for f in meta_graph.graph_def.library.function}
    nodes = {n.name: n for n in meta_graph.graph_def.node}
    memo: dict[str, str] = {}
    digests = {}
    for key, signature in meta_graph.signature_def.items():
        fed = {info.name.split(":")[0]: f"<{name}>" for name, info in signature.inputs.items()}
        digest = hashlib.sha256()
        for name, info in sorted(signature.inputs.items()):
            digest.update(f"input {name} {info.dtype} {info.tensor_shape}\n".encode())
        for name, info in sorted(signature.outputs.items()):
            node_name, _, index = info.name.partition(":")
            node = nodes.get(node_name)
            if node is None or node.op not in _CALL_OPS:  # not a function call: only itself is the same
                digest.update(f"output {name} {info.name}\n".encode())
                continue
            feeds = " ".join(fed.get(i.split(":")[0], i) for i in node.input)
            function = _function_digest(node.attr["f"].func.name, library, memo)
            digest.update(f"output {name} {index} {function} {feeds}\n".encode())
        digests[key] = digest.hexdigest()
    return digests


def _function_digest(name: str, library: Mapping[str, Any], memo: dict[str, str]) -> str:
    """A digest of FunctionDef ``name`` without its own name, callees by their digests."""
    if name not in memo:
        if name not in library:
            return name  # a registered op, not a function
        function = type(library[name])()
        function.CopyFrom(library[name])
        function.signature.name = ""
        for attrs in function.arg_attr.values():  # names the capturing graph chose
            attrs.attr.pop("_user_specified_name", None)
        for node in function.node_def:
            for value in node.attr.values():
                if value.HasField("func"):
                    value.func.name = _function_digest(value.func.name, library, memo)
                for callee in value.list.func:
                    callee.name = _function_digest(callee.name, library, memo)
            if node.op in library:
                node.op = _function_digest(node.op, library, memo)
        memo[name] = hashlib.sha256(function.SerializeToString(deterministic=True)).hexdigest()
    return memo[name]


def run_tf1(
    saved_model_dir: pathlib.Path,
    *,
    seed: int = 0,
    feeds: Optional[CheckInputs] = None,
    shown_as: Optional[pathlib.Path] = None,
) -> dict[str, dict[str, np.ndarray]]:
    """Load with the TF1 session loader and run every SignatureDef by tensor name.

    Returns signature key -> output key -> value. This is TF Serving's path:
    ``LoadSavedModel`` with tag ``serve``, then ``Session::Run`` on the tensor
    names the SignatureDef lists. Signatures that compute the same (see
    :func:`computations`) run once and share their values.
    """
    return _run_tf1(saved_model_dir, seed=seed, feeds=feeds, shown_as=shown_as)[0]


def _run_tf1(
    saved_model_dir: pathlib.Path,
    *,
    seed: int,
    feeds: Optional[CheckInputs],
    shown_as: Optional[pathlib.Path],
    before_run: Optional[Callable[[], None]] = None,
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, str], Any]:
    """:func:`run_tf1`, the signatures' computation digests and the MetaGraphDef; ``before_run()`` is called before the first signature runs."""
    graph = tf.Graph()
    results: dict[str, dict[str, np.ndarray]] = {}
    try:
        with tf.compat.v1.Session(graph=graph) as session, tf_internals.deprecation_warnings_silenced():
            meta_graph = tf.compat.v1.saved_model.loader.load(session, [SERVE_TAG], str(saved_model_dir))
            digests = computations(meta_graph)
            first: dict[str, str] = {}  # digest -> the signature that ran it
            for key in sorted(meta_graph.signature_def):
                if key.startswith("__"):  # __saved_model_init_op
                    continue
                if digests[key] in first:
                    results[key] = results[first[digests[key]]]
                    continue
                first[digests[key]] = key
                signature = meta_graph.signature_def[key]
                specs = {name: _spec_of(info) for name, info in signature.inputs.items()}
                values = (feeds or CheckInputs({}, {}, seed)).for_specs(key, specs)
                fetches = {name: info.name for name, info in signature.outputs.items()}
                if before_run is not None:
                    before_run()  # once, just before the longest stretch without the GIL
                    before_run = None
                try:
                    results[key] = session.run(fetches, {signature.inputs[n].name: v for n, v in values.items()})
                except tf.errors.OpError as exc:
                    raise ServingCheckError(
                        f"the TF1 session loader (TF Serving's) cannot run signature '{key}' of"
                        f" '{shown_as or saved_model_dir}': {cause_line(exc.message)}"
                    ) from exc
    except (tf.errors.OpError, RuntimeError, ValueError, OSError) as exc:
        raise ServingCheckError(
            f"the TF1 session loader (TF Serving's) cannot load '{shown_as or saved_model_dir}':"
            f" {cause_line(str(exc))}"
        ) from exc
    return results, digests, meta_graph


def _spec_of(info: Any) -> tf.TensorSpec:
    shape = tf.TensorShape(info.tensor_shape)
    return tf.TensorSpec(shape, tf.dtypes.as_dtype(info.dtype))


XlaOutcome = tuple[bool, tuple[str, ...], str]
"""``(compiles, unsupported ops as "Op (node)", first line of the error)``."""


@dataclasses.dataclass
class PreparedLowering:
    """One signature, traced under ``jit_compile=True``, ready to lower (on any thread)."""

    key: str
    function: Any  # the jit-compiled wrapper's ConcreteFunction
    args: list[tf.Tensor]
    captured_inputs: list[tf.Tensor]
    stand_ins: list[tf.Variable]  # kept alive while lowering

    def lower(self) -> XlaOutcome:
        """Lower to XLA HLO as ``tf.function(jit_compile=True)`` does.

        This is tf2xla's step, where an op without an XLA kernel fails; the
        backend's code generation (this machine's CPU, not the serving GPU or
        TPU) is not run, which keeps the check cheap for big models.
        """
        try:
            tf_internals.lower_to_hlo(self.function, self.args, self.captured_inputs)
        except (tf.errors.OpError, ValueError, TypeError) as exc:
            return _failed(self.key, exc)
        return True, (), ""


def prepare_xla(key: str, function: Any, *, seed: int = 0, feeds: Optional[CheckInputs] = None) -> PreparedLowering | XlaOutcome:
    """Trace signature ``function`` as ``tf.function(jit_compile=True)`` traces it, on the check's inputs.

    The variables it captures that have no value yet (the output's, while it
    is being saved) are replaced by stand-ins of their dtype and shape: the
    lowering reads no value. Returns the outcome at once when tracing fails.
    """
    values = (feeds or CheckInputs({}, {}, seed)).for_specs(key, inputs.input_specs(function))
    names = sorted(values)

    def call(*args: tf.Tensor) -> Any:
        return function(**dict(zip(names, args)))

    try:
        args = [tf.constant(values[name]) for name in names]
        specs = [tf.TensorSpec(arg.shape, arg.dtype, name=name) for name, arg in zip(names, args)]  # named as the inputs
        traced = tf.function(call, jit_compile=True).get_concrete_function(*specs)
    except (tf.errors.OpError, ValueError, TypeError) as exc:
        return _failed(key, exc)
    captured, stand_ins = [], []
    for handle in traced.captured_inputs:
        stand_in = tf_internals.value_free_stand_in(handle)
        if stand_in is not None:
            stand_ins.append(stand_in)
        captured.append(handle if stand_in is None else stand_in.handle)
    return PreparedLowering(key, traced, args, captured, stand_ins)


def _lower(prepared: PreparedLowering | XlaOutcome) -> XlaOutcome:
    """Lower a prepared signature; an outcome already known (tracing failed) is returned as it is."""
    return prepared.lower() if isinstance(prepared, PreparedLowering) else prepared


def _failed(key: str, exc: Exception) -> XlaOutcome:
    message = getattr(exc, "message", str(exc))
    unsupported = tuple(dict.fromkeys(f"{op} ({node})" for op, node in _UNSUPPORTED_OP.findall(message)))
    logger.debug("XLA cannot compile %s: %s", key, message)
    return False, unsupported, cause_line(message)


class XlaCheck:
    """Each distinct signature traced at once, lowered to XLA HLO on a thread of its own.

    Lowering needs the functions, not the values (see :func:`prepare_xla`),
    so the rewrite traces them before it saves the output. The lowering holds
    the GIL throughout, so :func:`run` starts it (:meth:`start`) just as the
    TF1 check runs the first signature in its session, which releases the
    GIL: the two checks run on two cores. Signatures
    that share one function object (a key and its aliases) are lowered once.
    ``same`` (key -> a digest of what it computes) merges more. Use as a
    context manager, so that the thread is joined whatever happens::

        with XlaCheck(functions, feeds) as xla:
            ... save ...
            xla.start()
            ... other work ...
            outcomes = xla.outcomes()
    """

    def __init__(self, functions: Mapping[str, Any], feeds: CheckInputs, same: Optional[Mapping[str, str]] = None) -> None:
        started = time.monotonic()
        self._groups: dict[Any, list[str]] = {}
        first: dict[Any, Any] = {}
        for key, function in sorted(functions.items()):
            group = same.get(key, key) if same else id(function)
            first.setdefault(group, function)
            self._groups.setdefault(group, []).append(key)
        self._prepared = {
            group: prepare_xla(keys[0], first[group], feeds=feeds) for group, keys in self._groups.items()
        }
        self._outcomes: dict[Any, XlaOutcome] = {}
        self._error: Optional[BaseException] = None
        self._prepare_seconds = time.monotonic() - started
        self._lower_seconds = 0.0
        self._thread = threading.Thread(target=self._lower_all, name="tfpolicy-xla-check", daemon=True)

    def start(self) -> None:
        """Start lowering on the thread (once; :meth:`outcomes` starts it if nobody has)."""
        if self._thread.ident is None:
            self._thread.start()

    def _lower_all(self) -> None:
        started = time.monotonic()
        try:
            for group, prepared in self._prepared.items():
                self._outcomes[group] = _lower(prepared)
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread by outcomes()
            self._error = exc
        self._lower_seconds = time.monotonic() - started

    @property
    def seconds(self) -> float:
        """Time spent on the check: tracing on the caller's thread plus lowering on its own."""
        return self._prepare_seconds + self._lower_seconds

    def outcomes(self) -> dict[str, XlaOutcome]:
        """Signature key -> outcome, waiting for the lowering to finish."""
        self.start()
        self._thread.join()
        self._prepared.clear()  # the stand-ins go
        if self._error is not None:
            raise self._error
        return {key: self._outcomes[group] for group, keys in self._groups.items() for key in keys}

    def __enter__(self) -> XlaCheck:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._thread.ident is not None:
            self._thread.join()
        self._prepared.clear()
