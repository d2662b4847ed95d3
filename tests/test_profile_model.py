"""Model profiler: user-built layer lists, attention timing, scaling to full depth, memory."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflop_ds.profile import ContractEncoderInputs, ContractLLMInputs, ModelProfile, profile_model
from dflop_ds.profile.attention import AttentionOff
from dflop_ds.profile.layers import describe_selection, parameter_bytes, select_layers
from dflop_ds.profile.timing import robust_statistic, saved_activation_bytes
from dflop_ds.shapes import split_evenly

FAST = dict(warmup=0, repeats=1, progress=False)
DIM = 16


# -- a user's own layers, following the tuple contract ------------------------------------
class ToyPatches(nn.Module):
    """pixels [T, 3, 8, 8] -> [T, 4, DIM] (2x2 patches of 4x4 pixels)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * 16, DIM)

    def forward(self, inputs):
        pixels, ids, lens, tiles = inputs
        t = pixels.shape[0]
        patches = pixels.reshape(t, 3, 2, 4, 2, 4).permute(0, 2, 4, 1, 3, 5).reshape(t, 4, 48)
        return self.proj(patches), ids, lens, tiles


class ToyVisionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)

    def forward(self, inputs):
        vis, ids, lens, tiles = inputs
        q, k, v = self.qkv(vis).chunk(3, dim=-1)
        return vis + F.scaled_dot_product_attention(q, k, v), ids, lens, tiles


class ToyDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.mlp = nn.Linear(DIM, DIM)

    def forward(self, inputs):
        hidden, lens = inputs
        q, k, v = self.qkv(hidden).chunk(3, dim=-1)
        hidden = hidden + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return hidden + self.mlp(hidden), lens


class HandWrittenAttention(nn.Module):
    """A decoder layer whose attention is not scaled_dot_product_attention."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, inputs):
        hidden, lens = inputs
        scores = hidden @ hidden.transpose(-1, -2) / DIM**0.5
        return hidden + self.proj(scores.softmax(-1) @ hidden), lens


class ToyHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(DIM, 10)

    def forward(self, inputs):
        return self.out(inputs[0])


def toy_model(vision_blocks: int = 3, decoder_blocks: int = 5):
    torch.manual_seed(0)
    encoder = [ToyPatches()] + [ToyVisionBlock() for _ in range(vision_blocks)]
    llm = [ToyDecoder() for _ in range(decoder_blocks)] + [ToyHead()]
    return encoder, llm


def run_toy(encoder=None, llm=None, **overrides) -> ModelProfile:
    if encoder is None or llm is None:
        encoder, llm = toy_model()
    options = dict(
        encoder_inputs=ContractEncoderInputs(image_size=8, vocab_size=10),
        llm_inputs=ContractLLMInputs(hidden_size=DIM),
        tiles=(1, 8),
        seq_lens=(8, 64),
        batch_sizes=(1, 2),
        **FAST,
    )
    options.update(overrides)
    return profile_model(encoder, llm, **options)


# -- tests ----------------------------------------------------------------------------------
def test_profile_of_user_layers_covers_every_shape_and_scales_to_full_depth() -> None:
    profile = run_toy()
    assert [m.tiles for m in profile.encoder] == [1, 8]
    assert [(m.batch, m.seq_len) for m in profile.llm] == [(1, 8), (1, 64), (2, 8), (2, 64)]
    assert profile.encoder_layers == 4 and profile.llm_layers == 6
    assert all(m.time_s > 0 for m in profile.encoder + profile.llm)
    # 2 of 3 vision blocks and 2 of 5 decoder blocks profiled, and the output says so
    assert "2 of 3 ToyVisionBlock x1.5" in profile.meta["scaling"][0]
    assert "2 of 5 ToyDecoder x2.5" in profile.meta["scaling"][1]
    assert profile.meta["threads"] == 1
    # every decoder calls scaled_dot_product_attention: attention was timed
    assert all(m.attention_s is not None and m.attention_s >= 0 for m in profile.llm)
    # activations kept for backward grow with the input size
    acts = {(m.batch, m.seq_len): m.activation_bytes for m in profile.llm}
    assert acts[(1, 8)] < acts[(1, 64)] < acts[(2, 64)]
    assert profile.encoder[0].activation_bytes < profile.encoder[1].activation_bytes
    encoder, llm = toy_model()
    assert profile.param_bytes["llm"] == parameter_bytes(llm)
    assert profile.param_bytes["projector"] == 0
    assert profile.hidden_bytes_per_token == DIM * 4


def test_profile_round_trips_through_json() -> None:
    profile = run_toy(tiles=(2,), seq_lens=(8,), batch_sizes=(1,))
    again = ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again == profile


def test_layers_without_sdpa_get_no_attention_time_unless_a_context_is_given() -> None:
    encoder, _ = toy_model()
    llm = [HandWrittenAttention() for _ in range(3)]
    common = dict(
        encoder_inputs=ContractEncoderInputs(image_size=8, vocab_size=10),
        llm_inputs=ContractLLMInputs(hidden_size=DIM),
        tiles=(1,),
        seq_lens=(16,),
        batch_sizes=(1,),
        **FAST,
    )
    plain = profile_model(encoder, llm, **common)
    assert plain.llm[0].attention_s is None
    custom = profile_model(encoder, llm, attention_off=torch.no_grad, **common)
    assert custom.llm[0].attention_s is not None


def test_custom_input_factory_profiles_a_layer_with_another_layout() -> None:
    class Mixer(nn.Module):  # takes (features [B, S, 8],) only
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, inputs):
            return (self.lin(inputs[0]),)

    calls = []

    def features(batch: int, seq_len: int):
        calls.append((batch, seq_len))
        return (torch.randn(batch, seq_len, 8),)

    encoder, _ = toy_model()
    profile = profile_model(
        encoder,
        [Mixer(), Mixer()],
        encoder_inputs=ContractEncoderInputs(image_size=8, vocab_size=10),
        llm_inputs=features,
        tiles=(1,),
        llm_shapes=[(3, 5)],
        **FAST,
    )
    assert (3, 5) in calls
    assert profile.llm[0].batch == 3 and profile.llm[0].seq_len == 5
    assert profile.llm[0].attention_s is None and profile.llm[0].time_s > 0
    assert profile.hidden_bytes_per_token == 8 * 4


def test_output_loss_is_applied_to_the_last_llm_layer_only() -> None:
    seen = []

    def loss(logits):
        seen.append(tuple(logits.shape))
        return logits.sum()

    run_toy(tiles=(1,), seq_lens=(8,), batch_sizes=(2,), output_loss=loss)
    assert seen and set(seen) == {(2, 8, 10)}


def test_layers_are_timed_as_one_chain_or_each_on_its_own_and_the_segment_at_full_depth() -> None:
    passes: dict[tuple[str, bool], list[int]] = {}
    for protocol in ("chain", "layer"):
        for calibrate in (False, True):
            encoder, llm = toy_model(vision_blocks=1, decoder_blocks=1)
            log: list[int] = []
            for index, layer in enumerate(encoder + llm):
                layer.register_forward_pre_hook(lambda *_, i=index, seen=log: seen.append(i))
            profile = run_toy(
                encoder=encoder,
                llm=llm,
                tiles=(1, 8),
                seq_lens=(8,),
                batch_sizes=(1,),
                warmup=1,
                repeats=2,
                protocol=protocol,
                calibrate=calibrate,
            )
            assert profile.meta["protocol"] == protocol
            passes[protocol, calibrate] = log
    # the last round of the LLM: the decoder, with attention and without, then the head ...
    assert passes["layer", False][-3:] == [2, 2, 3]
    # ... or the chain decoder -> head with attention, then the chain without it
    assert passes["chain", False][-4:] == [2, 3, 2, 3]
    # calibration then runs each segment at full depth: 3 rounds (1 warm-up + 2) per size, at sizes
    # whose full depth holds no more activations than profiling did: under "layer" that was one
    # layer's, too little for the LLM's decoder and head at once
    extra = {protocol: passes[protocol, True][len(passes[protocol, False]) :] for protocol in ("chain", "layer")}
    assert [i for i in extra["chain"] if i >= 2] == [2, 3] * 3
    assert [i for i in extra["layer"] if i >= 2] == []
    with pytest.raises(ValueError, match="protocol"):
        run_toy(protocol="warm")


def test_threads_are_restored_after_profiling() -> None:
    before = torch.get_num_threads()
    run_toy(tiles=(1,), seq_lens=(8,), batch_sizes=(1,), threads=1)
    assert torch.get_num_threads() == before


def test_select_layers_weights_sum_to_the_depth() -> None:
    encoder, llm = toy_model(vision_blocks=7, decoder_blocks=4)
    picked = select_layers(encoder, max_blocks=3)
    assert [p.index for p in picked] == [0, 1, 2, 3]
    assert sum(p.weight for p in picked) == pytest.approx(len(encoder))
    assert sum(p.weight for p in select_layers(llm, 10)) == pytest.approx(len(llm))
    assert "3 of 7 ToyVisionBlock" in describe_selection("encoder", picked, len(encoder))
    with pytest.raises(ValueError, match="empty"):
        select_layers([], 2)


def test_attention_off_returns_the_values() -> None:
    q, k, v = (torch.randn(2, 5, 4) for _ in range(3))
    mode = AttentionOff()
    with mode:
        out = F.scaled_dot_product_attention(q, k, v)
    assert mode.calls == 1
    assert torch.equal(out, v)
    assert not torch.equal(F.scaled_dot_product_attention(q, k, v), v)


def test_saved_activation_bytes_counts_inputs_saved_for_backward() -> None:
    layer = nn.Linear(32, 32, bias=False)
    x = torch.randn(10, 32, requires_grad=True)
    with saved_activation_bytes(list(layer.parameters())) as saved:
        layer(x).sum()
    assert saved[0] == x.numel() * 4


def test_robust_statistic_and_even_split() -> None:
    assert robust_statistic([5, 1, 3, 100, 2], "median") == 3
    assert robust_statistic([5, 1, 3, 100, 2], "min") == 1
    assert robust_statistic([1, 2, 3, 4, 100], "trimmed_mean") == 3
    with pytest.raises(ValueError, match="unknown statistic"):
        robust_statistic([1.0], "mean")
    assert split_evenly(7, 3) == [3, 2, 2]


def test_bundled_tiny_model_profiles_with_its_loss() -> None:
    pytest.importorskip("dflop_ds.models")
    from dflop_ds.models.tiny_profile import tiny_target

    target = tiny_target()
    profile = profile_model(**target.profile_kwargs(), tiles=(1, 2), seq_lens=(16,), batch_sizes=(1,), **FAST)
    assert profile.meta["output_loss"] and profile.meta["projector_in_encoder"]
    assert profile.encoder[1].time_s > 0 and profile.llm[0].attention_s is not None


def test_layer_shares_are_measured_per_layer() -> None:
    pytest.importorskip("dflop_ds.models")
    from dflop_ds.models.tiny_profile import tiny_target

    target = tiny_target()
    profile = profile_model(
        **target.profile_kwargs(),
        tiles=(4, 16),
        seq_lens=(128,),
        batch_sizes=(2,),
        max_blocks=2,
        warmup=1,
        repeats=3,
        progress=False,
    )
    encoder, llm = profile.layer_shares["encoder"], profile.layer_shares["llm"]
    # patch embedding, 4 vision blocks, projector | 4 decoder blocks, LM head
    assert len(encoder) == 6 and len(llm) == 5
    assert sum(encoder) == pytest.approx(1.0) and sum(llm) == pytest.approx(1.0)
    # blocks 3 and 4 were not profiled: they take their profiled siblings' mean
    assert encoder[3] == encoder[4] and llm[2] == llm[3]
    # the small layers cost less than a block: equal shares per layer would be wrong
    assert encoder[0] < encoder[1] and encoder[5] < encoder[1] and llm[4] < llm[0]
    again = ModelProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again.layer_shares == profile.layer_shares
    older = profile.to_dict()
    del older["layer_shares"]
    assert ModelProfile.from_dict(older).layer_shares is None


def test_a_profile_without_projector_gives_it_no_time() -> None:
    profile = run_toy(tiles=(2,), seq_lens=(8,), batch_sizes=(1,))
    assert len(profile.layer_shares["encoder"]) == profile.encoder_layers + 1
    assert profile.layer_shares["encoder"][-1] == 0.0


def test_model_cli_writes_a_loadable_cost_model(tmp_path, capsys) -> None:
    pytest.importorskip("dflop_ds.models")
    from dflop_ds.commands.main import main as cli_main
    from dflop_ds.cost import load_cost_model

    out = tmp_path / "cm.json"
    code = cli_main(
        [
            "profile",
            "model",
            "--vision-layers",
            "3",
            "--llm-layers",
            "2",
            "--tiles",
            "1,2",
            "--seq-lens",
            "16,32",
            "--batch-sizes",
            "1",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--no-progress",
            "-o",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "2 of 3 VisionBlock" in printed and "wrote" in printed
    model = load_cost_model(out)
    assert model.encoder_layers == 4 and model.llm_layers == 3
    assert model.predict_microbatch([]).shape == (2,)
    from dflop_ds.shapes import TINY_POLICY

    assert model.shape_policy == TINY_POLICY.describe()  # the tiny model's policy, stored for check_policy


def test_cli_target_spec_loads_a_user_factory() -> None:
    pytest.importorskip("dflop_ds.models")
    from dflop_ds.commands.arg_types import positive_int_list
    from dflop_ds.commands.profile import load_target
    from dflop_ds.profile import ProfileTarget

    assert isinstance(load_target("dflop_ds.models.tiny_profile:tiny_target"), ProfileTarget)
    with pytest.raises(ValueError, match="module:function"):
        load_target("no_colon_here")
    assert positive_int_list("1, 2,8") == [1, 2, 8]
