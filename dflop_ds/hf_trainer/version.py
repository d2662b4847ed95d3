"""The transformers versions the Trainer integration was tested with.

The mixin overrides ``Trainer._get_train_sampler`` and ``get_train_dataloader`` and calls the
Trainer's column-removal helpers; those are internals that change between releases, so another
version is refused before training rather than risking a silent change of the data order.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

#: tested: transformers 5.24; the range's upper end is the next minor release
SUPPORTED = (Version("5.24"), Version("5.25"))


def check_transformers_version(installed: str | None = None) -> str:
    """The installed transformers version; ``RuntimeError`` naming it and the supported range when
    it is missing or outside :data:`SUPPORTED`."""
    low, high = SUPPORTED
    if installed is None:
        try:
            installed = version("transformers")
        except PackageNotFoundError:
            raise RuntimeError(
                f"DFLOPTrainer needs transformers >={low},<{high}: pip install 'transformers>={low},<{high}'"
            ) from None
    if not low <= Version(installed) < high:
        raise RuntimeError(
            f"DFLOPTrainer supports transformers >={low},<{high} (its sampler and data loader hooks were tested"
            f" there); transformers {installed} is installed: pip install 'transformers>={low},<{high}'"
        )
    return installed


__all__ = ["SUPPORTED", "check_transformers_version"]
