"""Pieces shared by several kernels: the launchers' input checks, block sizes and split counts; the Mamba2 time
step and channels, the RMS normalisation, RoPE/conv/head parameter loads and the online-softmax update (Triton,
for the kernels); RoPE, the Mamba2 time step, the conv and one SSM step (torch, for the references). Shapes use
the glossary of docs/DESIGN.md §1: T tokens, H Mamba heads, Dh head dim.

Triton is optional: kernel files take `triton` and `tl` from here, the real modules or, without triton
(macOS, Windows), a stand-in under which the references run.
"""
import re
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

    class _NoTriton:
        """Stands in for both `triton` and `triton.language`: `@triton.jit` and `tl.constexpr` evaluate
        at import, so every `<name>_ref` works; launching a kernel or using any other name raises an ImportError."""
        constexpr = None

        def jit(self, fn):
            return self

        def __getitem__(self, grid):
            raise ImportError("triton is not installed; use backend='torch'")

        def __getattr__(self, name):
            if name.startswith("__"):  # Python's own protocol lookups (copy, inspect) see a plain object
                raise AttributeError(name)
            raise ImportError(f"triton.{name}: triton is not installed; use backend='torch'")

    triton = tl = _NoTriton()


class Launch(NamedTuple):
    """One kernel launch as a launcher plans it, kernel[grid](*args, **meta); meta holds the constexprs and
    num_warps / num_stages. `<op>_plan(<op>'s arguments, *, cuda, n_sm)` checks them and returns the launches of
    <op> on a device of n_sm SMs (CUDA or the interpreter) and the outputs they fill; the launcher runs its plan,
    scripts/compile_check.py compiles the same plan for a GPU it does not have."""
    kernel: object
    grid: tuple
    args: tuple
    meta: dict


def launch(plan, *args, **kwargs):
    """Run plan's launches, in order, on the device of args[0]; return the outputs they fill."""
    device = args[0].device
    launches, out = plan(*args, **kwargs, cuda=device.type == "cuda", n_sm=sm_count(device))
    for one in launches:
        one.kernel[one.grid](*one.args, **one.meta)
    return out


def one_of(*dtypes: torch.dtype) -> tuple:
    """An Arg's dtypes: (the name its messages use, the test)."""
    return "/".join(str(dt).removeprefix("torch.") for dt in dtypes), dtypes.__contains__


INT = "integer", lambda dt: not (dt.is_floating_point or dt.is_complex or dt == torch.bool)
FLOAT = "floating point", lambda dt: dt.is_floating_point
DOT = one_of(torch.float32, torch.float16, torch.bfloat16)  # what tl.dot takes
CONTIG, ROW, STRIDED = "contiguous", "row", "strided"  # layouts: indexed flat, unit last-dim stride, any strides


class Arg(NamedTuple):
    """One row of a launcher's contract. shape: sizes by name, "B K-1 V": a name is bound on first sight and must
    agree wherever it appears again, a sum of names and integers must equal its value, a leading "..." binds the
    leading dims. dtype: None (any), a dtype, one_of(...), INT, FLOAT, or the name of an earlier argument."""
    shape: str
    dtype: object = None
    layout: str = CONTIG


class Checker(NamedTuple):
    """A launcher's input checks, each failure a ValueError naming the kernel, not a Triton error deep inside:
    `chk(cond, msg)` for a one-line rule, `chk.args(table, **tensors)` for the tensors."""
    kernel: str

    def __call__(self, cond: bool, msg: str):
        if not cond:
            raise ValueError(f"{self.kernel}: {msg}")

    def args(self, table: dict, dims: SimpleNamespace | None = None, **tensors) -> SimpleNamespace:
        """Check tensors against table {"name" or "name1, name2": Arg}, in table order: shape, dtype, layout and
        the first one's device; None (an absent optional tensor) passes. Returns the bound sizes d.B, d.K, ...
        and d.device; `dims` continues an earlier call's binding."""
        d = dims or SimpleNamespace()
        for key, arg in table.items():
            for name in key.split(", "):
                bad = tensors[name] is not None and _violation(arg, tensors[name], vars(d), tensors)
                if bad:
                    who = f" for {name}" if name != key else ""  # a row of several tensors: which one
                    raise ValueError(f"{self.kernel}: {key} must {bad[0]}, got {bad[1]}{who}")
        return d


def _violation(arg: Arg, t: torch.Tensor, dims: dict, tensors: dict) -> tuple[str, str] | None:
    """What t breaks of arg, as (what it must, what it is), or None; binds the sizes arg names."""
    dims.setdefault("device", t.device)
    dtypes = tensors[arg.dtype].dtype if isinstance(arg.dtype, str) else arg.dtype
    dtypes = one_of(dtypes) if isinstance(dtypes, torch.dtype) else dtypes
    tokens = arg.shape.split()
    fits = _bind(tokens, tuple(t.shape), dims)
    if not fits or (dtypes and not dtypes[1](t.dtype)):  # say all the row asks: "int32 (2, 3, K)"
        shape = [v for tok in tokens for v in (dims.get("...", [tok]) if tok == "..." else [_size(tok, dims)])]
        want = f"be {dtypes[0] + ' ' if dtypes else ''}({', '.join(map(str, shape))}{',' * (len(shape) == 1)})"
        return want, f"dtype {one_of(t.dtype)[0]}" if fits else f"shape {tuple(t.shape)}"
    if arg.layout == CONTIG and not t.is_contiguous():
        return "be contiguous", f"strides {t.stride()}"
    if arg.layout == ROW and t.numel() and t.stride(-1) != 1:
        return "have a unit stride in its last dim", f"strides {t.stride()}"
    return (f"be on {dims['device']}", str(t.device)) if t.device != dims["device"] else None


def _bind(tokens: list, shape: tuple, dims: dict) -> bool:
    """Whether shape fits tokens, binding the names (and "...") not bound yet."""
    if tokens[:1] == ["..."]:
        n = len(shape) - len(tokens) + 1
        if n < 0 or dims.setdefault("...", shape[:n]) != shape[:n]:
            return False
        tokens, shape = tokens[1:], shape[n:]
    return len(tokens) == len(shape) and all(
        (dims.setdefault(tok, n) if tok.isidentifier() else _size(tok, dims)) == n for tok, n in zip(tokens, shape))


def _size(expr: str, dims: dict) -> int | str:
    """The value of a size name or of a sum such as "W-1+K"; expr itself while a name in it is unbound."""
    terms = [(sign, int(x) if x.isdigit() else dims.get(x)) for sign, x in re.findall(r"([+-]?)(\w+)", expr)]
    return expr if None in (v for _, v in terms) else sum(-v if sign == "-" else v for sign, v in terms)


def pow2(n: int, lo: int = 16) -> int:
    """Block extent >= n: a power of two, at least lo (16: the smallest tl.dot operand side); without triton."""
    return max(lo, 1 << max(0, n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of non-negative ints, usable without triton (the byte counts of the roofline)."""
    return -(-a // b)


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device; 2 stands in for the CPU (the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def split_plan(n: int, block: int, rows: int, n_sm: int, splits: int | None = None) -> tuple[int, int]:
    """Cut a length n read by `rows` rows into (chunk, splits): chunks of whole blocks; by default
    enough to fill n_sm SMs (about two programs per SM), each at least 4 blocks long."""
    if not splits:
        splits = max(1, min(cdiv(2 * n_sm, rows), cdiv(n, 4 * block)))
    chunk = cdiv(cdiv(n, splits), block) * block
    return chunk, cdiv(n, chunk)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: fp32 must not be rounded to tf32 (the tests compare to an fp32 reference at 1e-4)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def apply_rope_ref(x: torch.Tensor, positions: torch.Tensor, theta: float | None) -> torch.Tensor:
    """Rotate x (..., T, heads, Dh) by positions (..., T); identity when theta is None (NoPE).
    Rotate-half RoPE, for d < Dh/2 with f_d = theta^(-2d/Dh):

        x'[d]        = x[d] cos(t f_d) - x[d + Dh/2] sin(t f_d)
        x'[d + Dh/2] = x[d + Dh/2] cos(t f_d) + x[d] sin(t f_d)
    """
    if theta is None:
        return x
    inv_freq = rope_inv_freq(x.shape[-1], theta, positions.device)  # (Dh/2,)
    freqs = positions.float()[..., None, None] * inv_freq  # (..., T, 1, Dh/2): broadcast over heads
    angle = torch.cat((freqs, freqs), dim=-1)  # (..., T, 1, Dh), rotate-half layout
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * angle.cos() + rotated * angle.sin()).to(x.dtype)


def mamba_dt_ref(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float]) -> torch.Tensor:
    """dt = clamp(softplus(dt + dt_bias), *dt_limit) in fp32; dt (..., H)."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(min=dt_limit[0], max=dt_limit[1])


def conv_silu_ref(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Causal depthwise conv1d + SiLU: window (..., C, W-1+L), the W-1 inputs before the first
    output then the L new ones; weight (C, W), bias (C,) or None -> (..., L, C) in fp32."""
    W = weight.shape[-1]
    windows = window.float().unfold(-1, W, 1)  # (..., C, L, W): windows[..., c, l, :] = inputs l .. l+W-1
    out = (windows * weight.float()[:, None, :]).sum(-1)  # (..., C, L)
    if bias is not None:
        out = out + bias.float()[:, None]
    return F.silu(out).transpose(-1, -2)


def ssm_step_ref(state, x, B_g, C_g, dt, A, D):
    """One token of the Mamba2 recurrence, per head h of group g = h // (H/G):

        S_h = exp(dt_h * A_h) * S_h + dt_h * (x_h outer B_g);   y_h = S_h @ C_g + D_h * x_h

    state (..., H, P, N) fp32, x (..., H, P), B_g and C_g (..., G, N), dt (..., H) fp32, A and D (H,).
    Returns (new state, y (..., H, P)), both fp32.
    """
    *lead, H, P, N = state.shape
    G = B_g.shape[-2]
    xf = x.float()
    # heads viewed as (G, H/G) so B_g and C_g broadcast over the heads of their group without copies
    Bg = B_g.float().reshape(*lead, G, 1, 1, N)
    Cg = C_g.float().reshape(*lead, G, 1, N, 1)
    decay = torch.exp(dt * A)[..., None, None]  # (..., H, 1, 1)
    upd = (dt[..., None] * xf).reshape(*lead, G, H // G, P, 1) * Bg  # (..., G, H/G, P, N)
    state = decay * state + upd.reshape(*lead, H, P, N)
    y = (state.reshape(*lead, G, H // G, P, N) @ Cg).reshape(*lead, H, P) + D.float()[:, None] * xf
    return state, y


@triton.jit
def rms_normalize(b_xf, n, eps, ty):
    """x / sqrt(mean(x^2) + eps) over a block whose masked lanes hold 0, rounded to ty as the reference rounds."""
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_xf * b_xf, axis=0) / n + eps)
    return (b_xf * b_rstd).to(ty).to(tl.float32)


@triton.jit
def silu(b_x):
    return b_x / (1.0 + tl.exp(-b_x))


@triton.jit
def mamba_dt(x, dt_lo, dt_hi):
    # clamp(softplus(x), dt_lo, dt_hi) of x = dt + dt_bias, softplus as torch's: x above 20, else log1p(exp(x)),
    # log1p written the accurate way (u * log(w) / (w - 1)) because log(1 + u) loses tiny u.
    u = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + u
    lp = tl.where(w == 1.0, u, tl.log(w) * u / (w - 1.0))
    return tl.minimum(tl.maximum(tl.where(x > 20.0, x, lp), dt_lo), dt_hi)


@triton.jit
def mamba_channels(i_h, o_p, o_n, H: tl.constexpr, P: tl.constexpr, N: tl.constexpr, G: tl.constexpr):
    """xBC channels (x, B_g, C_g) of head i_h's dims o_p and of its group's state dims o_n, split_xbc's layout."""
    i_g = i_h // (H // G)
    return i_h * P + o_p, H * P + i_g * N + o_n, H * P + G * N + i_g * N + o_n


@triton.jit
def load_conv_weights(p_conv_w, p_conv_b, o_c, m_c, o_w, W: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Conv weights (channels, BLOCK_W) and biases (channels,) of the conv channels o_c, in fp32."""
    b_w = tl.load(p_conv_w + o_c[:, None] * W + o_w[None, :], mask=m_c[:, None] & (o_w < W)[None, :], other=0.0)
    b_b = (o_c * 0).to(tl.float32)
    if HAS_BIAS:
        b_b = tl.load(p_conv_b + o_c, mask=m_c, other=0.0).to(tl.float32)
    return b_w.to(tl.float32), b_b


@triton.jit
def load_head_params(p_A_log, p_D, p_dt_bias, i_h):
    """A = -exp(A_log), D and dt_bias of head i_h, in fp32."""
    b_A = -tl.exp(tl.load(p_A_log + i_h).to(tl.float32))
    return b_A, tl.load(p_D + i_h).to(tl.float32), tl.load(p_dt_bias + i_h).to(tl.float32)


@triton.jit
def online_softmax_step(b_q, b_k, b_v, m_s, scale, b_m, b_l, b_acc, DOT_PREC: tl.constexpr):
    """Fold keys b_k and values b_v (N, Dh), scores scale * b_q b_k^T (M, N) kept where m_s, into the running row
    max b_m (M,), the running sum b_l (M,) and the unnormalised output b_acc (M, Dh) of flash attention."""
    b_s = tl.where(m_s, tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * scale, float("-inf"))  # (M, N)
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    b_alpha = tl.exp(b_m - b_m_new)  # rescales what was summed under the old max
    b_p = tl.exp(b_s - b_m_new[:, None])
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PREC)
    return b_m_new, b_l, b_acc


@triton.jit
def rope_load(p_x, p_inv_freq, o_rows, m_rows, pos, o_d, DH: tl.constexpr, ROPE: tl.constexpr):
    """Load a (R, DH_PAD) tile in fp32, row r at element offset o_rows[r] from p_x (its d = 0),
    and rotate row r by position pos[r] when ROPE (rotate-half, as apply_rope_ref)."""
    m_d = o_d < DH
    m_x = m_rows[:, None] & m_d[None, :]
    b_x = tl.load(p_x + o_rows[:, None] + o_d[None, :], mask=m_x, other=0.0).to(tl.float32)
    if ROPE:
        HALF = DH // 2
        # rotate-half partner of d and its sign: -x[d + Dh/2] for the first half, +x[d - Dh/2] for the second
        o_partner = tl.where(o_d < HALF, o_d + HALF, o_d - HALF)
        b_sign = tl.where(o_d < HALF, -1.0, 1.0)
        b_xp = tl.load(p_x + o_rows[:, None] + o_partner[None, :], mask=m_x, other=0.0).to(tl.float32)
        # the same fp32 inv_freq table as the reference (rope_inv_freq), so only cos/sin rounding can differ
        b_f = tl.load(p_inv_freq + (o_d % HALF), mask=m_d, other=0.0)  # (DH_PAD,)
        b_ang = pos.to(tl.float32)[:, None] * b_f[None, :]  # (R, DH_PAD)
        b_x = b_x * tl.cos(b_ang) + b_sign[None, :] * b_xp * tl.sin(b_ang)
    return b_x


def rope_inv_freq(head_dim: int, theta: float | None, device) -> torch.Tensor:
    """RoPE inverse frequencies (Dh/2,) fp32, theta^(-2d/Dh); a dummy (1,) when theta is None (NoPE),
    so a launcher always has a pointer to pass."""
    if theta is None:
        return torch.zeros(1, dtype=torch.float32, device=device)
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))


def split_xbc(xbc: torch.Tensor, n_heads: int, head_dim: int, n_groups: int):
    """(..., C) post-conv activations -> x (..., H, P), B_g (..., G, N), C_g (..., G, N)."""
    d_in = n_heads * head_dim
    N = (xbc.shape[-1] - d_in) // (2 * n_groups)
    x, B_g, C_g = xbc.split([d_in, n_groups * N, n_groups * N], dim=-1)
    lead = xbc.shape[:-1]
    return x.reshape(*lead, n_heads, head_dim), B_g.reshape(*lead, n_groups, N), C_g.reshape(*lead, n_groups, N)
