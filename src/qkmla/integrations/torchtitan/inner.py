"""An inner attention with a backward on the CPU, for torchtitan's language models.

torchtitan's language models build FlexAttention ``BlockMask`` s (causal, within each packed
document) for their inner attention; FlexAttention has no CPU backward, and torchtitan's
``ScaledDotProductAttention`` takes no document mask. :class:`DenseMaskAttention` keeps
FlexAttention's config type (so the model builds the same masks) and computes attention with
PyTorch's ``scaled_dot_product_attention`` over the mask made dense [B, 1, T, S]: the same
function, O(B T S) bytes of mask, for CPU runs and tests (``config_registry``'s ``cpu`` configs).
"""

from __future__ import annotations

from dataclasses import dataclass

from .versions import check_torchtitan

check_torchtitan()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import BlockMask, create_mask  # noqa: E402
from torchtitan.models.common.attention import FlexAttention  # noqa: E402


def dense_mask(block_mask: BlockMask, batch: int, queries: int, keys: int) -> torch.Tensor:
    """A FlexAttention ``BlockMask`` as booleans [batch, 1, queries, keys] (True: attend)."""
    return create_mask(block_mask.mask_mod, batch, None, queries, keys, device=block_mask.kv_num_blocks.device)


class DenseMaskAttention(FlexAttention):
    """FlexAttention's masks through SDPA with a dense mask (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                attention_masks: BlockMask, score_mod=None, scale=None, enable_gqa: bool = False,
                out_transform=None, **kwargs) -> torch.Tensor:
        """q [B, T, h, D], k [B, S, h or G, D], v [B, S, h or G, D_v] -> [B, T, h, D_v]."""
        if not isinstance(attention_masks, BlockMask):
            raise ValueError(f"attention_masks: expected the FlexAttention BlockMask torchtitan builds, got "
                             f"{type(attention_masks).__name__}")
        if score_mod is not None or out_transform is not None:
            raise ValueError("score_mod, out_transform: DenseMaskAttention computes plain masked softmax attention; "
                             "use FlexAttention (a GPU) for score modifiers and LSE transforms")
        B, T, S = q_BLNH.shape[0], q_BLNH.shape[1], k_BLNH.shape[1]
        mask = dense_mask(attention_masks, B, T, S)
        out = F.scaled_dot_product_attention(q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
                                             attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)
