"""The search of ``tfpolicy suggest``: which policy each layer takes, from measured tables.

Pure Python, no TensorFlow: everything here works on numbers the measuring
step (:mod:`tfpolicy.suggestion.measure`) has taken.

The model it searches with::

    error(assignment) ~ sqrt(rest**2 + sum over layers L of share[L][P_L]**2)
    cost(assignment)  =              sum over layers L of cost[L][P_L]

``share[L][P]`` is layer L's part of the output error that candidate P
caused when it was applied to every layer: the uniform model's measured
error, split over the layers by the error each adds locally (fed the float
model's inputs), so that the shares of a uniform map give back its measured
error. Roundings in different layers are independent, so their errors add
like noise, in squares; a layer left in float32 takes its share out.

The search (:func:`cheapest_within`) starts every layer at its cheapest
candidate and, while the predicted error is over the budget, makes the move
(one layer to a more precise candidate) that buys the most error per unit of
cost. :func:`back_off` is the step after a verification that measured the
error over the budget: the layer with the largest share moves up.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Optional, Sequence

Assignment = dict[str, str]  # layer path -> policy name


@dataclasses.dataclass(frozen=True)
class Tables:
    """What the search knows: per layer and candidate, a share of the error and a cost."""

    candidates: tuple[str, ...]  # most precise first
    share: Mapping[str, Mapping[str, float]]  # layer -> candidate -> predicted error it adds
    cost: Mapping[str, Mapping[str, float]]  # layer -> candidate -> seconds or bytes
    rest: Mapping[str, float]  # candidate -> error of the layers the map does not address, at that default

    @property
    def layers(self) -> list[str]:
        return sorted(self.share)

    def predicted_error(self, assignment: Mapping[str, str], default: str) -> float:
        squares = self.rest.get(default, 0.0) ** 2
        squares += sum(self.share[layer][policy] ** 2 for layer, policy in assignment.items())
        return squares ** 0.5


def cheapest_within(tables: Tables, budget: float, margin: float = 1.0) -> Assignment:
    """The cheapest assignment found whose predicted error is within ``budget * margin``.

    Greedy: every layer at its cheapest candidate, then the best ratio of
    error removed to cost added, one move at a time. Ends with everything at
    the most precise candidate if nothing cheaper fits.
    """
    assignment = {layer: min(tables.candidates, key=lambda p, l=layer: (tables.cost[l][p], _rank(tables, p)))
                  for layer in tables.layers}
    limit = budget * margin
    default = majority(assignment, tables.candidates)
    while tables.predicted_error(assignment, default) > limit:
        move = _best_move(tables, assignment)
        if move is None:
            break
        assignment[move[0]] = move[1]
        default = majority(assignment, tables.candidates)
    return assignment


def _best_move(tables: Tables, assignment: Mapping[str, str]) -> Optional[tuple[str, str]]:
    best, best_value = None, -1.0
    for layer, policy in assignment.items():
        now_error, now_cost = tables.share[layer][policy] ** 2, tables.cost[layer][policy]
        for other in tables.candidates:
            gained = now_error - tables.share[layer][other] ** 2
            if gained <= 0:
                continue
            added = max(tables.cost[layer][other] - now_cost, 0.0)
            value = gained / (added + 1e-12 * (1 + abs(now_cost)))
            if value > best_value:
                best, best_value = (layer, other), value
    return best


def back_off(tables: Tables, assignment: Mapping[str, str]) -> Optional[Assignment]:
    """One layer, the one with the largest predicted share, one step more precise; None when all are at the top."""
    movable = [(tables.share[layer][policy], layer) for layer, policy in assignment.items()
               if _rank(tables, policy) > 0]
    if not movable:
        return None
    _, layer = max(movable)
    result = dict(assignment)
    result[layer] = tables.candidates[_rank(tables, assignment[layer]) - 1]
    return result


def _rank(tables: Tables, policy: str) -> int:
    return tables.candidates.index(policy)


def majority(assignment: Mapping[str, str], candidates: Sequence[str]) -> str:
    """The policy most layers take (ties: the more precise), which becomes the map's default."""
    counts = {p: 0 for p in candidates}
    for policy in assignment.values():
        counts[policy] += 1
    return max(candidates, key=lambda p: (counts[p], -candidates.index(p)))


# -- keys -----------------------------------------------------------------------------------------

_DIGITS = re.compile(r"\d+")


def block_pattern(path: str) -> str:
    """``encoder_3/ffn/dense_1`` -> ``encoder_\\d+/ffn/dense_\\d+``: the path with every number generalised.

    The literal parts hold no digits, so each ``\\d+`` must take a whole run
    of digits: the pattern matches exactly the paths that generalise to it.
    """
    pieces = _DIGITS.split(path)
    return r"\d+".join(re.escape(piece) for piece in pieces)


def policy_map(assignment: Mapping[str, str], all_layers: Sequence[str], default: str) -> dict[str, str]:
    """The map as a person would write it: one regex key per repeated pattern whose layers all agree.

    Layers that take ``default`` need no key. Layers sharing a pattern
    (``block_\\d+/ffn``) get one key when every layer of the model with that
    pattern takes the same policy and there are at least two; the others get
    exact keys. No two keys can match one path: a path matches only its own
    pattern, and an exact key wins over a regex in Keras's lookup anyway.
    """
    by_pattern: dict[str, set[str]] = {}
    members: dict[str, list[str]] = {}
    for layer in all_layers:
        pattern = block_pattern(layer)
        members.setdefault(pattern, []).append(layer)
        by_pattern.setdefault(pattern, set()).add(assignment.get(layer, default))
    result: dict[str, str] = {}
    for layer in sorted(assignment):
        policy = assignment[layer]
        if policy == default:
            continue
        pattern = block_pattern(layer)
        if len(members[pattern]) > 1 and by_pattern[pattern] == {policy} and pattern != re.escape(layer):
            result[pattern] = policy
        else:
            result[layer] = policy
    return result
