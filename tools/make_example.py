"""Write the shipped example: a tiny float32 Keras 3 MLP SavedModel and its policy map.

    python tools/make_example.py [--output examples/mlp]

produces::

    <output>/saved_model/   model.export() of a Functional MLP
                            (Input "features" (16,) -> Dense "dense" 32 relu
                             -> Dense "dense_1" 32 relu -> Dense "head" 4)
    <output>/policy.json    {"default_policy": "mixed_bfloat16",
                             "policy_map": {"head": "float32"}}

The weights come from a fixed seed, so the variables are a few KB and the
model's outputs are the same on every run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import shutil
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

logger = logging.getLogger("make_example")

SEED = 1234
POLICY = {"default_policy": "mixed_bfloat16", "policy_map": {"head": "float32"}}


def build_mlp() -> "keras.Model":  # noqa: F821 - keras is imported lazily
    """The example's float32 Functional MLP, with seeded weights."""
    import keras

    keras.utils.set_random_seed(SEED)
    inputs = keras.Input(shape=(16,), name="features")
    x = keras.layers.Dense(32, activation="relu", name="dense")(inputs)
    x = keras.layers.Dense(32, activation="relu", name="dense_1")(x)
    outputs = keras.layers.Dense(4, name="head")(x)
    return keras.Model(inputs, outputs, name="mlp")


def write_example(output: pathlib.Path) -> None:
    """Write ``saved_model/`` and ``policy.json`` under ``output`` (replacing them)."""
    output.mkdir(parents=True, exist_ok=True)
    saved_model_dir = output / "saved_model"
    if saved_model_dir.exists():
        shutil.rmtree(saved_model_dir)
    build_mlp().export(str(saved_model_dir), verbose=False)
    (output / "policy.json").write_text(json.dumps(POLICY, indent=2) + "\n")
    logger.info("wrote %s and %s", saved_model_dir, output / "policy.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output",
        type=pathlib.Path,
        default=pathlib.Path("examples/mlp"),
        help="directory to write saved_model/ and policy.json into (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_example(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
