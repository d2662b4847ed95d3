"""ShapePolicy arithmetic: AnyRes tile grids, thumbnails, frame caps, token sums, label bounds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflop_ds.shapes import TINY_POLICY, SampleShape, ShapePolicy, default_token_count

DEFAULT = ShapePolicy()  # 384 px tiles, up to 9, thumbnail on


@pytest.mark.parametrize(
    "policy, size, grid",
    [
        (DEFAULT, (384, 384), (1, 1)),  # exactly one tile
        (DEFAULT, (100, 60), (1, 1)),  # small image: every grid keeps it whole; least waste wins
        (DEFAULT, (768, 384), (2, 1)),  # exactly two tiles wide
        (DEFAULT, (2000, 2000), (3, 3)),  # large square: the biggest square grid
        (DEFAULT, (1920, 1080), (4, 2)),  # 16:9: 4x2 keeps 1365x768, more than 3x3's 1152x648
        (TINY_POLICY, (640, 480), (2, 2)),  # 2x2 (672 px) holds 640x480 at full resolution
        (TINY_POLICY, (10000, 100), (4, 1)),  # extreme panorama: one row of max_tiles
        (TINY_POLICY, (100, 10000), (1, 4)),  # extreme portrait: one column
        (DEFAULT, (100000, 1), (9, 1)),
    ],
)
def test_tile_grid_known_sizes(policy: ShapePolicy, size: tuple[int, int], grid: tuple[int, int]) -> None:
    assert policy.tile_grid(*size) == grid


def test_thumbnail_rule() -> None:
    # One-tile grids never get a thumbnail; bigger grids get exactly one when enabled.
    assert DEFAULT.image_tiles(384, 384) == 1
    assert DEFAULT.image_tiles(768, 384) == 2 + 1
    assert DEFAULT.image_tiles(2000, 2000) == 9 + 1
    no_thumb = ShapePolicy(add_thumbnail=False)
    assert no_thumb.image_tiles(2000, 2000) == 9
    assert no_thumb.image_tiles(384, 384) == 1


@pytest.mark.parametrize("bad", [(0, 10), (10, 0), (-5, 10)])
def test_tile_grid_rejects_non_positive_sizes(bad: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="positive"):
        DEFAULT.tile_grid(*bad)


def test_frame_cap() -> None:
    assert TINY_POLICY.sampled_frames(0) == 0
    assert TINY_POLICY.sampled_frames(5) == 5
    assert TINY_POLICY.sampled_frames(TINY_POLICY.max_frames) == TINY_POLICY.max_frames
    assert TINY_POLICY.sampled_frames(10_000) == TINY_POLICY.max_frames
    with pytest.raises(ValueError, match="video_frames"):
        TINY_POLICY.sampled_frames(-1)


def test_token_sums_of_a_mixed_sample() -> None:
    policy = TINY_POLICY
    sizes = [(640, 480), (300, 200)]
    shape = policy.shape("s1", image_sizes=sizes, video_frames=100, text_tokens=50, label_tokens=20)
    tiles = policy.image_tiles(640, 480) + policy.image_tiles(300, 200)
    assert tiles == 5 + 1
    assert shape.encoder_tiles == tiles + policy.max_frames
    assert shape.visual_tokens == tiles * policy.tokens_per_tile + policy.max_frames * policy.tokens_per_frame
    assert shape.llm_tokens == shape.visual_tokens + 50
    assert shape.image_sizes == ((640, 480), (300, 200))
    assert shape.modality == "video"


def test_modalities() -> None:
    assert DEFAULT.shape("t", text_tokens=3).modality == "text"
    assert DEFAULT.shape("i", image_sizes=[(5, 5)], text_tokens=3).modality == "image"
    assert DEFAULT.shape("m", image_sizes=[(5, 5), (6, 6)], text_tokens=3).modality == "multi_image"
    assert DEFAULT.shape("v", video_frames=3, text_tokens=3).modality == "video"


def test_label_tokens_bounds() -> None:
    assert DEFAULT.shape("a", text_tokens=10).label_tokens == 10  # default: all supervised
    assert DEFAULT.shape("a", text_tokens=10, label_tokens=0).label_tokens == 0
    assert DEFAULT.shape("a", text_tokens=10, label_tokens=10).label_tokens == 10
    with pytest.raises(ValueError, match="'a'.*label_tokens"):
        DEFAULT.shape("a", text_tokens=10, label_tokens=11)
    with pytest.raises(ValueError, match="label_tokens"):
        DEFAULT.shape("a", text_tokens=10, label_tokens=-1)
    with pytest.raises(ValueError, match="text_tokens"):
        DEFAULT.shape("a", text_tokens=-1)


def test_reshape_under_another_policy() -> None:
    shape = DEFAULT.shape("x", image_sizes=[(2000, 2000)], video_frames=64, text_tokens=7, label_tokens=3)
    tiny = TINY_POLICY.reshape(shape)
    assert (tiny.image_sizes, tiny.video_frames, tiny.text_tokens, tiny.label_tokens) == (shape.image_sizes, 64, 7, 3)
    assert tiny.encoder_tiles == 4 + 1 + 8
    assert TINY_POLICY.reshape(tiny) == tiny


def test_policy_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="max_tiles"):
        ShapePolicy(max_tiles=0)


def test_default_token_count_is_bytes_over_four() -> None:
    assert default_token_count("") == 0
    assert default_token_count("abcd") == 1
    assert default_token_count("abcde") == 2
    assert default_token_count("é" * 4) == 2  # 8 UTF-8 bytes


def test_custom_tokenizer() -> None:
    words = ShapePolicy(tokenizer=lambda text: len(text.split()))
    assert words.count_tokens("one two three") == 3


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 20000), st.integers(1, 20000), st.sampled_from([DEFAULT, TINY_POLICY]))
def test_grid_properties(width: int, height: int, policy: ShapePolicy) -> None:
    cols, rows = policy.tile_grid(width, height)
    assert 1 <= cols * rows <= policy.max_tiles
    # Transposing the image transposes the chosen grid.
    assert policy.tile_grid(height, width) == (rows, cols)
    # An image that fits in one tile uses one tile.
    if width <= policy.tile_size and height <= policy.tile_size:
        assert (cols, rows) == (1, 1)
    assert isinstance(policy.shape("p", image_sizes=[(width, height)]), SampleShape)


def test_a_sample_images_rule_sees_all_of_a_samples_images_and_videos_add_their_own_tokens() -> None:
    def one_tile_each_unless_alone(sizes):
        return [(3, 30)] if len(sizes) == 1 else [(1, 10)] * len(sizes)

    policy = ShapePolicy(tokens_per_frame=4, max_frames=2, sample_images=one_tile_each_unless_alone, tokens_per_video=1)
    alone = policy.shape("a", image_sizes=[(50, 20)], text_tokens=3)
    several = policy.shape("b", image_sizes=[(50, 20), (20, 50)], text_tokens=3)
    video = policy.shape("c", video_frames=5, text_tokens=3)
    assert (alone.encoder_tiles, alone.visual_tokens) == (3, 30)
    assert (several.encoder_tiles, several.visual_tokens) == (2, 20)
    assert (video.encoder_tiles, video.visual_tokens, video.llm_tokens) == (2, 2 * 4 + 1, 12)
    assert (
        policy.describe()["tokens_per_video"] == 1
        and "one_tile_each_unless_alone" in policy.describe()["sample_images"]
    )
    # the policies without these options describe themselves as before (cost models stay valid)
    assert not {"sample_images", "tokens_per_video"} & set(ShapePolicy().describe())
    with pytest.raises(ValueError, match="gave 1 counts for 2 images"):
        ShapePolicy(sample_images=lambda sizes: [(1, 1)]).shape("d", image_sizes=[(5, 5), (6, 6)])
