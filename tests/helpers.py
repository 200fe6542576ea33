"""One comparison helper for every test: it reports max abs and relative error."""
import torch


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, atol: float = 1e-4, rtol_scale: bool = True):
    """Fail unless max|out - ref| <= atol * max(1, max|ref|) (tolerance relative to the reference's scale)."""
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    ref_f, out_f = ref.detach().float(), out.detach().float()
    if ref_f.numel() == 0:
        return 0.0
    err = (out_f - ref_f).abs().max().item()
    scale = max(1.0, ref_f.abs().max().item()) if rtol_scale else 1.0
    rel = err / max(ref_f.abs().max().item(), 1e-12)
    assert err <= atol * scale, f"{name}: max abs err {err:.3e} (rel {rel:.3e}) > {atol * scale:.3e}"
    return err


def assert_unchanged(name: str, before: torch.Tensor, after: torch.Tensor):
    """Bit-for-bit equality (tolerance 0) for slots, rows and layers a kernel must not touch."""
    assert torch.equal(before, after), f"{name}: {int((before != after).sum())} elements changed"
