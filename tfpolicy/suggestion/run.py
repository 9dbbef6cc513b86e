"""``tfpolicy.suggest``: the cheapest policy map that keeps a model within an error budget.

Four steps, each on the user's data and this machine::

    candidates --rewrite each, to every layer--> uniform outputs
      -> sensitivity: per layer and candidate, the error it adds (local error, one run per candidate)
      -> cost: per layer and candidate, seconds (the uniform output's latency, split by
         multiply-adds) or bytes (the variables the rewrite stores)
      -> search (tfpolicy.suggestion.search): cheapest predicted assignment within the budget
      -> verify: the real rewrite of that map, its error on held-out rows; if over the
         budget, the predictions are scaled by what was measured and the search runs
         again (or the layer with the largest share backs off), up to ``rounds`` times

Every rewrite here is kept in memory (:func:`tfpolicy.api.rewrite_in_memory`:
the graphs and variables :func:`tfpolicy.rewrite` would write, bit for bit the
same outputs), so nothing is written and nothing loaded back.

The map returned is the best of every map measured (the uniform ones
included) whose held-out error is within the budget, so it is never worse
than the best single policy that meets the budget.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
import time
from typing import Any, Callable, Optional, Sequence

import keras

from tfpolicy.analysis.policy_map import PolicyMap
from tfpolicy.core import inputs, paths, savedmodel_io
from tfpolicy.errors import InputDataError, TfPolicyError
from tfpolicy.suggestion import measure, search
from tfpolicy.suggestion.measure import METRICS, Metric, Model
from tfpolicy.validation.layer_errors import json_float

logger = logging.getLogger(__name__)

OBJECTIVES = ("latency", "bytes")
DEFAULT_CANDIDATES = {
    # Most precise first. Per target, the forms that can pay off there (see the README's serving tables).
    ("latency", None): ("float32", "mixed_bfloat16", "int8_from_mixed_bfloat16"),
    ("latency", "cpu"): ("float32", "mixed_bfloat16", "int8_from_float32", "int8_from_mixed_bfloat16"),
    ("latency", "gpu"): ("float32", "mixed_bfloat16", "int8_from_mixed_bfloat16", "float8_from_mixed_bfloat16"),
    ("latency", "tpu"): ("float32", "mixed_bfloat16", "int8_from_mixed_bfloat16"),
    ("bytes", None): ("float32", "bfloat16", "int8_from_bfloat16", "int4/128_from_bfloat16"),
}
BATCH = 16
SENSITIVITY_ROWS = 4  # the per-layer comparison runs the model three times: a few rows tell each layer's error
TIMING_ROWS = 8  # latency is measured at this batch (or the data's, if smaller)
MARGIN = 0.9  # the search aims below the budget: predictions are estimates


@dataclasses.dataclass
class Tried:
    """One map the search measured."""

    label: str
    policy_map: dict
    error: float  # on the held-out rows, by the metric
    latency_s: float
    bytes: int  # of the output's variables
    within_budget: bool

    def to_json(self) -> dict:
        return {"label": self.label, "policy_map": self.policy_map, "error": json_float(self.error),
                "latency_s": self.latency_s, "bytes": self.bytes, "within_budget": self.within_budget}


@dataclasses.dataclass
class Suggestion:
    """The suggested map, and every map measured on the way (the frontier)."""

    policy_map: dict  # the plain form
    chosen: Tried
    tried: list[Tried]
    metric: str
    output: str
    budget: float
    objective: str
    target: Optional[str]
    candidates: tuple[str, ...]
    seconds: float
    rows: dict[str, int]  # search / held_out

    def keras_config(self) -> dict:
        """The map as Keras serializes a ``DTypePolicyMap`` (``keras.saving.deserialize_keras_object`` reads it)."""
        return keras.saving.serialize_keras_object(PolicyMap.load(self.policy_map).to_keras())

    def to_json(self) -> dict:
        return {"policy_map": self.policy_map, "chosen": self.chosen.label, "metric": self.metric,
                "output": self.output, "max_error": self.budget, "objective": self.objective, "target": self.target,
                "candidates": list(self.candidates), "seconds": self.seconds, "rows": self.rows,
                "frontier": [t.to_json() for t in self.tried]}

    def format_table(self) -> str:
        header = ("map", "error", "latency ms", "MB", "within")
        rows = [(t.label + (" *" if t is self.chosen else ""), f"{t.error:.3g}", f"{t.latency_s * 1e3:.1f}",
                 f"{t.bytes / 1e6:.2f}", "yes" if t.within_budget else "no") for t in self.tried]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
        return "\n".join(lines)


def suggest(
    input_dir: Any,
    data: inputs.InputSource,
    max_error: float,
    *,
    metric: str = "rel_max",
    output: Optional[str] = None,
    target: Optional[str] = None,
    objective: str = "latency",
    candidates: Optional[Sequence[str]] = None,
    held_out: float = 0.25,
    rounds: int = 3,
    progress: Optional[Callable[[str], None]] = None,
) -> Suggestion:
    """The cheapest map (by ``objective`` on ``target``) whose error on held-out rows of ``data`` is within ``max_error``.

    ``data``: an ``.npz`` path, a dict of arrays or an iterable of batches for
    ``serving_default``. ``metric``: ``rel_max``, ``rel_rms`` or ``top1`` on
    ``output`` (needed when the signature has several). ``candidates``:
    policy names, most precise first (default: by objective and target).
    Writes nothing the caller did not ask for; raises
    :class:`~tfpolicy.errors.TfPolicyError` for bad input.
    """
    started = time.monotonic()
    say = progress or (lambda message: logger.info(message))
    input_path = pathlib.Path(input_dir)
    paths.check_input_dir(input_path)
    chosen_candidates = _check_arguments(max_error, metric, objective, target, candidates, held_out)
    batches = inputs.batches_from(data, what="--data", batch_size=BATCH)
    source = savedmodel_io.load(input_path, [measure.SIGNATURE])  # loaded once: the reference, and every rewrite's input
    source.derived = {}  # each kernel quantized once, whichever candidates and maps quantize it
    reference = Model.of_root(source.root)
    inputs.check_inputs(batches[0], measure.SIGNATURE, reference.function, what="--data")
    batches = [inputs.conform(b, reference.function) for b in batches]
    name = measure.choose_output(reference.function, output)
    measure_error = Metric(metric, name)
    search_rows, verify_rows = measure.split_rows(batches, held_out)
    sensitivity_rows = [measure.rows_of(search_rows[0], 0, SENSITIVITY_ROWS)]
    # The first search batch is the timing batch: a candidate's call on it is one of its latency samples.
    first, first_rows = search_rows[0], inputs.batch_rows(search_rows[0])
    search_rows[:1] = [measure.rows_of(first, start, min(start + TIMING_ROWS, first_rows))
                       for start in range(0, first_rows, TIMING_ROWS)]
    timing_batch = search_rows[0]
    ref_search = reference.outputs(search_rows, name)
    ref_verify = reference.outputs(verify_rows, name)
    float_layers = measure.reference_of(source)
    layers = measure.layer_shapes(float_layers.index)
    all_paths = sorted(float_layers.index.paths)
    tried: list[Tried] = []
    uniform: dict[str, dict] = {}

    def measured(label: str, plain: dict, model: Model, search_outputs: Optional[list] = None) -> Tried:
        """The map's held-out error, latency and stored bytes, added to the frontier.

        The held-out rows run first (a function's first call optimizes its
        graph); ``search_outputs``, when given, receives the outputs on the
        search rows, whose first call is one of the latency's samples.
        """
        error = measure_error(ref_verify, model.outputs(verify_rows, name))
        seconds: list[float] = []
        if search_outputs is not None:
            search_outputs.extend(model.outputs(search_rows, name, seconds))
        latency = model.latency(timing_batch, seconds[:1])
        entry = Tried(label, plain, error, latency, model.variable_bytes, error <= max_error)
        tried.append(entry)
        return entry

    for i, policy in enumerate(chosen_candidates):
        say(f"candidate {i + 1}/{len(chosen_candidates)}: {policy} on every layer")
        plain = {"default_policy": policy}
        rewritten = None if policy == "float32" else _rewrite(input_path, source, plain, target, search_rows)
        model = reference if rewritten is None else Model.in_memory(rewritten)
        got_search: list = []  # the float model's are at hand
        entry = measured(f"{policy} (every layer)", plain, model, None if rewritten is None else got_search)
        error_search = 0.0 if rewritten is None else measure_error(ref_search, got_search)
        stats = {} if rewritten is None else measure.local_errors(float_layers, rewritten, sensitivity_rows)
        quantized = set() if rewritten is None else {
            p for p, q in rewritten.report.quantization.items() if q.ops_quantized}
        uniform[policy] = {"error": error_search, "stats": stats, "quantized": quantized, "tried": entry}
        del model, rewritten  # one rewrite's variables in memory at a time
    left = _left_unquantized(layers, uniform)
    for entry in tried:  # the uniform maps as the rewrite applied them
        entry.policy_map = _applied_map({}, entry.policy_map["default_policy"], all_paths, left)
    tables = _tables(layers, uniform, chosen_candidates, objective)
    assignment = search.cheapest_within(tables, max_error, MARGIN)
    seen = {json.dumps(t.policy_map, sort_keys=True) for t in tried}  # a map measured already ends the rounds
    for round_number in range(1, rounds + 1):
        default = search.majority(assignment, chosen_candidates)
        plain = _applied_map(assignment, default, all_paths, left)
        key = json.dumps(plain, sort_keys=True)
        if key in seen:
            break
        seen.add(key)
        say(f"verifying suggestion {round_number}: {len(plain.get('policy_map', {}))} key(s) over default {default}")
        error = measured(f"suggestion {round_number}", plain,
                         Model.in_memory(_rewrite(input_path, source, plain, target, search_rows))).error
        if error <= max_error:
            break
        predicted = tables.predicted_error(assignment, default)
        tables = _scaled(tables, error / predicted if predicted > 0 else 2.0)
        again = search.cheapest_within(tables, max_error, MARGIN)
        assignment = again if again != assignment else (search.back_off(tables, assignment) or assignment)
    best = _best(tried, objective)
    if best is None:
        raise TfPolicyError(f"no map tried keeps {measure_error.name} of '{name}' within {max_error:g} on the held-out"
                            f" rows, not even {chosen_candidates[0]} on every layer; raise --max_error")
    return Suggestion(best.policy_map, best, tried, metric, name, max_error, objective, target, chosen_candidates,
                      time.monotonic() - started,
                      {"search": sum(inputs.batch_rows(b) for b in search_rows),
                       "held_out": sum(inputs.batch_rows(b) for b in verify_rows)})


def _check_arguments(max_error, metric, objective, target, candidates, held_out) -> tuple[str, ...]:
    if not (isinstance(max_error, (int, float)) and max_error >= 0 and math.isfinite(max_error)):
        raise InputDataError(f"--max_error must be a non-negative number, got {max_error!r}")
    if metric not in METRICS:
        raise InputDataError(f"--metric must be one of {', '.join(METRICS)}, got '{metric}'")
    if objective not in OBJECTIVES:
        raise InputDataError(f"--objective must be one of {', '.join(OBJECTIVES)}, got '{objective}'")
    if not 0 < held_out < 1:
        raise InputDataError(f"the held-out share must be between 0 and 1, got {held_out}")
    chosen = tuple(candidates) if candidates else DEFAULT_CANDIDATES.get(
        (objective, target), DEFAULT_CANDIDATES[(objective, None)])
    if not chosen:
        raise InputDataError("--candidates is empty")
    for name in chosen:
        try:
            keras.dtype_policies.get(name)
        except (ValueError, TypeError) as exc:
            raise InputDataError(f"--candidates: '{name}' is not a Keras dtype policy ({exc})") from None
    if len(set(chosen)) != len(chosen):
        raise InputDataError(f"--candidates names a policy twice: {', '.join(chosen)}")
    return chosen


def _rewrite(input_path: pathlib.Path, source: savedmodel_io.LoadedModel, plain: dict, target: Optional[str],
             rows) -> Any:
    """``plain`` applied by the rewrite to ``serving_default`` of ``source`` (the input, loaded), kept in
    memory (nothing is written)."""
    from tfpolicy import api  # noqa: PLC0415

    needs_data = any(getattr(keras.dtype_policies.get(p), "quantization_mode", None) == "float8"
                     for p in [plain["default_policy"], *plain.get("policy_map", {}).values()])
    # The search's own rewrites: their warnings (a quantized policy on a normalization layer, which
    # every uniform int8 map has) are not the user's.
    package = logging.getLogger("tfpolicy")
    level = package.level
    package.setLevel(logging.ERROR)
    try:
        return api.rewrite_in_memory(input_path, plain, signatures=[measure.SIGNATURE], target=target,
                                     calibration_data=list(rows) if needs_data else None, loaded=source)
    finally:
        package.setLevel(level)


def _left_unquantized(layers: dict[str, measure.LayerShape], uniform: dict[str, dict]) -> dict[str, set[str]]:
    """Per quantized candidate: the layers with kernels that its rewrite of every layer left unquantized
    (a convolution without ``--int8_convolutions``, a position embedding), which run in its source policy."""
    return {policy: {path for path, shape in layers.items() if shape.kernels and path not in found["quantized"]}
            for policy, found in uniform.items() if _source(policy) != policy}


def _source(policy: str) -> str:
    """A quantized policy's source policy (``int8_from_bfloat16`` -> ``bfloat16``); others, themselves."""
    if getattr(keras.dtype_policies.get(policy), "quantization_mode", None) is None:
        return policy
    return policy.split("_from_", 1)[1]


def _applied_map(assignment: dict[str, str], default: str, all_paths: list[str], left: dict[str, set[str]]) -> dict:
    """The plain map of ``assignment`` over ``default`` as the rewrite applies it.

    A quantized policy on a layer the rewrite leaves unquantized under it
    (``left``: a convolution without ``--int8_convolutions``) is written as
    its source policy, which is what that layer runs in: the map means what
    was measured under either setting of that flag, and to Keras (which
    cannot quantize a convolution: its setter raises).
    """
    full = {path: assignment.get(path, default) for path in all_paths}
    full = {path: _source(policy) if path in left.get(policy, ()) else policy for path, policy in full.items()}
    keys = search.policy_map(full, all_paths, default)
    return {"default_policy": default, "policy_map": keys} if keys else {"default_policy": default}


def _tables(layers: dict[str, measure.LayerShape], uniform: dict[str, dict], candidates: tuple[str, ...],
            objective: str) -> search.Tables:
    """Shares of error and costs per layer and candidate, from the uniform runs."""
    any_stats = next((u["stats"] for u in uniform.values() if u["stats"]), {})
    if objective == "latency":
        work = {path: measure.multiply_adds(shape, any_stats.get(path)) for path, shape in layers.items()}
        total = sum(work.values()) or 1.0
        cost = {path: {p: work[path] / total * uniform[p]["tried"].latency_s for p in candidates}
                for path in layers if work[path] > 0}
    else:
        policies = {p: keras.dtype_policies.get(p) for p in candidates}
        cost = {path: {p: measure.stored_bytes(shape, policies[p], path in uniform[p]["quantized"]) for p in candidates}
                for path, shape in layers.items()}
        cost = {path: c for path, c in cost.items() if len(set(c.values())) > 1}
    share: dict[str, dict[str, float]] = {path: {} for path in cost}
    rest: dict[str, float] = {}
    for policy in candidates:
        stats = uniform[policy]["stats"]
        local = {path: (s.rel_error if math.isfinite(s.rel_error) else 1.0) for path, s in stats.items()}
        total = math.sqrt(sum(v * v for v in local.values()))
        error = uniform[policy]["error"]
        scale = error / total if total > 0 else 0.0
        for path in cost:
            share[path][policy] = scale * local.get(path, 0.0)
        rest[policy] = scale * math.sqrt(sum(v * v for path, v in local.items() if path not in cost))
    return search.Tables(candidates, share, cost, rest)


def _scaled(tables: search.Tables, factor: float) -> search.Tables:
    share = {layer: {p: v * factor for p, v in row.items()} for layer, row in tables.share.items()}
    return search.Tables(tables.candidates, share, tables.cost, {p: v * factor for p, v in tables.rest.items()})


def _best(tried: list[Tried], objective: str) -> Optional[Tried]:
    within = [t for t in tried if t.within_budget]
    if not within:
        return None
    return min(within, key=lambda t: (t.latency_s if objective == "latency" else t.bytes, t.error))

