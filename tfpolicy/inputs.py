"""Input data for calibration and validation: ``.npz`` files of named batches."""

from __future__ import annotations

import os
import zipfile
from typing import Union

import numpy as np

from tfpolicy.errors import InputDataError


def load_npz(path: Union[str, "os.PathLike[str]"], *, what: str = "validation data") -> dict[str, np.ndarray]:
    """Arrays keyed by input name, batch first; never unpickles."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except FileNotFoundError:
        raise InputDataError(f"{what} '{path}' does not exist") from None
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise InputDataError(f"{what} '{path}' is not a readable .npz file: {exc}") from None
    if not arrays:
        raise InputDataError(f"{what} '{path}' holds no arrays")
    sizes = {name: (a.shape[0] if a.ndim else None) for name, a in arrays.items()}
    if None in sizes.values() or len(set(sizes.values())) != 1:
        raise InputDataError(f"{what} '{path}': arrays must share their first (batch) dimension, got {sizes}")
    return arrays
