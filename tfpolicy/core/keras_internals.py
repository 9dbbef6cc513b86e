"""Every private piece of Keras tfpolicy relies on, each with why no public API serves.

Like :mod:`tfpolicy.core.tf_internals`, the one room for them: a Keras upgrade
that changes one fails ``tests/test_tf_internals.py`` by name.
"""

from __future__ import annotations

import functools
import inspect
import logging

import keras

logger = logging.getLogger(__name__)

# Keras 3.15's layers that are built in ``__init__`` (and so never get a path),
# by their default names: what :func:`layers_built_at_init` finds in Keras's
# source, for an install without sources (a zipped or compiled Keras).
KERAS_3_15_BUILT_AT_INIT = frozenset({
    "activation", "activity_regularization", "alpha_dropout", "average_pooling1d", "average_pooling2d",
    "average_pooling3d", "dropout", "elu", "gaussian_dropout", "gaussian_noise", "global_average_pooling1d",
    "global_average_pooling2d", "global_average_pooling3d", "global_max_pooling1d", "global_max_pooling2d",
    "global_max_pooling3d", "identity", "input_layer", "leaky_re_lu", "masking", "max_pooling1d",
    "max_pooling2d", "max_pooling3d", "re_lu", "reshape", "softmax", "spatial_dropout1d", "spatial_dropout2d",
    "spatial_dropout3d", "tfsm_layer", "unit_normalization",
})


def to_snake_case(name: str) -> str:
    """Keras's default layer name for a class name (``MultiHeadAttention`` -> ``multi_head_attention``).

    Private: ``keras.src.utils.naming.to_snake_case`` is the rule Keras names layers by; there is no public one.
    """
    from keras.src.utils.naming import to_snake_case as keras_rule  # noqa: PLC0415

    return keras_rule(name)


@functools.lru_cache(maxsize=None)
def layers_built_at_init() -> frozenset[str]:
    """Default names (``dropout``, ``activation``) of the Keras layers that never get a path.

    Keras marks these built in ``__init__`` (``_build_at_init()``, or
    ``self.built = True``), so the ``build`` wrapper that sets ``layer.path``
    never runs. No API says which they are, so Keras's own classes are read;
    where their source is not installed, the list pinned for Keras 3.15.
    """
    names = set()
    for attribute in dir(keras.layers):
        cls = getattr(keras.layers, attribute)
        if not (isinstance(cls, type) and issubclass(cls, keras.layers.Layer)):
            continue
        for klass in cls.__mro__:
            if klass is keras.layers.Layer or "build" in vars(klass):
                break  # a build() of its own: Keras builds it, and it gets a path
            try:
                source = inspect.getsource(vars(klass)["__init__"]) if "__init__" in vars(klass) else ""
            except (OSError, TypeError):
                logger.debug("Keras's source is not installed; using the layers pinned for Keras 3.15")
                return KERAS_3_15_BUILT_AT_INIT
            if "_build_at_init()" in source or "self.built = True" in source:
                names.add(to_snake_case(cls.__name__))
                break
    return frozenset(names)
