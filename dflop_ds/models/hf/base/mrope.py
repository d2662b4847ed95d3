"""Multimodal rotary position ids (M-RoPE) of the patch-grid families: a token's position on the
temporal, height and width axes, as HF's ``get_rope_index`` of Qwen2-VL and Qwen3-VL computes them,
the placeholder image grid of a microbatch without images, and the tower's grids."""

from __future__ import annotations

import torch

from dflop_ds.models.packing import check_packed, is_packed, token_positions


def placeholder_grid(merge_size: int, like: torch.Tensor) -> torch.Tensor:
    """``[[1, m, m]]``: the smallest image grid the merger accepts (one LLM token)."""
    return torch.tensor([[1, merge_size, merge_size]], dtype=torch.long, device=like.device)


def is_placeholder(grid: torch.Tensor, merge_size: int) -> bool:
    """True when ``grid`` is the one placeholder image of a microbatch without images."""
    return grid.shape[0] == 1 and grid[0].tolist() == [1, merge_size, merge_size]


def tower_grid(image_grid: torch.Tensor, video_grid: torch.Tensor) -> torch.Tensor:
    """The grids of everything the tower embeds, in its order: images, then videos (or their frame
    groups, each attending within itself as an image does)."""
    return torch.cat([image_grid, video_grid]) if video_grid.shape[0] else image_grid


def mrope_position_ids(
    input_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    image_grid_thw: torch.Tensor,
    *,
    image_token_id: int,
    merge_size: int,
    video_grid_thw: torch.Tensor | None = None,
    video_token_id: int | None = None,
) -> torch.Tensor:
    """The multimodal rotary (M-RoPE) position ids ``[3, B, S]`` (temporal, height, width) of the
    patch-grid families, as HF's ``get_rope_index`` computes them.

    Without images and videos every sample counts ``0..len-1`` on all three axes (padding
    continues counting). Otherwise each sample's tokens count on: a text token takes the next
    position on all three axes; an image or video of grid ``(t, h, w)`` (``t*h*w / merge**2``
    consecutive image or video tokens) starting at position ``p`` takes ``(p + i, p + y, p + x)``
    for its merged patch ``(i, y, x)`` (``i``: the frame pair of a video), and the text after it
    continues at ``p + max(h, w) / merge``. Padding gets 0. Images are consumed from
    ``image_grid_thw``, videos from ``video_grid_thw``, in sample order; a run of tokens whose
    length is not the next grid's token count is refused. A packed ``input_ids [1, sum(seq_lens)]``
    gives ``[3, 1, sum(seq_lens)]``: every sample's positions as if it were alone (what HF's
    ``get_rope_index`` gives it), restarting at 0.
    """
    batch, length = input_ids.shape
    device = input_ids.device
    video_grid_thw = image_grid_thw[:0] if video_grid_thw is None else video_grid_thw
    if image_grid_thw.shape[0] == 0 and video_grid_thw.shape[0] == 0:
        return token_positions(seq_lens, batch, length).expand(3, batch, length).clone()
    grids = {image_token_id: iter(image_grid_thw.tolist()), video_token_id: iter(video_grid_thw.tolist())}
    names = {image_token_id: "image", video_token_id: "video"}
    if is_packed(batch, seq_lens):
        check_packed(batch, length, seq_lens, "mrope_position_ids: packed input_ids")
        samples = input_ids[0].split(seq_lens.tolist())
        pieces = [_sample_positions(ids.tolist(), i, grids, names, merge_size, device) for i, ids in enumerate(samples)]
        positions = torch.cat(pieces, dim=1)[:, None, :]
    else:
        positions = torch.zeros(3, batch, length, dtype=torch.long, device=device)
        for row in range(batch):
            ids = input_ids[row, : int(seq_lens[row])].tolist()
            positions[:, row, : len(ids)] = _sample_positions(ids, row, grids, names, merge_size, device)
    for token, rest in grids.items():
        leftover = sum(1 for _ in rest)
        if leftover:
            raise ValueError(f"{leftover} {names[token]} grid(s) have no {names[token]} tokens in the microbatch")
    return positions


def _sample_positions(
    ids: list[int], sample: int, grids: dict, names: dict, merge_size: int, device: torch.device
) -> torch.Tensor:
    """``[3, len(ids)]`` M-RoPE positions of one sample's tokens, taking its images' and videos'
    grids from the ``grids`` iterators (see :func:`mrope_position_ids`)."""
    kinds = [token if token in grids else None for token in ids]
    pieces, start, current = [], 0, 0
    while start < len(kinds):
        stop = start
        while stop < len(kinds) and kinds[stop] == kinds[start]:
            stop += 1
        if kinds[start] is None:
            pieces.append(torch.arange(current, current + stop - start, device=device).expand(3, -1))
            current += stop - start
        else:
            t, h, w = next(grids[kinds[start]], (0, 0, 0))
            gh, gw = h // merge_size, w // merge_size
            if t * gh * gw != stop - start:
                name = names[kinds[start]]
                raise ValueError(
                    f"sample {sample}: a run of {stop - start} {name} tokens at position {start} does not "
                    f"match the next {name} grid {(t, h, w)} ({t * gh * gw} tokens)"
                )
            axes = torch.meshgrid(
                torch.arange(t, device=device),
                torch.arange(gh, device=device),
                torch.arange(gw, device=device),
                indexing="ij",
            )
            pieces.append(torch.stack([axis.flatten() for axis in axes]) + current)
            current += max(gh, gw)
        start = stop
    return torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long, device=device)


__all__ = ["is_placeholder", "mrope_position_ids", "placeholder_grid", "tower_grid"]
