"""Reference emulation of the torch_npu operators kernels-npu calls. TEST TREE ONLY, never shipped.

There is no Ascend hardware in CI: kernels-npu's NPU behaviour is verified against this emulation only, not on
Ascend hardware. Each operator's Python signature is the part of its schema that the oldest and the newest
torch_npu release kernels-npu supports share (2.6.0.post3 and 2.14.0: argument names, order, defaults,
keyword-only markers, types and the exact return structure, as declared in their wheels'
``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``; ``tests/test_vendor_schemas.py`` checks it against
the wheels). Arguments only newer releases have are left out, so a call that needs them fails here as it would on
the oldest release. Each operator computes the documented math in float32 with one rounding to the output dtype,
and raises where the documentation says the real operator rejects its input (dtype rules, shapes, layouts,
limits). Features outside what kernels-npu uses raise ``NotImplementedError("... not emulated")`` rather than
guessing.

Emulated: ``npu_rms_norm``, ``npu_swiglu``, ``npu_rotary_mul``, ``npu_fusion_attention``, ``npu_grouped_matmul``,
``npu_moe_token_permute``, ``npu_moe_token_unpermute``, and the ``torch.npu`` device module (see :mod:`.npu`).

Autograd: operators that have a registered backward in torch_npu are differentiable here (through the torch ops
the emulation is written in); ``npu_grouped_matmul`` has none in torch_npu, so here it returns tensors detached
from the graph, which makes a missing ``autograd.Function`` wrapper fail loudly in tests, as it would on hardware.

Every call is appended to :data:`calls` as ``(name, arguments)`` so tests can check what was passed.
"""

from __future__ import annotations

import torch

from . import npu


__all__ = [
    "calls",
    "npu",
    "npu_fusion_attention",
    "npu_grouped_matmul",
    "npu_moe_token_permute",
    "npu_moe_token_unpermute",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
]

__version__ = "2.13.0+emulated"
EMULATED = True

# Like the real package, importing it installs the device module as torch.npu.
torch.npu = npu  # type: ignore[attr-defined]

calls: list[tuple[str, dict[str, object]]] = []

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INT_MAX = 2147483647


def _record(name: str, **arguments: object) -> None:
    calls.append((name, arguments))


def _check_float(name: str, what: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in _FLOATS:
        raise RuntimeError(f"{name}: {what} dtype {tensor.dtype} not supported (float16, bfloat16, float32)")


# --------------------------------------------------------------------------------------------------------------
# npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: ``y = x * rstd * gamma`` over gamma's trailing dims, ``rstd`` float32 ``1/rms``."""
    _record("npu_rms_norm", self=self, gamma=gamma, epsilon=epsilon)
    _check_float("npu_rms_norm", "self", self)
    if gamma.dtype != self.dtype:
        raise RuntimeError(f"npu_rms_norm: gamma dtype {gamma.dtype} must equal self dtype {self.dtype}")
    if not 1 <= self.dim() <= 8:
        raise RuntimeError(f"npu_rms_norm: self must be 1-8 dimensional, got {self.dim()}")
    if gamma.dim() > self.dim() or tuple(self.shape[self.dim() - gamma.dim():]) != tuple(gamma.shape):
        raise RuntimeError(f"npu_rms_norm: gamma shape {tuple(gamma.shape)} must be the trailing dims of "
                           f"{tuple(self.shape)}")
    dims = tuple(range(self.dim() - gamma.dim(), self.dim()))
    x32 = self.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (x32 * rstd * gamma.float()).to(self.dtype)
    return y, rstd


# --------------------------------------------------------------------------------------------------------------
# npu_swiglu(Tensor self, int dim=-1) -> Tensor


def npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``silu(A) * B`` where ``A, B`` are the first and second halves of ``self`` along ``dim``."""
    _record("npu_swiglu", self=self, dim=dim)
    _check_float("npu_swiglu", "self", self)
    if not self.is_contiguous():
        raise RuntimeError("npu_swiglu: non-contiguous input is not supported")
    if self.shape[dim] % 2:
        raise RuntimeError(f"npu_swiglu: size {self.shape[dim]} of dim {dim} must be even")
    a, b = self.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(self.dtype)


# --------------------------------------------------------------------------------------------------------------
# npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor
#   (2.7.1.post4 and later add `Tensor? rotate=None`, which 2.6.0.post3 lacks: not emulated, so not callable here)

_ROTARY_MAX_D = 896
_ROTARY_MAX_BN = 1000
_ROTARY_MAX_BN_GRAD = 1024


def npu_rotary_mul(self: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    """``x * r1 + rotate(x) * r2``; ``half``: rotate = cat(-x2, x1), ``interleave``: GPT-J pairs (A2/A3 rules)."""
    _record("npu_rotary_mul", self=self, r1=r1, r2=r2, rotary_mode=rotary_mode)
    if rotary_mode not in ("half", "interleave"):
        raise RuntimeError(f"npu_rotary_mul: rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    for what, tensor in (("self", self), ("r1", r1), ("r2", r2)):
        _check_float("npu_rotary_mul", what, tensor)
        if tensor.dim() != 4:
            raise RuntimeError(f"npu_rotary_mul: {what} must be 4-D (BNSD/BSND/SBND), got {tuple(tensor.shape)}")
    if r1.dtype != self.dtype or r2.dtype != self.dtype:
        raise RuntimeError(f"npu_rotary_mul: r1/r2 dtype ({r1.dtype}, {r2.dtype}) must equal self dtype {self.dtype}")
    if r1.shape != r2.shape:
        raise RuntimeError(f"npu_rotary_mul: r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} must have one shape")
    d = self.shape[-1]
    if d % 2 or d >= _ROTARY_MAX_D:
        raise RuntimeError(f"npu_rotary_mul: head dim D={d} must be even and < {_ROTARY_MAX_D}")
    if r1.shape[-1] != d:
        raise RuntimeError(f"npu_rotary_mul: r1 last dim {r1.shape[-1]} must equal D={d}")
    broadcast = 1
    for i in range(3):
        if r1.shape[i] not in (1, self.shape[i]):
            raise RuntimeError(f"npu_rotary_mul: r1 {tuple(r1.shape)} does not broadcast to {tuple(self.shape)}")
        if r1.shape[i] == 1 and self.shape[i] != 1:
            if self.shape[i] >= _ROTARY_MAX_BN:
                raise RuntimeError(f"npu_rotary_mul: B and N must be < {_ROTARY_MAX_BN}, got {self.shape[i]}")
            broadcast *= self.shape[i]
    if (r1.requires_grad or r2.requires_grad) and broadcast > _ROTARY_MAX_BN_GRAD:
        raise RuntimeError(f"npu_rotary_mul: B*N must be <= {_ROTARY_MAX_BN_GRAD} when r1/r2 require grad")
    x = self.float()
    if rotary_mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return (x * r1.float() + rotated * r2.float()).to(self.dtype)


# --------------------------------------------------------------------------------------------------------------
# npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, str input_layout, Tensor? pse=None,
#   Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., float keep_prob=1.,
#   int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int[]? prefix=None,
#   int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True,
#   bool sync=False, str softmax_layout="") -> (Tensor, Tensor, Tensor, Tensor, int, int, int)
#   (releases after 2.6.0.post3 add `Tensor? sink=None, Tensor? dropout_mask=None, int seed=0, int offset=0`:
#   not emulated, as the oldest supported release lacks them)

_FA_MAX_D = 768
_FA_OPTIMIZED_MASK = 2048
_FA_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")


def _to_bnsd(t: torch.Tensor, layout: str, heads: int | None, what: str) -> torch.Tensor:
    if layout in ("BSH", "SBH"):
        if t.dim() != 3:
            raise RuntimeError(f"npu_fusion_attention: {what} must be 3-D for layout {layout}")
        if layout == "SBH":
            t = t.transpose(0, 1)
        if heads is None:
            raise RuntimeError("npu_fusion_attention: internal: head count unknown")
        return t.reshape(t.shape[0], t.shape[1], heads, -1).transpose(1, 2)
    if t.dim() != 4:
        raise RuntimeError(f"npu_fusion_attention: {what} must be 4-D for layout {layout}")
    return t.transpose(1, 2) if layout == "BSND" else t


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return t
    bsnd = t.transpose(1, 2)
    if layout == "BSND":
        return bsnd
    bsh = bsnd.reshape(bsnd.shape[0], bsnd.shape[1], -1)
    return bsh if layout == "BSH" else bsh.transpose(0, 1)


def npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = _INT_MAX,
    next_tockens: int = _INT_MAX,
    inner_precise: int = 0,
    prefix: list[int] | None = None,
    actual_seq_qlen: list[int] | None = None,
    actual_seq_kvlen: list[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """Training flash attention: ``(attn_out, softmax_max, softmax_sum, softmax_in, seed, offset, numels)``.

    atten_mask True/1 = masked out. sparse_mode 0 uses atten_mask as given (plus the pre/next token band);
    2 (leftUpCausal) and 3 (rightDownCausal) require the 2048x2048 upper-triangular optimised mask and derive
    the causal pattern, aligned top-left or bottom-right. GQA when key/value have fewer heads.
    """
    _record(
        "npu_fusion_attention", query=query, key=key, value=value, head_num=head_num, input_layout=input_layout,
        atten_mask=atten_mask, scale=scale, keep_prob=keep_prob, pre_tockens=pre_tockens,
        next_tockens=next_tockens, sparse_mode=sparse_mode,
    )
    if input_layout not in _FA_LAYOUTS:
        raise RuntimeError(f"npu_fusion_attention: input_layout {input_layout!r} not in {_FA_LAYOUTS}")
    if input_layout == "TND":
        raise NotImplementedError("npu_fusion_attention: TND (varlen) layout is not emulated")
    for arg, value_ in (("pse", pse), ("padding_mask", padding_mask), ("prefix", prefix),
                        ("actual_seq_qlen", actual_seq_qlen), ("actual_seq_kvlen", actual_seq_kvlen)):
        if value_ is not None:
            raise NotImplementedError(f"npu_fusion_attention: {arg} is not emulated")
    if softmax_layout:
        raise NotImplementedError(f"npu_fusion_attention: softmax_layout {softmax_layout!r} is not emulated")
    for what, tensor in (("query", query), ("key", key), ("value", value)):
        _check_float("npu_fusion_attention", what, tensor)
    if not (query.dtype == key.dtype == value.dtype):
        raise RuntimeError("npu_fusion_attention: query, key and value must share one dtype")
    if not 0.0 < keep_prob <= 1.0:
        raise RuntimeError(f"npu_fusion_attention: keep_prob {keep_prob} must be in (0, 1]")

    if input_layout in ("BSH", "SBH"):
        d = query.shape[-1] // head_num
        if query.shape[-1] % head_num:
            raise RuntimeError(f"npu_fusion_attention: H={query.shape[-1]} not divisible by head_num={head_num}")
        kv_heads = key.shape[-1] // d
    else:
        kv_heads = key.shape[1] if input_layout == "BNSD" else key.shape[2]
    q = _to_bnsd(query, input_layout, head_num, "query")
    k = _to_bnsd(key, input_layout, kv_heads, "key")
    v = _to_bnsd(value, input_layout, kv_heads, "value")
    b, n, sq, d = q.shape
    if n != head_num:
        raise RuntimeError(f"npu_fusion_attention: head_num {head_num} != query heads {n}")
    if d > _FA_MAX_D:
        raise RuntimeError(f"npu_fusion_attention: head dim {d} > {_FA_MAX_D}")
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise RuntimeError(f"npu_fusion_attention: key {tuple(k.shape)} / value {tuple(v.shape)} do not match "
                           f"query {tuple(q.shape)}")
    nkv, skv = k.shape[1], k.shape[2]
    if n % nkv:
        raise RuntimeError(f"npu_fusion_attention: query heads {n} must be a multiple of key/value heads {nkv}")

    rows = torch.arange(sq, device=q.device).unsqueeze(-1)
    cols = torch.arange(skv, device=q.device).unsqueeze(0)
    if atten_mask is not None and atten_mask.dtype not in (torch.bool, torch.uint8):
        raise RuntimeError(f"npu_fusion_attention: atten_mask dtype {atten_mask.dtype} must be bool or uint8")
    if sparse_mode in (2, 3):
        if atten_mask is None or tuple(atten_mask.shape) != (_FA_OPTIMIZED_MASK, _FA_OPTIMIZED_MASK):
            raise RuntimeError(f"npu_fusion_attention: sparse_mode {sparse_mode} needs the "
                               f"{_FA_OPTIMIZED_MASK}x{_FA_OPTIMIZED_MASK} optimised atten_mask")
        if not torch.equal(atten_mask.bool(), torch.ones_like(atten_mask, dtype=torch.bool).triu(1)):
            raise RuntimeError("npu_fusion_attention: the optimised atten_mask must be upper-triangular (diagonal 1)")
        shift = 0 if sparse_mode == 2 else skv - sq
        masked = (cols > rows + shift)[None, None]
    elif sparse_mode == 0:
        masked = torch.zeros(1, 1, sq, skv, dtype=torch.bool, device=q.device)
        if atten_mask is not None:
            shape = tuple(atten_mask.shape)
            if shape not in ((sq, skv), (1, 1, sq, skv), (b, 1, sq, skv), (b, n, sq, skv)):
                raise RuntimeError(f"npu_fusion_attention: atten_mask shape {shape} must be SS, 11SS, B1SS or BNSS "
                                   f"for B={b}, N={n}, Sq={sq}, Skv={skv}")
            masked = atten_mask.bool().reshape((1, 1, sq, skv) if len(shape) == 2 else shape)
        masked = masked | (cols - rows > next_tockens)[None, None] | (rows - cols > pre_tockens)[None, None]
    else:
        raise NotImplementedError(f"npu_fusion_attention: sparse_mode {sparse_mode} is not emulated")

    group = n // nkv
    k32 = k.float().repeat_interleave(group, dim=1)
    v32 = v.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k32.transpose(-1, -2)) * scale
    scores = scores.masked_fill(masked, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    # Fully masked rows produce zeros (no key to attend), as flash-attention kernels do.
    safe_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(scores - safe_max)
    row_sum = exp.sum(dim=-1, keepdim=True)
    probs = exp / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
    numels = 0
    if keep_prob < 1.0:
        keep = torch.rand(probs.shape, device=probs.device) < keep_prob
        probs = probs * keep / keep_prob
        numels = probs.numel()
    out = torch.matmul(probs, v32).to(query.dtype)
    softmax_max = safe_max.expand(b, n, sq, 8).contiguous().detach()
    softmax_sum = row_sum.expand(b, n, sq, 8).contiguous().detach()
    softmax_in = torch.empty(0, dtype=query.dtype, device=query.device)
    # seed and offset are the dropout generator's state on the device; there is none here.
    return _from_bnsd(out, input_layout), softmax_max, softmax_sum, softmax_in, 0, 0, numels


# --------------------------------------------------------------------------------------------------------------
# npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None,
#   Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None,
#   Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None,
#   Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, int? split_item=0,
#   int? group_type=None, int? group_list_type=0, int? act_type=0, int[]? tuning_config=None,
#   ScalarType? output_dtype=None) -> Tensor[]
#   (the unnamed overload; 2.7.1.post4 and later take `int? output_dtype` and add x_dtype, weight_dtype,
#   scale_dtype and per_token_scale_dtype, not emulated. The `.List` overload, group_list as int[], is not either.)
# group_type 2 (k-axis grouping): the eager operator of 2.5.1.post1 and 2.6.0 rejects it (their library carries
# "group_type currently only support -1 and 0"); 2.6.0.post3, the oldest release kernels-npu supports, and later
# releases have the k-split path.

_GMM_MAX_LIST = 128


def _group_ends(group_list: torch.Tensor, group_list_type: int) -> torch.Tensor:
    if group_list.dtype != torch.int64 or group_list.dim() != 1:
        raise RuntimeError(f"npu_grouped_matmul: group_list must be a 1-D int64 tensor, got {group_list.dtype} "
                           f"{tuple(group_list.shape)}")
    if group_list_type == 0:
        return group_list
    if group_list_type == 1:
        return torch.cumsum(group_list, dim=0)
    raise NotImplementedError(f"npu_grouped_matmul: group_list_type {group_list_type} is not emulated (int8 only)")


def npu_grouped_matmul(
    x: list[torch.Tensor],
    weight: list[torch.Tensor],
    *,
    bias: list[torch.Tensor] | None = None,
    scale: list[torch.Tensor] | None = None,
    offset: list[torch.Tensor] | None = None,
    antiquant_scale: list[torch.Tensor] | None = None,
    antiquant_offset: list[torch.Tensor] | None = None,
    per_token_scale: list[torch.Tensor] | None = None,
    group_list: torch.Tensor | None = None,
    activation_input: list[torch.Tensor] | None = None,
    activation_quant_scale: list[torch.Tensor] | None = None,
    activation_quant_offset: list[torch.Tensor] | None = None,
    split_item: int | None = 0,
    group_type: int | None = None,
    group_list_type: int | None = 0,
    act_type: int | None = 0,
    tuning_config: list[int] | None = None,
    output_dtype: int | None = None,
) -> list[torch.Tensor]:
    """``y_i = x_i @ w_i`` per group. group_type -1/None: lists pairwise; 0: rows of one x split by group_list
    over a 3-D weight ``[E, K, N]``; 2: the contraction dim of one ``x [K, M]`` split against ``weight [M, N]``,
    giving ``[E, K, N]``. No autograd (the real operator has none): results are detached.
    """
    _record("npu_grouped_matmul", x=x, weight=weight, group_list=group_list, split_item=split_item,
            group_type=group_type, group_list_type=group_list_type)
    for arg, value_ in (("bias", bias), ("scale", scale), ("offset", offset), ("antiquant_scale", antiquant_scale),
                        ("antiquant_offset", antiquant_offset), ("per_token_scale", per_token_scale),
                        ("activation_input", activation_input), ("activation_quant_scale", activation_quant_scale),
                        ("activation_quant_offset", activation_quant_offset), ("output_dtype", output_dtype)):
        if value_ is not None:
            raise NotImplementedError(f"npu_grouped_matmul: {arg} (bias/quantisation) is not emulated")
    if act_type not in (0, None):
        raise NotImplementedError("npu_grouped_matmul: fused activation (act_type) is not emulated")
    if not isinstance(x, (list, tuple)) or not isinstance(weight, (list, tuple)):
        raise TypeError("npu_grouped_matmul: x and weight must be lists of tensors")
    if not 1 <= len(x) <= _GMM_MAX_LIST or not 1 <= len(weight) <= _GMM_MAX_LIST:
        raise RuntimeError(f"npu_grouped_matmul: x and weight lists must hold 1..{_GMM_MAX_LIST} tensors")
    dtype = x[0].dtype
    for tensor in (*x, *weight):
        _check_float("npu_grouped_matmul", "x/weight", tensor)
        if tensor.dtype != dtype:
            raise RuntimeError("npu_grouped_matmul: x and weight tensors must share one dtype")
    if split_item not in (0, 1, 2, 3):
        raise RuntimeError(f"npu_grouped_matmul: split_item {split_item} must be 0, 1, 2 or 3")

    with torch.no_grad():
        if group_type in (None, -1):
            if len(x) != len(weight):
                raise RuntimeError("npu_grouped_matmul: without grouping, x and weight lists must have equal length")
            outs = [(xi.float() @ wi.float()).to(dtype) for xi, wi in zip(x, weight, strict=True)]
            return [torch.cat(outs, dim=0)] if split_item in (2, 3) else outs
        if group_list is None:
            raise RuntimeError(f"npu_grouped_matmul: group_type {group_type} needs group_list")
        if len(x) != 1 or len(weight) != 1:
            raise NotImplementedError("npu_grouped_matmul: grouped calls with tensor lists are not emulated")
        ends = _group_ends(group_list, group_list_type if group_list_type is not None else 0)
        xs, ws = x[0], weight[0]
        if group_type == 0:
            if split_item not in (2, 3):
                raise NotImplementedError("npu_grouped_matmul: m-axis grouping with split_item 0/1 is not emulated")
            if xs.dim() != 2 or ws.dim() != 3 or ws.shape[1] != xs.shape[1] or ws.shape[0] != ends.numel():
                raise RuntimeError(f"npu_grouped_matmul: group_type 0 needs x [M, K], weight [E, K, N] and E "
                                   f"groups; got x {tuple(xs.shape)}, weight {tuple(ws.shape)}, "
                                   f"{ends.numel()} groups")
            # Group of each row, without reading group_list on the host; rows past the last group stay zero.
            row_group = torch.searchsorted(ends, torch.arange(xs.shape[0], device=xs.device), right=True)
            x32, out = xs.float(), xs.new_zeros(xs.shape[0], ws.shape[2], dtype=torch.float32)
            for e in range(ws.shape[0]):
                out = torch.where((row_group == e).unsqueeze(-1), x32 @ ws[e].float(), out)
            return [out.to(dtype)]
        if group_type == 2:
            if split_item != 3:
                raise RuntimeError("npu_grouped_matmul: k-axis grouping (group_type 2) requires split_item 3")
            if xs.dim() != 2 or ws.dim() != 2 or xs.shape[1] != ws.shape[0]:
                raise RuntimeError(f"npu_grouped_matmul: group_type 2 needs x [K, M] and weight [M, N]; got "
                                   f"{tuple(xs.shape)}, {tuple(ws.shape)}")
            col_group = torch.searchsorted(ends, torch.arange(xs.shape[1], device=xs.device), right=True)
            x32, w32 = xs.float(), ws.float()
            outs = [(x32 * (col_group == e).unsqueeze(0)) @ w32 for e in range(ends.numel())]
            return [torch.stack(outs).to(dtype)]
        raise NotImplementedError(f"npu_grouped_matmul: group_type {group_type} is not emulated")


# --------------------------------------------------------------------------------------------------------------
# npu_moe_token_permute(Tensor tokens, Tensor indices, int? num_out_tokens=None, bool padded_mode=False)
#   -> (Tensor, Tensor)
# npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, Tensor? probs=None,
#   bool padded_mode=False, int[]? restore_shape=None) -> Tensor

_PERMUTE_MAX_TOPK = 512


def npu_moe_token_permute(
    tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: int | None = None, padded_mode: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort token copies by expert: ``(permuted_tokens [T*topk, H], sorted_indices int32 [T*topk])``."""
    _record("npu_moe_token_permute", tokens=tokens, indices=indices, num_out_tokens=num_out_tokens,
            padded_mode=padded_mode)
    if padded_mode:
        raise RuntimeError("npu_moe_token_permute: padded_mode must be False")
    _check_float("npu_moe_token_permute", "tokens", tokens)
    if tokens.dim() != 2:
        raise RuntimeError(f"npu_moe_token_permute: tokens must be 2-D (T, H), got {tuple(tokens.shape)}")
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() not in (1, 2):
        raise RuntimeError(f"npu_moe_token_permute: indices must be 1-D or 2-D int32/int64, got {indices.dtype} "
                           f"{tuple(indices.shape)}")
    if indices.shape[0] != tokens.shape[0]:
        raise RuntimeError("npu_moe_token_permute: indices and tokens must have the same number of tokens")
    topk = indices.shape[1] if indices.dim() == 2 else 1
    if topk > _PERMUTE_MAX_TOPK:
        raise RuntimeError(f"npu_moe_token_permute: topk {topk} > {_PERMUTE_MAX_TOPK}")
    sorted_indices = torch.argsort(indices.reshape(-1), stable=True).to(torch.int32)
    permuted = tokens.index_select(0, sorted_indices.long() // topk)
    if num_out_tokens is not None and num_out_tokens > 0:
        permuted = permuted[:num_out_tokens]
    return permuted, sorted_indices


def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape: list[int] | None = None,
) -> torch.Tensor:
    """Inverse of the permute: each token's ``topk`` rows, weighted by ``probs`` when given, summed: ``[T, H]``."""
    _record("npu_moe_token_unpermute", permuted_tokens=permuted_tokens, sorted_indices=sorted_indices, probs=probs,
            padded_mode=padded_mode, restore_shape=restore_shape)
    if padded_mode:
        raise RuntimeError("npu_moe_token_unpermute: padded_mode must be False")
    _check_float("npu_moe_token_unpermute", "permuted_tokens", permuted_tokens)
    if sorted_indices.dtype != torch.int32 or sorted_indices.dim() != 1:
        raise RuntimeError("npu_moe_token_unpermute: sorted_indices must be the 1-D int32 tensor from the permute")
    if permuted_tokens.dim() != 2 or permuted_tokens.shape[0] > sorted_indices.numel():
        raise RuntimeError(f"npu_moe_token_unpermute: permuted_tokens {tuple(permuted_tokens.shape)} does not match "
                           f"{sorted_indices.numel()} sorted indices")
    topk = 1
    if probs is not None:
        if probs.dtype != permuted_tokens.dtype:
            raise RuntimeError(f"npu_moe_token_unpermute: probs dtype {probs.dtype} must equal permuted_tokens "
                               f"dtype {permuted_tokens.dtype}")
        if probs.dim() != 2 or probs.numel() != sorted_indices.numel():
            raise RuntimeError(f"npu_moe_token_unpermute: probs {tuple(probs.shape)} must be (T, topk) with "
                               f"T*topk = {sorted_indices.numel()}")
        topk = probs.shape[1]
    hidden = permuted_tokens.shape[1]
    rows = permuted_tokens.shape[0]
    gathered = permuted_tokens.float().new_zeros(sorted_indices.numel(), hidden)
    gathered = gathered.index_copy(0, sorted_indices[:rows].long(), permuted_tokens.float())
    gathered = gathered.reshape(-1, topk, hidden)
    if probs is not None:
        gathered = gathered * probs.float().unsqueeze(-1)
    return gathered.sum(dim=1).to(permuted_tokens.dtype)
