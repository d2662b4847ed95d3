"""MLLMPipelineModule: a DeepSpeed ``PipelineModule`` for encoder + projector + LLM with a planned split.

The flat layer list is ``encoder_layers + [projector] + llm_layers`` (any modules or
``LayerSpec``s following the tuple contract of ``docs/architecture.md``). What it adds to stock
``PipelineModule``:

* an explicit stage split (``stage_bounds``, or a cost-balanced split with the encoder and
  projector on the first ``encoder_stages`` stages) instead of DeepSpeed's ``partition_method``;
* ``dynamic_shape=True`` always, since balanced microbatches differ in shape;
* stage outputs that are safe to send: a floating-point output without grad history (what a
  frozen encoder produces) is marked ``requires_grad`` so the engine's backward over it works;
* ``freeze_encoder`` and the token-normalized loss by default;
* python-int layer seeds when ``seed_layers`` is on (DeepSpeed's balanced partitions give numpy
  ints, which ``random.seed`` rejects on Python 3.11).

* tied weights declared by built layers: a layer with a ``tied_weights`` dict (key -> dotted
  parameter path, e.g. an embedding and an LM head sharing their matrix) has that weight kept
  equal across the stages holding it, with DeepSpeed's own tied-weight machinery (broadcast at
  start, gradients all-reduced among those stages every step), as ``TiedLayerSpec`` does for specs.

A float tensor sent to the next stage must also be *used* there (the engine asserts that every
received float tensor gets a gradient), so layers must drop float tensors they no longer need;
the bundled projector, for one, consumes the visual features and sends only ``hidden``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from deepspeed import comm as dist
from deepspeed.pipe import PipelineModule
from deepspeed.runtime import utils as ds_utils
from deepspeed.utils import logger

from dflop_ds.pipe.loss import token_normalized_loss
from dflop_ds.pipe.stage_bounds import StageBounds, plan_stage_bounds


def mark_boundary_outputs(outputs: Any) -> Any:
    """Make every floating-point tensor of ``outputs`` differentiable for the pipeline engine.

    A float tensor without grad history (e.g. from a frozen encoder) is turned into a leaf that
    requires grad, so the engine's ``tensor.backward(grad)`` on it is a no-op instead of an
    error. Only acts when grad mode is on; returns ``outputs`` (tensor or tuple) unchanged in form.
    """
    if not torch.is_grad_enabled():
        return outputs
    tensors = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    for t in tensors:
        if torch.is_tensor(t) and t.is_floating_point() and not t.requires_grad:
            t.requires_grad_()
    return outputs


#: Name of the zero parameter a stage of frozen layers alone trains (see ``optimizer_parameters``).
ANCHOR = "frozen_stage_anchor"


def through_anchor(outputs: Any, anchor: torch.Tensor) -> Any:
    """``outputs`` (tensor or tuple) with ``anchor * 0`` added to its first floating-point tensor:
    the same values, with ``anchor`` in the graph so that backward gives it a (zero) gradient."""
    tensors = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    for i, t in enumerate(tensors):
        if torch.is_tensor(t) and t.is_floating_point():
            tensors[i] = t + (anchor * 0).sum().to(t.dtype)
            break
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(tensors)
    return tensors[0]


def _drop_anchor(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook: the anchor is no weight of the model."""
    state_dict.pop(prefix + ANCHOR, None)


def contiguous_outputs(outputs: Any) -> Any:
    """``outputs`` (tensor or tuple) with every tensor made contiguous: p2p sends refuse strided
    tensors, and HF layers return them (e.g. a vision tower's transposed patch embeddings)."""
    if torch.is_tensor(outputs):
        return outputs.contiguous()
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(t.contiguous() if torch.is_tensor(t) else t for t in outputs)
    return outputs


def unused_float_inputs(inputs: Any, outputs: Any) -> list[int]:
    """Positions of ``inputs``' grad-requiring float tensors that no float output depends on.

    The pipeline engine sends a gradient back for every float tensor a stage received and
    asserts it exists; a received float tensor the stage ignores breaks that (``assert
    buffer.grad is not None``). Walks the autograd graph of the outputs once.
    """
    ins = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    out_ids = {id(t) for t in outs}
    # a leaf shows up in the graph as the `variable` of its AccumulateGrad node, a non-leaf (the
    # engine hands a stage clones of the received buffers) as its own grad_fn node
    # python wrappers of graph nodes are kept alive in `seen`/`anchors` so that ids stay unique
    wanted: dict[int, int] = {}
    anchors: list[Any] = []
    for i, t in enumerate(ins):
        if torch.is_tensor(t) and t.is_floating_point() and t.requires_grad and id(t) not in out_ids:
            key = t if t.grad_fn is None else t.grad_fn
            anchors.append(key)
            wanted[id(key)] = i
    stack: list[torch.autograd.graph.Node | None] = [
        t.grad_fn for t in outs if torch.is_tensor(t) and t.grad_fn is not None
    ]
    seen: dict[int, Any] = {}
    while stack and wanted:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        wanted.pop(id(node), None)
        variable = getattr(node, "variable", None)
        if variable is not None:
            wanted.pop(id(variable), None)
        stack.extend(fn for fn, _ in node.next_functions)
    return sorted(wanted.values())


def int_seed(seed: int) -> None:
    """Seed python, numpy and torch from ``seed`` cast to a python int (a ``seed_fn`` for DeepSpeed)."""
    ds_utils.set_random_seed(int(seed))


def declared_ties(layers: Sequence[Any]) -> dict[str, list[tuple[int, str]]]:
    """``key -> [(layer index, dotted parameter path)]`` of the layers that declare ``tied_weights``."""
    ties: dict[str, list[tuple[int, str]]] = {}
    for index, layer in enumerate(layers):
        for key, path in (getattr(layer, "tied_weights", None) or {}).items():
            ties.setdefault(key, []).append((index, path))
    return ties


def owner_of(module: torch.nn.Module, path: str) -> tuple[torch.nn.Module, str]:
    """The submodule holding the parameter at dotted ``path`` and the parameter's own name."""
    *parents, name = path.split(".")
    for part in parents:
        module = getattr(module, part)
    return module, name


def layer_name(layer: Any) -> str:
    """Readable name of a layer, a ``LayerSpec`` or a function."""
    typename = getattr(layer, "typename", None)
    if typename is not None:
        return typename.__name__
    if isinstance(layer, torch.nn.Module):
        return layer.__class__.__name__
    return getattr(layer, "__name__", repr(layer))


@dataclass(frozen=True)
class SplitRequest:
    """How the caller asked :class:`MLLMPipelineModule` to split its layers (resolved once the
    stage count is known): ``n_encoder`` layers of encoder + projector, and the optional
    ``encoder_stages``, explicit ``stage_bounds`` or per-layer ``layer_costs``."""

    n_encoder: int
    encoder_stages: int | None
    stage_bounds: list[int] | None
    layer_costs: list[float] | None


class MLLMPipelineModule(PipelineModule):
    """A pipeline of ``encoder_layers + [projector] + llm_layers`` with an explicit stage split.

    Args:
        encoder_layers: vision-encoder layers (modules or ``LayerSpec``), first one taking pixels.
        projector: the layer merging visual features and text into ``(hidden, seq_lens)``.
        llm_layers: decoder layers, the last one returning logits.
        num_stages: pipeline stages (or give ``topology``).
        encoder_stages: stages holding exactly the encoder + projector (the first ones).
        stage_bounds: ``num_stages + 1`` layer boundaries of the flat list; wins over costs.
        layer_costs: per-layer costs for the balanced split when ``stage_bounds`` is not given
            (default: one per layer).
        loss_fn: defaults to :func:`~dflop_ds.pipe.loss.token_normalized_loss`.
        freeze_encoder: freeze the encoder layers' parameters (the projector stays trainable).
        activation_checkpoint_interval, seed_layers, seed_fn, base_seed, topology and further
            keyword arguments go to ``PipelineModule``.
    """

    def __init__(
        self,
        encoder_layers: Sequence[Any],
        projector: Any,
        llm_layers: Sequence[Any],
        num_stages: int | None = None,
        *,
        encoder_stages: int | None = None,
        stage_bounds: Sequence[int] | None = None,
        layer_costs: Sequence[float] | None = None,
        loss_fn: Callable | None = token_normalized_loss,
        freeze_encoder: bool = False,
        activation_checkpoint_interval: int = 0,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        topology: Any = None,
        **kwargs: Any,
    ) -> None:
        layers = [*encoder_layers, projector, *llm_layers]
        if not encoder_layers or not llm_layers:
            raise ValueError("MLLMPipelineModule needs at least one encoder layer and one LLM layer")
        if layer_costs is not None and len(layer_costs) != len(layers):
            raise ValueError(f"layer_costs has {len(layer_costs)} entries for {len(layers)} layers")
        if "dynamic_shape" in kwargs or "partition_method" in kwargs:
            raise TypeError("MLLMPipelineModule sets dynamic_shape and the partitioning itself")
        # read by _partition_layers, which PipelineModule.__init__ calls
        self._dflop_split = SplitRequest(
            n_encoder=len(encoder_layers) + 1,
            encoder_stages=encoder_stages,
            stage_bounds=None if stage_bounds is None else list(stage_bounds),
            layer_costs=None if layer_costs is None else [float(c) for c in layer_costs],
        )
        if seed_layers and seed_fn is None:
            seed_fn = int_seed
        super().__init__(
            layers,
            num_stages=num_stages,
            topology=topology,
            loss_fn=loss_fn,
            seed_layers=seed_layers,
            seed_fn=seed_fn,
            activation_checkpoint_interval=activation_checkpoint_interval,
            dynamic_shape=True,
            **kwargs,
        )
        self.n_encoder_layers = len(encoder_layers)
        self.projector_index = len(encoder_layers)
        self.freeze_encoder = freeze_encoder
        self._inputs_checked = False  # set after the first training forward has been checked
        if freeze_encoder:
            for name, module in self.named_children():
                if name.isdigit() and int(name) < self.n_encoder_layers:
                    module.requires_grad_(False)
        self._index_declared_ties()

    def _index_declared_ties(self) -> None:
        """Add the ``tied_weights`` of built layers to DeepSpeed's ``tied_comms`` and make the
        copies equal (every rank must run this: it creates process groups)."""
        ties = declared_ties(self._layer_specs)
        if not ties or self._topo.get_dim("pipe") == 1:
            return  # one stage: the layers share the very same parameter
        local = range(self._local_start, self._local_stop)
        for key in sorted(ties):
            if key in self.tied_comms:
                raise ValueError(f"tied weight key {key!r} is used by a TiedLayerSpec and a layer's tied_weights")
            stages = sorted({self.stage_owner(index) for index, _ in ties[key]})
            owners = [owner_of(self._layer_specs[index], path) for index, path in ties[key] if index in local]
            weights = {id(getattr(module, name)) for module, name in owners}
            if len(weights) > 1:
                raise ValueError(f"layers tied under {key!r} hold different parameters on stage {self.stage_id}")
            for dp in range(self._grid.data_parallel_size):
                ranks = [self._grid.stage_to_global(stage_id=s, data=dp) for s in stages]
                group = dist.new_group(ranks=ranks)
                if self.global_rank in ranks:
                    module, name = owners[0]
                    self.tied_comms[key] = {"ranks": ranks, "group": group, "weight_attr": [name], "module": module}
                    if self.global_rank != ranks[0]:  # counted once, as DeepSpeed does for TiedLayerSpec
                        getattr(module, name).ds_pipe_replicated = True
        self._synchronize_tied_weights()

    def get_tied_weights_and_groups(self) -> list[tuple[torch.Tensor, Any]]:
        """``(weight, group)`` of every tied weight this stage holds (TiedLayerSpec and declared ties)."""
        return [
            (self._recursive_getattr(comm["module"], attr), comm["group"])
            for comm in self.tied_comms.values()
            for attr in comm["weight_attr"]
        ]

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum the tied weights' gradients over the stages holding them."""
        for weight, group in self.get_tied_weights_and_groups():
            if weight.grad is not None:
                dist.all_reduce(weight.grad, group=group)

    def resolve_bounds(self) -> StageBounds:
        """The stage boundaries of this module's split (python ints)."""
        split = self._dflop_split
        return plan_stage_bounds(
            len(self._layer_specs),
            split.n_encoder,
            self.num_stages,
            encoder_stages=split.encoder_stages,
            stage_bounds=split.stage_bounds,
            layer_costs=split.layer_costs,
        )

    def _partition_layers(self, method: str = "uniform") -> None:
        """Impose the planned split (DeepSpeed's ``partition_method`` is not used)."""
        self.parts = self.resolve_bounds().to_list()
        if self.global_rank == 0:
            for stage, (start, stop) in enumerate(zip(self.parts, self.parts[1:])):
                names = ", ".join(layer_name(layer) for layer in self._layer_specs[start:stop])
                logger.info(f"MLLMPipelineModule stage={stage} layers {start}..{stop - 1}: {names}")
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    def optimizer_parameters(self) -> list[torch.nn.Parameter]:
        """This stage's trainable parameters, for building its optimizer.

        A stage holding only frozen layers (e.g. a frozen encoder alone on stage 0) has none,
        yet DeepSpeed's pipeline engine needs an optimizer on every stage (torch optimizers
        reject an empty list) and its gradient clipping fails on a stage without gradients
        (DeepSpeed 0.19.8 indexes the first one). Such a stage gets :data:`ANCHOR`, a one-element
        zero parameter of the module that :meth:`forward` adds, times zero, to its output: it
        receives a zero gradient every step and never changes, and the outputs keep their
        values. It is left out of :meth:`state_dict` (the layers' checkpoints never see it).
        """
        trainable = [p for p in self.parameters() if p.requires_grad]
        if trainable:
            return trainable
        device = next(iter(self.parameters()), torch.zeros(())).device
        self.register_parameter(ANCHOR, torch.nn.Parameter(torch.zeros(1, device=device)))
        self.register_state_dict_post_hook(_drop_anchor)
        return [getattr(self, ANCHOR)]

    @property
    def is_last_stage(self) -> bool:
        """True on the stage that computes the loss."""
        return self.stage_id == self.num_stages - 1

    def forward(self, forward_input: Any) -> Any:
        """Run this stage's layers; outputs sent to the next stage are made differentiable.

        On the first training forward of a stage that receives activations, also checks that
        every received float tensor is used (a clear error instead of the engine's assert).
        """
        outputs = super().forward(forward_input)
        if self.stage_id > 0 and torch.is_grad_enabled() and not self._inputs_checked:
            unused = unused_float_inputs(forward_input, outputs)
            if unused:
                start, stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
                raise ValueError(
                    f"stage {self.stage_id} (layers {start}..{stop - 1}) ignores the float input tensor(s) at "
                    f"position(s) {unused} sent by the previous stage; the previous stage's last layer must "
                    "drop float tensors that later layers do not use"
                )
            self._inputs_checked = True
        anchor = self._parameters.get(ANCHOR)
        if anchor is not None and torch.is_grad_enabled():
            outputs = through_anchor(outputs, anchor)
        if not self.is_last_stage:
            outputs = mark_boundary_outputs(contiguous_outputs(outputs))
        return outputs


class FeatureReceiver(torch.nn.Module):
    """First layer of a pipeline whose encoder runs outside it (the colocated encoder).

    The first stage receives the encoder features as data-loader inputs, which DeepSpeed hands
    it as detached clones. With :meth:`start_step` ``keep_gradients=True`` this layer turns
    ``requires_grad`` on for ``inputs[0]`` (the features) and keeps their gradient with a tensor
    hook, one per microbatch in forward order; :meth:`take_gradients` hands them over after
    ``train_batch``, so the encoder's backward can run outside the engine. It has no parameters
    and passes ``inputs`` through unchanged otherwise. Not for use with activation
    checkpointing (a recomputed forward would register a second hook).
    """

    def __init__(self) -> None:
        super().__init__()
        self.keep_gradients = False
        self._forwards = 0
        self._gradients: dict[int, torch.Tensor] = {}

    def start_step(self, keep_gradients: bool) -> None:
        """Forget the previous step's gradients; keep this step's when ``keep_gradients``."""
        self.keep_gradients = keep_gradients
        self._forwards = 0
        self._gradients = {}

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Mark the features differentiable and hook their gradient (training forwards only)."""
        if not (self.keep_gradients and torch.is_grad_enabled()):
            return inputs
        features, *rest = inputs
        if not features.requires_grad:
            features.requires_grad_()
        microbatch = self._forwards
        self._forwards += 1

        def keep(grad: torch.Tensor) -> None:
            self._gradients[microbatch] = grad.detach()

        features.register_hook(keep)
        return (features, *rest)

    def take_gradients(self, features: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients of the step's microbatch ``features`` (as fed to ``train_batch``), zeros
        where a microbatch's features received none (e.g. no tiles); resets the store."""
        if self._forwards != len(features):
            raise RuntimeError(
                f"FeatureReceiver saw {self._forwards} training forwards this step, expected "
                f"{len(features)} (one per microbatch)"
            )
        grads = [self._gradients.get(microbatch, torch.zeros_like(sent)) for microbatch, sent in enumerate(features)]
        self.start_step(self.keep_gradients)
        return grads
