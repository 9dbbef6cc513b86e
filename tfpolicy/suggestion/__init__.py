"""``tfpolicy suggest``: search for the cheapest policy map within an error budget.

:func:`suggest` (also ``tfpolicy.suggest``) measures, searches and verifies
(:mod:`tfpolicy.suggestion.run`); the search itself is pure Python
(:mod:`tfpolicy.suggestion.search`); the command is ``python -m tfpolicy.suggest``.
"""

from tfpolicy.suggestion.run import Suggestion, Tried, suggest

__all__ = ["Suggestion", "Tried", "suggest"]
