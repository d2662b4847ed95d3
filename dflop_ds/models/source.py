"""Model sources: what the training loop needs of a model family, in one value.

A :class:`ModelSource` bundles the layer lists (following the tuple contract of
``docs/architecture.md``), the shape policy that turns records into sample shapes, the dataset
and collate that turn sample indices into tensors, and how to count a sample's supervised
tokens as the loss will. The bundled tiny model is one source; HuggingFace models are others
(:mod:`dflop_ds.models.hf`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dflop_ds.data.formats import shape_reader
from dflop_ds.models.tiny import TinyMLLMConfig, tiny_mllm_layers
from dflop_ds.models.tiny_data import TinyMLLMDataset, collate_microbatch, collate_packed_microbatch, supervised_count
from dflop_ds.shapes import DEFAULT_POLICY, TINY_POLICY, SampleShape, ShapePolicy


@dataclass
class ModelSource:
    """Layers, data pipeline and token accounting of one model.

    Attributes:
        name: what the logs call it (``"tiny"`` or the model directory).
        encoder_layers, projector, llm_layers: the layer lists (modules or ``LayerSpec``s).
        policy: turns dataset records into :class:`SampleShape` s.
        read_shapes: ``read_shapes(data_path, on_bad_sample) -> ReadResult`` of the dataset
            (:func:`dflop_ds.data.read_dataset` with the source's policy and media options).
        make_dataset: ``make_dataset(shapes, data_path, on_bad_sample="error") -> Dataset`` indexed
            like the shapes; ``on_bad_sample`` says what a sample whose media fail to load does
            (see :class:`~dflop_ds.models.hf.base.template.MediaDataset`).
        collate: microbatch collate producing ``(inputs, labels)``, padded.
        packed_collate: the collate of packed microbatches (one row per microbatch), or None
            when the model cannot run them.
        label_tokens_fn: supervised tokens of a sample as the loss counts them.
        save_pretrained: optional ``save_pretrained(directory, state)`` writing the model in its
            native format with the trained flat ``state`` (``"<layer index>.<name>"``, gathered
            on the one rank that calls it).
        hf_model: the HuggingFace model whose modules the layers share, if any.
        tile_pixels: a dataset item's encoder tiles, one row per tile (what a colocated encoder
            dispatches, see :mod:`dflop_ds.train.colocated`); None when the model cannot
            dispatch its tiles.
        truncated_samples: how many records read so far were cut at ``max_length``
            (``dflop.data.truncation = "truncate"``; 0 for a model that never truncates).
    """

    name: str
    encoder_layers: list
    projector: Any
    llm_layers: list
    policy: ShapePolicy
    read_shapes: Callable[[str, str], Any]
    make_dataset: Callable[..., Any]
    collate: Callable
    label_tokens_fn: Callable[[SampleShape], int]
    save_pretrained: Callable[[str, dict], None] | None = None
    hf_model: Any = None
    meta: dict = field(default_factory=dict)
    packed_collate: Callable | None = None
    tile_pixels: Callable[[Any], Any] | None = None
    truncated_samples: Callable[[], int] = lambda: 0

    @property
    def n_layers(self) -> int:
        """Layers of the flat list: encoder + projector + LLM."""
        return len(self.encoder_layers) + 1 + len(self.llm_layers)

    def layers(self) -> tuple[list, Any, list]:
        """``(encoder_layers, projector, llm_layers)``."""
        return self.encoder_layers, self.projector, self.llm_layers

    def colocated_tile_pixels(self) -> Callable[[Any], Any]:
        """:attr:`tile_pixels`, or ``ValueError`` naming the model when it has none."""
        if self.tile_pixels is None:
            raise ValueError(
                f'dflop.model.encoder = "colocated": model {self.name!r} cannot dispatch its encoder tiles yet '
                "(the bundled tiny model and LLaVA can); use the local encoder"
            )
        return self.tile_pixels

    def uses_packing(self, setting: bool | None) -> bool:
        """Whether to pack microbatches for the ``dflop.model.packing`` ``setting`` (None: wherever
        the model can); ``ValueError`` for ``True`` on a model without a packed collate."""
        if setting and self.packed_collate is None:
            raise ValueError(
                f"dflop.model.packing = true: model {self.name!r} has no packed microbatches yet "
                "(the bundled tiny model and every registered HF family do); set it to false"
            )
        return self.packed_collate is not None if setting is None else bool(setting)


def tiny_source(
    model_overrides: dict,
    *,
    policy_name: str = "tiny",
    seed: int = 0,
    as_specs: bool = True,
    image_folder: str | None = None,
    video_folder: str | None = None,
) -> ModelSource:
    """The bundled tiny MLLM on synthetic tensors of the dataset's real shapes (a LLaVA file's media
    sizes from the records, or from the files' headers under ``image_folder`` / ``video_folder``,
    by default the data file's folder: :func:`~dflop_ds.data.media.media_folder`)."""
    config = TinyMLLMConfig(**model_overrides)
    policy = TINY_POLICY if policy_name == "tiny" else DEFAULT_POLICY
    encoder, projector, llm = tiny_mllm_layers(config, seed=seed, as_specs=as_specs)

    read_shapes = shape_reader(policy, image_folder, video_folder)

    def make_dataset(shapes: Sequence[SampleShape], data_path: str, on_bad_sample: str = "error"):
        # synthetic tensors of the shapes: no file is loaded, so no sample can fail at load time
        return TinyMLLMDataset(list(shapes), config, seed=seed)

    return ModelSource(
        "tiny",
        list(encoder),
        projector,
        list(llm),
        policy,
        read_shapes,
        make_dataset,
        collate_microbatch,
        supervised_count,
        packed_collate=collate_packed_microbatch,
        tile_pixels=lambda item: item.pixels,
    )
