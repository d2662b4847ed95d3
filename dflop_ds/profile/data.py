"""Data profiler: the distribution of encoder inputs and LLM sequence lengths of a dataset.

A :class:`DataProfile` keeps a seeded sample of the dataset's shapes (enough to rebuild them
under the same policy), summary statistics and histograms. The planner draws global batches
from it with :meth:`DataProfile.sample_shapes`.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from os import PathLike
from typing import Any, Union

import numpy as np

from dflop_ds.data import read_dataset
from dflop_ds.data.media import default_media_folders
from dflop_ds.jsonio import read_json_object, write_json
from dflop_ds.shapes import TINY_POLICY, SampleShape, ShapePolicy

PathArg = Union[str, "PathLike[str]"]
FORMAT = "dflop-ds-dataprofile"
FORMAT_VERSION = 1
POLICY_FIELDS = ("tile_size", "max_tiles", "add_thumbnail", "tokens_per_tile", "max_frames", "tokens_per_frame")


def policy_to_dict(policy: ShapePolicy) -> dict[str, Any]:
    """The numeric fields of ``policy`` (its tokenizer is not serializable and not needed)."""
    return {name: getattr(policy, name) for name in POLICY_FIELDS}


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Mean, standard deviation, min, percentiles (p50, p90, p99) and max of ``values``."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return {k: 0.0 for k in ("mean", "std", "min", "p50", "p90", "p99", "max")}
    p50, p90, p99 = np.percentile(data, [50, 90, 99])
    return {
        "mean": float(data.mean()),
        "std": float(data.std()),
        "min": float(data.min()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(data.max()),
    }


def histogram(values: Sequence[float], bins: int = 20) -> dict[str, list[float]]:
    """``{"edges": [...], "counts": [...]}`` with ``bins`` equal-width bins over the data range."""
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        return {"edges": [0.0, 1.0], "counts": [0]}
    low, high = float(data.min()), float(data.max())
    counts, edges = np.histogram(data, bins=bins, range=(low, high if high > low else low + 1.0))
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}


@dataclass
class DataProfile:
    """A seeded sample of a dataset's shapes with their statistics.

    Attributes:
        source: the file profiled.
        n_total: samples in the whole dataset.
        seed: the sampling seed.
        policy: the shape policy's numeric fields.
        shapes: the sampled shapes.
        stats: summary statistics of ``encoder_tiles``, ``llm_tokens``, ``text_tokens``.
        histograms: histograms of the same fields.
        modalities: sample count per modality.
    """

    source: str
    n_total: int
    seed: int
    policy: dict[str, Any]
    shapes: list[SampleShape]
    stats: dict[str, dict[str, float]] = field(default_factory=dict)
    histograms: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    modalities: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_shapes(
        cls, shapes: Sequence[SampleShape], *, source: str, policy: ShapePolicy, n_total: int, seed: int, bins: int = 20
    ) -> DataProfile:
        """Compute statistics and histograms of ``shapes`` (already sampled)."""
        columns = {
            "encoder_tiles": [s.encoder_tiles for s in shapes],
            "llm_tokens": [s.llm_tokens for s in shapes],
            "text_tokens": [s.text_tokens for s in shapes],
        }
        return cls(
            source=source,
            n_total=n_total,
            seed=seed,
            policy=policy_to_dict(policy),
            shapes=list(shapes),
            stats={name: summarize(values) for name, values in columns.items()},
            histograms={name: histogram(values, bins) for name, values in columns.items()},
            modalities=dict(Counter(s.modality for s in shapes)),
        )

    def sample_shapes(self, n: int, seed: int = 0) -> list[SampleShape]:
        """``n`` shapes drawn with replacement from the profiled sample (seeded)."""
        if not self.shapes:
            raise ValueError(f"data profile of {self.source} holds no shapes to sample from")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = random.Random(seed)
        return [self.shapes[rng.randrange(len(self.shapes))] for _ in range(n)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with a format header."""
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "source": self.source,
            "n_total": self.n_total,
            "seed": self.seed,
            "policy": self.policy,
            "stats": self.stats,
            "histograms": self.histograms,
            "modalities": self.modalities,
            "shapes": [_shape_to_dict(s) for s in self.shapes],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "data profile") -> DataProfile:
        """Inverse of :meth:`to_dict`; refuses another format or version, naming ``source``."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{source} is not a dflop-ds data profile (missing format {FORMAT!r})")
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{source} has data-profile format_version {data.get('format_version')!r}, but this dflop-ds "
                f"reads version {FORMAT_VERSION}: re-run `dflop-ds profile data` to rebuild it"
            )
        try:
            return cls(
                source=str(data["source"]),
                n_total=int(data["n_total"]),
                seed=int(data["seed"]),
                policy=dict(data["policy"]),
                shapes=[_shape_from_dict(item, i, source) for i, item in enumerate(data["shapes"])],
                stats=data["stats"],
                histograms=data["histograms"],
                modalities=data["modalities"],
            )
        except KeyError as exc:
            raise ValueError(f"{source}: malformed data profile, missing key {exc}") from exc

    def save(self, path: PathArg) -> None:
        """Write the profile as JSON."""
        write_json(path, self.to_dict(), indent=None)

    @classmethod
    def load(cls, path: PathArg) -> DataProfile:
        """Read a profile written by :meth:`save`; errors name the file."""
        return cls.from_dict(read_json_object(path), source=str(path))


def _shape_to_dict(shape: SampleShape) -> dict[str, Any]:
    data = asdict(shape)
    data["image_sizes"] = [list(size) for size in shape.image_sizes]
    return data


def _shape_from_dict(item: dict[str, Any], index: int, source: str) -> SampleShape:
    try:
        fields = dict(item)
        fields["image_sizes"] = tuple(tuple(int(v) for v in size) for size in fields.get("image_sizes", ()))
        return SampleShape(**fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: shape #{index} ({item.get('sample_id')!r}) is malformed: {exc}") from exc


def sample_indices(n_total: int, n: int | None, seed: int) -> list[int]:
    """``n`` distinct indices of ``range(n_total)`` in sorted order (all when ``n`` is None or large)."""
    if n is None or n >= n_total:
        return list(range(n_total))
    if n < 1:
        raise ValueError(f"the sample size must be >= 1, got {n}")
    return sorted(random.Random(seed).sample(range(n_total), n))


def profile_data(
    path: PathArg,
    policy: ShapePolicy | None = None,
    *,
    samples: int | None = 2000,
    seed: int = 0,
    bins: int = 20,
    **read_options: Any,
) -> DataProfile:
    """Read ``path`` with :func:`dflop_ds.data.read_dataset` and profile ``samples`` of its shapes.

    ``policy`` defaults to :data:`dflop_ds.shapes.TINY_POLICY` (the bundled tiny model).

    ``read_options`` go to the reader (e.g. ``image_sizes=``, ``on_bad_sample="skip"``); the image
    and video folders default to the data file's folder, as in training
    (:func:`~dflop_ds.data.media.default_media_folders`).
    """
    policy = policy or TINY_POLICY
    shapes = read_dataset(path, policy, **default_media_folders(path, read_options))
    if not shapes:
        raise ValueError(f"{path}: no samples to profile")
    chosen = [shapes[i] for i in sample_indices(len(shapes), samples, seed)]
    return DataProfile.from_shapes(chosen, source=str(path), policy=policy, n_total=len(shapes), seed=seed, bins=bins)
