"""Rotary position embedding, a *function* kernel: rerouted per attention instance, never patched globally.

transformers attention forwards call the module-level ``apply_rotary_pos_emb``. Patching that global (what
Liger does) changes every model of the family in the process; instead the core re-creates the attention's
class forward for one instance with that single name pointing at the kernel (see ``ReroutedForward``).

Three layouts of the same rotation reach a kernel of the rotate-half convention (variants ``full`` / ``partial``):

- ``half``: the function rotates the two halves of the rotated dims (Llama);
- ``interleaved``: it rotates adjacent pairs and leaves them in place (GLM, ERNIE 4.5, Helium): the adapter
  de-interleaves q and k, rotates, and interleaves the result back;
- ``deinterleave``: it rotates adjacent pairs and returns them de-interleaved (DeepSeek's
  ``apply_rotary_pos_emb_interleave``, multi-head latent attention with ``rope_interleave``): the adapter
  de-interleaves q and k and rotates.

Multi-head latent attention (DeepSeek V2/V3, MiniCPM3, ...) has no ``head_dim``: it hands the function only the
rotated part of each head (``qk_rope_head_dim`` wide), which the probe then takes as the width.

A forward may name the function and still not call it on a given layer: Flint's full-attention layers and
SmolLM3's NoPE layers skip the rotation (``if self.sliding_window is not None``, ``if self.use_rope``). The matcher
runs the attention's own forward once, the function counted, and declines a layer that never calls it, so the
report never shows a rotary kernel bound where no rotation happens.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._types import Decline
from .._types import Match
from . import _reference
from ._context import MatchContext
from ._context import close
from ._context import param_dtype
from ._context import plain_class_forward
from ._context import reroute_blocker


__all__ = ["GLOBAL_NAME", "adapt_rotary", "match_rotary"]

GLOBAL_NAME = "apply_rotary_pos_emb"
# DeepSeek's pair-wise form, called instead where the configuration sets rope_interleave.
INTERLEAVE_NAME = "apply_rotary_pos_emb_interleave"


def _deinterleave(x: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """``x`` with its first ``rotary_dim`` dims reordered from adjacent pairs to halves (evens, then odds).

    Example:
        >>> _deinterleave(torch.arange(6.0), 4).tolist()
        [0.0, 2.0, 1.0, 3.0, 4.0, 5.0]
    """
    rot = x[..., :rotary_dim].unflatten(-1, (rotary_dim // 2, 2)).transpose(-1, -2).flatten(-2)
    return torch.cat((rot, x[..., rotary_dim:]), dim=-1) if x.shape[-1] > rotary_dim else rot


def _interleave(x: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """The inverse of :func:`_deinterleave`.

    Example:
        >>> _interleave(_deinterleave(torch.arange(6.0), 4), 4).tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    """
    rot = x[..., :rotary_dim].unflatten(-1, (2, rotary_dim // 2)).transpose(-1, -2).flatten(-2)
    return torch.cat((rot, x[..., rotary_dim:]), dim=-1) if x.shape[-1] > rotary_dim else rot


def _interleaved_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    # GLM-style: the function receives rotate-half formatted cos/sin and re-pairs them itself.
    half = cos.shape[-1] // 2
    cos_i = cos[..., :half].repeat_interleave(2, dim=-1)
    sin_i = sin[..., :half].repeat_interleave(2, dim=-1)
    return _reference.rotary(q, k, cos_i, sin_i, style="interleaved")


def _typed(pair: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, cos: torch.Tensor, policy: str
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotary result in the dtype the module's function returns (see ``_output_dtype_policy``)."""
    dtype = q.dtype if policy == "query" else torch.promote_types(q.dtype, cos.dtype)
    return pair[0].to(dtype), pair[1].to(dtype)


def _unsqueeze_position(fn: Callable[..., Any]) -> tuple[int | None, int]:
    params = list(inspect.signature(fn).parameters.values())
    for index, param in enumerate(params):
        if param.name == "unsqueeze_dim":
            default = param.default if param.default is not inspect.Parameter.empty else 1
            return (index - 4 if param.kind is not param.KEYWORD_ONLY else None), int(default)
    return None, 1


def _output_dtype_policy(fn: Callable[..., Any], device: torch.device, ctx: MatchContext) -> str:
    """How ``fn`` types its outputs when cos/sin are float32 and q/k are not: "query" or "promoted".

    Most rotary embeddings hand cos/sin over in the activations' dtype, but some (OLMo-2, OLMo-3) keep them in
    float32 and cast the result back to q's dtype, while the plain function promotes. A kernel's output is cast
    to what the module's own function would return, so the next layer always sees the dtype it expects.
    """
    gen = ctx.generator(device)
    q = ctx.randn(1, 1, 2, 4, device=device, dtype=torch.bfloat16, gen=gen)
    cos = ctx.randn(1, 2, 4, device=device, dtype=torch.float32, gen=gen)
    try:
        with torch.no_grad():
            out = fn(q, q, cos, cos)
    except Exception:  # noqa: BLE001 - cannot tell: assume the plain promoting math
        return "promoted"
    first = out[0] if isinstance(out, tuple) and out else None
    return "query" if isinstance(first, torch.Tensor) and first.dtype == q.dtype else "promoted"


def _model_cos_dtype(ctx: MatchContext, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the model's rotary embedding really produces for activations of ``dtype`` (float32 or ``dtype``)."""
    embeddings = ctx.position_embeddings(torch.zeros(1, 2, 8, device=device, dtype=dtype),
                                         torch.arange(2, device=device)[None])
    return embeddings[0].dtype if embeddings is not None and embeddings[0].is_floating_point() else dtype


def _one_angle_per_pair(ctx: MatchContext, rotary_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the model's rotary embedding hands over cos/sin with one entry per rotated pair (``rotary_dim / 2``
    wide, gpt-oss) rather than the rotate-half convention's duplicated halves (``rotary_dim`` wide)."""
    embeddings = ctx.position_embeddings(torch.zeros(1, 2, 8, device=device, dtype=dtype),
                                         torch.arange(2, device=device)[None])
    return embeddings is not None and embeddings[0].shape[-1] * 2 == rotary_dim


def _one_tensor_at_a_time(fn: Callable[..., Any]) -> list[str] | None:
    """The leading parameter names of a rotary function that takes one tensor and then cos/sin (DeepSeek-V4's
    ``apply_rotary_pos_emb(x, cos, sin)``), or None for the kind's ``(q, k, cos, sin)``."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names[:3] if len(names) >= 2 and names[1] == "cos" else None


def match_rotary(module: nn.Module, name: str, ctx: MatchContext) -> Match | Decline | None:
    """Attention modules whose forward applies ``apply_rotary_pos_emb`` in the rotate-half form."""
    code = getattr(plain_class_forward(module), "__code__", None)
    if code is None or not {GLOBAL_NAME, INTERLEAVE_NAME} & set(code.co_names):
        return None
    return ctx.verdict("rotary_embedding", module, lambda: _classify_rotary(module, ctx))


def _called_name(module: nn.Module) -> str | Decline:
    """Which rotary function this instance's forward calls (DeepSeek's forward names both; its config picks)."""
    names = set(plain_class_forward(module).__code__.co_names)
    if INTERLEAVE_NAME not in names:
        return GLOBAL_NAME
    if GLOBAL_NAME not in names:
        return INTERLEAVE_NAME
    choice = getattr(getattr(module, "config", None), "rope_interleave", None)
    if not isinstance(choice, bool):
        return Decline("rotary_embedding", f"forward calls {GLOBAL_NAME} or {INTERLEAVE_NAME}, and no "
                                           "config.rope_interleave says which")
    return INTERLEAVE_NAME if choice else GLOBAL_NAME



_CALL_PROBE_TOKENS = 5


def _input_width(module: nn.Module) -> int | None:
    """The width of the hidden states an attention module takes: its config's ``hidden_size``, else the input
    size of its first linear projection (every projection of an attention reads the hidden states)."""
    width = getattr(getattr(module, "config", None), "hidden_size", None)
    if isinstance(width, int) and not isinstance(width, bool):
        return width
    first = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
    return first.in_features if first is not None else None


def _never_called(module: nn.Module, ctx: MatchContext, global_name: str, dtype: torch.dtype,
                  device: torch.device) -> bool:
    """Whether this instance's forward, run on a causal probe batch with position embeddings, never calls
    ``global_name``: True only when the forward ran and did not; False when it called it or could not be run with
    the inputs a decoder layer hands an attention (a sub-module taking other tensors, say), in which case the
    function's presence in the code is what the match rests on, as for any forward that calls it."""
    forward = plain_class_forward(module)
    original = forward.__globals__[global_name]
    calls: list[None] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(None)
        return original(*args, **kwargs)

    # The class forward over a copy of its module's globals with the one name counted: no other instance and no
    # other thread sees the counter (the modeling module itself is never changed).
    probed = types.FunctionType(forward.__code__, {**forward.__globals__, global_name: counted}, forward.__name__,
                                forward.__defaults__, forward.__closure__)
    probed.__kwdefaults__ = forward.__kwdefaults__
    width = _input_width(module)
    if width is None:
        return False
    params = inspect.signature(forward).parameters
    gen = ctx.generator(device)
    x = ctx.randn(1, _CALL_PROBE_TOKENS, width, device=device, dtype=dtype, gen=gen)
    position_ids = torch.arange(_CALL_PROBE_TOKENS, device=device)[None]
    kwargs: dict[str, Any] = {}
    if "position_embeddings" in params:
        embeddings = ctx.position_embeddings(x, position_ids)
        if embeddings is None:
            return False
        kwargs["position_embeddings"] = embeddings
    if "attention_mask" in params:
        kwargs["attention_mask"] = None  # causal attention without padding
    if "position_ids" in params:
        kwargs["position_ids"] = position_ids
    try:
        ctx.run_probe(module, lambda: probed(module, x, **kwargs))
    except Exception:  # noqa: BLE001 - inputs of another form: the code's call of the function is the evidence
        return False
    return not calls


def _head_and_rotary_dims(module: nn.Module, ctx: MatchContext) -> tuple[int, int] | Decline:
    """The attention's head dim and the rotated part of it, from the model's one rotary embedding."""
    dims = ctx.rotary_dims()
    if len(dims) != 1:
        return Decline("rotary_embedding",
                       f"the model's rotary embeddings rotate {sorted(dims) or 'no'} dims; need exactly one size")
    rotary_dim = next(iter(dims))
    head_dim = getattr(module, "head_dim", None)
    if not isinstance(head_dim, int):
        # Multi-head latent attention: no head_dim; the function gets only the rotated part of each head.
        head_dim = rotary_dim
    if rotary_dim > head_dim or rotary_dim % 2:
        return Decline("rotary_embedding", f"rotary dim {rotary_dim} does not fit head_dim {head_dim}")
    return head_dim, rotary_dim


def _classify_rotary(module: nn.Module, ctx: MatchContext) -> Match | Decline:
    global_name = _called_name(module)
    if isinstance(global_name, Decline):
        return global_name
    blocker = reroute_blocker(module, global_name)
    if blocker:
        return Decline("rotary_embedding", blocker)
    fn = plain_class_forward(module).__globals__[global_name]
    dims = _head_and_rotary_dims(module, ctx)
    if isinstance(dims, Decline):
        return dims
    head_dim, rotary_dim = dims
    dtype = param_dtype(module) or torch.float32
    device = next(module.parameters()).device if any(True for _ in module.parameters()) else torch.device("cpu")
    if device.type == "meta":
        return Decline("rotary_embedding", "parameters are on the meta device; the math cannot be verified")
    if _never_called(module, ctx, global_name, dtype, device):
        return Decline("rotary_embedding", f"this layer's forward does not call {global_name} (probed with position "
                                           "embeddings given): it rotates nothing here (a layer without positional "
                                           "encoding, as Flint's full-attention or SmolLM3's NoPE layers)")
    single = _one_tensor_at_a_time(fn)
    if single is not None:
        return Decline("rotary_embedding", f"{global_name} rotates one tensor at a time ({', '.join(single)}); the "
                                           "kind's kernels rotate q and k together, (q, k, cos, sin)")
    output_dtype = _output_dtype_policy(fn, device, ctx)
    cos_dtype = _model_cos_dtype(ctx, dtype, device)
    per_pair = _one_angle_per_pair(ctx, rotary_dim, dtype, device)
    params = {"global_name": global_name, "head_dim": head_dim, "rotary_dim": rotary_dim, "output_dtype": output_dtype}
    if per_pair:
        params["angles"] = "per_pair"
    # Some attentions pass the whole head (the function rotates part of it), others slice first and pass only
    # the rotated part (Phi); probe both input widths. cos/sin come in the dtype the model's rotary embedding
    # really produces, so the probe sees the forward's own rounding and output dtype.
    failure = ""
    for width in dict.fromkeys((head_dim, rotary_dim)):
        gen = ctx.generator(device)
        q = ctx.randn(1, 2, 5, width, device=device, dtype=dtype, gen=gen)
        k = ctx.randn(1, 1, 5, width, device=device, dtype=dtype, gen=gen)
        angles = ctx.randn(1, 5, rotary_dim // 2, device=device, dtype=torch.float32, gen=gen) * 3
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos().to(cos_dtype), emb.sin().to(cos_dtype)
        # What the function is handed: the convention's duplicated halves, or one angle per pair (gpt-oss), which
        # is the same rotation of the halves with cos/sin not duplicated.
        given = (cos[..., : rotary_dim // 2], sin[..., : rotary_dim // 2]) if per_pair else (cos, sin)
        with torch.no_grad():
            try:
                # On copies: a function may rotate q and k in place (Liger-Kernel's rope writes into them), and the
                # references below, like the kernel trial that replays this probe, read the unrotated inputs.
                actual = fn(q.clone(), k.clone(), *given)
            except Exception as exc:  # noqa: BLE001 - an unusual signature or layout: leave it alone
                failure = f"probe of {global_name} raised {type(exc).__name__}: {exc}"
                continue
            if not (isinstance(actual, tuple) and len(actual) == 2):
                return Decline("rotary_embedding", f"{global_name} does not return (q, k)")
            ctx.note_probe(module, "rotary_embedding", (q, k, *given), {}, actual)
            layouts = {"half": _reference.rotary(q, k, cos, sin)}
            if not per_pair:
                layouts["interleaved"] = _interleaved_reference(q, k, cos, sin)
                layouts["deinterleave"] = _reference.rotary(_deinterleave(q, rotary_dim), _deinterleave(k, rotary_dim),
                                                            cos, sin)
        variant = "full" if rotary_dim == width else "partial"
        for layout, expected in layouts.items():
            if all(close(a, e, dtype) for a, e in zip(actual, _typed(expected, q, cos, output_dtype), strict=True)):
                how = {"half": "rotate-half", "interleaved": "pair-wise (interleaved, re-paired by the adapter)",
                       "deinterleave": "pair-wise, returned de-interleaved (de-interleaved by the adapter)"}[layout]
                extra = {} if layout == "half" else {"layout": layout}
                angles_note = (" (cos/sin one angle per pair, duplicated by the adapter into the rotate-half "
                               "convention's halves)") if per_pair else ""
                return Match("rotary_embedding", variant, {**params, "input_dim": width, **extra},
                             evidence=f"probe of {global_name} matches {how} rotary over {rotary_dim}/{width} dims"
                                      f"{angles_note}")
        failure = ""
    if failure:
        return Decline("rotary_embedding", failure)
    return Decline("rotary_embedding", "probe output matches no rotary layout (rotate-half, pair-wise in place, "
                                       "pair-wise returned de-interleaved): the function computes other math")


def adapt_rotary(module: nn.Module, match: Match, impl: Callable[..., Any], options: dict) -> Callable[..., Any]:
    """The replacement for ``apply_rotary_pos_emb`` inside this module's forward, same call signature."""
    original = plain_class_forward(module).__globals__[match.params["global_name"]]
    position, default = _unsqueeze_position(original)
    policy = match.params.get("output_dtype", "promoted")
    layout = match.params.get("layout", "half")
    rotary_dim = match.params["rotary_dim"]
    per_pair = match.params.get("angles") == "per_pair"

    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if "unsqueeze_dim" in kwargs:
            unsqueeze_dim = kwargs["unsqueeze_dim"]
        elif position is not None and len(args) > position:
            unsqueeze_dim = args[position]
        else:
            unsqueeze_dim = default
        if per_pair:  # one angle per pair (gpt-oss): the same rotation, cos/sin as the convention's halves
            cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        if layout == "half":
            q_out, k_out = impl(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        else:
            # The same rotation on pairs laid out as halves: one copy of q and k each way, the kernel in between.
            q_out, k_out = impl(_deinterleave(q, rotary_dim), _deinterleave(k, rotary_dim), cos, sin,
                                unsqueeze_dim=unsqueeze_dim)
            if layout == "interleaved":
                q_out, k_out = _interleave(q_out, rotary_dim), _interleave(k_out, rotary_dim)
        # Kernels return the promoted dtype of q and cos/sin (the plain function's math); a function that casts
        # back to q's dtype (float32 cos/sin, OLMo-2) gets exactly that here.
        if policy == "query" and q_out.dtype != q.dtype:
            q_out, k_out = q_out.to(q.dtype), k_out.to(k.dtype)
        return q_out, k_out

    return apply_rotary_pos_emb
