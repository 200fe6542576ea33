"""out[b] = src[b, idx[b]]: the stash-slot hidden save that seeds the MTP draft head
(the hidden of the last accepted row), also used on the MTP's own output rows."""
import torch


def gather_rows_ref(src, idx):
    """src (B, K, D), idx (B,) int -> (B, D)."""
    return src[torch.arange(src.shape[0], device=src.device), idx]
