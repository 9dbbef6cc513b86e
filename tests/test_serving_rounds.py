"""tools/serving_rounds.py: the README's round-robin serving latencies, on the shipped example."""

from __future__ import annotations

import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tools"))

import serving_rounds  # noqa: E402

EXAMPLE = REPO_ROOT / "examples" / "mlp" / "saved_model"


def test_every_model_is_timed_each_round_and_ratios_are_to_the_first(capsys):
    rows = serving_rounds.main(["--rounds", "3", "--batch", "4", str(EXAMPLE), f"amp:{EXAMPLE}"])
    assert [model for model, _, _ in rows] == [str(EXAMPLE), f"amp:{EXAMPLE}"]
    assert all(0 < fastest <= median for _, fastest, median in rows)
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| model |") and len(table) == 4
    assert table[2].endswith("| 1.00 |")  # the first model against itself
