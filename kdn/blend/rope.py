"""RoPE for the blender: rotate keys (and queries) whose channels may be a pruned subset.

transformers' Llama-family models rotate with the ``rotate_half`` convention: channel ``c`` of
the first ``rotary_dim`` channels pairs with ``c + rotary_dim/2`` (or ``c - rotary_dim/2``):

    out[c] = x[c] * cos[c] - x[c + r/2] * sin[c]        c <  r/2
    out[c] = x[c] * cos[c] + x[c - r/2] * sin[c]        r/2 <= c < r
    out[c] = x[c]                                        c >= r   (partial rotary)

with ``cos``/``sin`` of shape [tokens, r] = cat(freqs, freqs). A pruned layer keeps only some
channels (``k_kept``); a ``RopePlan`` says, for each kept channel, which column of cos/sin it
uses, which kept channel is its partner and with which sign. A rotating channel whose partner
was pruned away can not be rotated, and is refused.

Rotations compose: a key stored at position p is moved to p + d by rotating it by d alone
(``reposition``), exactly as if it had been computed at p + d (up to float rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdn.errors import InvalidLayout
from kdn.layout import RopeSpec


@dataclass(frozen=True)
class RopePlan:
    """How the kept channels of one layer's keys rotate."""

    column: torch.Tensor
    """[ch] long: column of cos/sin each kept channel uses (its original channel index; 0 for
    channels that do not rotate)."""
    partner: torch.Tensor
    """[ch] long: index (among kept channels) of the channel it pairs with (itself if none)."""
    sign: torch.Tensor
    """[ch] float: -1 for the first half of the rotary channels, +1 for the second, 0 if none."""
    rotates: torch.Tensor
    """[ch] bool: channel lies in the rotary part."""
    plain: bool = False
    """All channels kept, all rotate: the ordinary ``rotate_half`` layout (fast path)."""
    rotating: bool = True
    """Some kept channel rotates (``rotates.any()``, known on the host)."""


def rope_plan(kept: tuple[int, ...] | None, channels: int, rotary_dim: int,
              device: torch.device | str | None = None) -> RopePlan:
    """Plan for a layer whose keys hold ``channels`` channels, the original ``kept`` ones, its
    tensors on ``device`` (the keys' device: CPU when None)."""
    orig = list(kept) if kept is not None else list(range(channels))
    if len(orig) != channels:
        raise InvalidLayout(f"{len(orig)} kept channel indices for {channels} channels")
    where = {c: j for j, c in enumerate(orig)}
    half = rotary_dim // 2
    column, partner, sign, rotates = [], [], [], []
    for j, c in enumerate(orig):
        if c >= rotary_dim:
            column.append(0)
            partner.append(j)
            sign.append(0.0)
            rotates.append(False)
            continue
        mate = c + half if c < half else c - half
        if mate not in where:
            raise InvalidLayout(
                f"rotary channel {c} is kept but its RoPE partner {mate} was pruned; "
                "keys can not be re-positioned"
            )
        column.append(c)
        partner.append(where[mate])
        sign.append(-1.0 if c < half else 1.0)
        rotates.append(True)
    where_to = torch.device(device) if device is not None else torch.device("cpu")
    return RopePlan(
        plain=orig == list(range(rotary_dim)),
        rotating=any(rotates),
        column=torch.tensor(column, dtype=torch.long, device=where_to),
        partner=torch.tensor(partner, dtype=torch.long, device=where_to),
        sign=torch.tensor(sign, dtype=torch.float32, device=where_to),
        rotates=torch.tensor(rotates, dtype=torch.bool, device=where_to),
    )


def inv_freq(spec: RopeSpec) -> torch.Tensor:
    """[rotary_dim / 2] float64 inverse frequencies of default RoPE (``theta ** (-2i / r)``)."""
    if spec.scaling:
        raise InvalidLayout(
            f"rope scaling {spec.scaling} needs the model's own inverse frequencies; "
            "pass inv_freq from model.model.rotary_emb"
        )
    r = spec.rotary_dim
    return 1.0 / (spec.theta ** (torch.arange(0, r, 2, dtype=torch.float64, device="cpu") / r))


def cos_sin(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [tokens, rotary_dim] float64 on ``positions``' device for integer
    ``positions`` [tokens] (may be negative)."""
    angles = positions.to(torch.float64)[:, None] * freqs.to(positions.device,
                                                             torch.float64)[None, :]
    emb = torch.cat((angles, angles), dim=-1)  # [tokens, rotary_dim]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               plan: RopePlan) -> torch.Tensor:
    """Rotate ``x`` [..., tokens, ch] by cos/sin [tokens, rotary_dim] following ``plan``."""
    if plan.plain:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # rotate_half
        return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)
    rot = plan.rotates.to(x.device)
    col = plan.column.to(x.device)
    c = torch.where(rot, cos[:, col], torch.ones((), dtype=cos.dtype, device=cos.device))
    s = sin[:, col] * (plan.sign.to(sin.dtype).to(x.device))  # [tokens, ch]
    c, s = c.to(x.dtype), s.to(x.dtype)
    return x * c + x[..., plan.partner.to(x.device)] * s


def reposition(k: torch.Tensor, delta: int, freqs: torch.Tensor, plan: RopePlan) -> torch.Tensor:
    """Keys ``k`` [kv_heads, tokens, ch] rotated at positions p, moved to p + ``delta``."""
    if delta == 0 or not plan.rotating:
        return k
    cos, sin = cos_sin(torch.full((1,), delta, dtype=torch.long, device=k.device),
                       freqs)  # [1, rotary_dim]: one angle for all
    return apply_rope(k, cos, sin, plan)
