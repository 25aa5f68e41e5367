"""A training step's floor from measured parts: what the step would take if every part ran at the speed this machine
reaches for it alone.

For a dense decoder-only causal LM (Llama, Qwen3, Gemma-3 shapes) of a transformers config, ``batch`` sequences of
``seq`` tokens, the step is enumerated and each part timed here, on this device:

- **GEMMs**: every linear layer's three products (forward ``x W^T``, input gradient ``dy W``, weight gradient
  ``dy^T x``), per decoder layer and for ``lm_head``, each distinct ``(m, n, k)`` timed alone with ``torch.mm`` in
  bf16 (the second operand transposed, as ``F.linear`` passes its weight), or ``torch._scaled_mm`` on e4m3
  operands (tensor-wise scales, or row-wise for ``rowwise``) for the FP8 projections; with activation
  checkpointing the decoder layers' forward products count twice.
- **attention**: ``F.scaled_dot_product_attention`` forward and backward as transformers' sdpa path calls it: causal
  with ``enable_gqa`` where the layer has no mask, an explicit sliding-window mask over repeated key/value heads
  where it has one (Gemma-3's local layers), on whichever backend PyTorch picks for that call, as in the model.
- **memory-bound work** at the bandwidth of a large device copy (bytes read + written per second), with the
  fewest bytes each part must move in bf16: RMSNorms (forward reads x and writes y, backward reads dy and x and
  writes dx), residual adds (3 tensors each way), rotary embeddings (q and k read and written each way), the gated
  activation (forward 3 tensors of the MLP width, backward 5), the embedding (gather; backward zero-fills and
  scatters into its gradient), the loss (the logits read and their gradient written once), and for FP8 the casts
  (each operand of a projection read twice, for its scale and its cast, and written in FP8 in both layouts).
- **the optimizer**: AdamW reads parameter, gradient and both moments and writes parameter and moments (7
  parameter-sized tensors) at the same bandwidth.
- **exposed communication** (FSDP2, given ``comm``): the first unit's all-gather and the last unit's
  reduce-scatter, plus whatever of each layer unit's all-gathers and reduce-scatter its own compute cannot hide.

Launch gaps, kernels slower than their part's floor, extra copies (layout changes, dtype casts of the loss) and
host time are what the step spends above this. MoE shapes are not modelled (their rows carry the reason).

Each distinct shape is timed once per :class:`PartTimer` (and per cache file, which a benchmark run shares between
its processes). On the CPU the same code runs with wall-clock timing: a smoke test, not a floor worth reading.

Example:
    >>> import torch, transformers
    >>> config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
    >>> floor = step_floor(config, batch=1, seq=32, timer=PartTimer(torch.device("cpu"), repeats=1))
    >>> sorted(floor["breakdown_ms"])
    ['attention', 'communication_exposed', 'fp8_casts', 'gemm', 'memory_bound', 'optimizer']
    >>> floor["floor_ms"] > 0
    True
"""

from __future__ import annotations

import json
import math
import pathlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


BF16 = 2  # bytes per element of activations, weights, gradients and AdamW moments (bf16 parameters)
FP8 = 1
# Model types with per-head RMSNorms on q and k (Qwen3, Gemma-3) and with four norms per layer (Gemma-3).
QK_NORM = {"qwen3", "gemma3_text"}
FOUR_NORMS = {"gemma3_text"}


@dataclass(frozen=True)
class Shape:
    """The sizes of a dense decoder-only causal LM that set its step's work."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool
    norms_per_layer: int
    # The sliding window of each decoder layer, None for global causal attention.
    windows: tuple[int | None, ...]

    @property
    def layers(self) -> int:
        return len(self.windows)

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, in_features, out_features) of one decoder layer's projections."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return [("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h), ("gate_proj", h, i),
                ("up_proj", h, i), ("down_proj", i, h)]

    def layer_parameters(self) -> int:
        norms = self.norms_per_layer * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return sum(k * n for _, k, n in self.linears()) + norms

    def parameters(self) -> int:
        embed = self.vocab * self.hidden
        return self.layers * self.layer_parameters() + embed * (1 if self.tied else 2) + self.hidden


def shape_of(config: Any) -> Shape | str:
    """The :class:`Shape` of a transformers config, or why its step is not modelled (a MoE model)."""
    if any(getattr(config, key, None) for key in ("num_experts", "num_local_experts")):
        return "MoE shapes are not modelled: the experts' grouped GEMMs depend on the routing"
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    windows = tuple(window if kind == "sliding_attention" else None for kind in types)
    return Shape(hidden=config.hidden_size, intermediate=config.intermediate_size, heads=heads,
                 kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                 vocab=config.vocab_size, tied=bool(getattr(config, "tie_word_embeddings", False)),
                 qk_norm=config.model_type in QK_NORM, norms_per_layer=4 if config.model_type in FOUR_NORMS else 2,
                 windows=windows)


class PartTimer:
    """Times the floor's parts on ``device``, each distinct one once; ``cache`` (a JSON file) keeps the timings
    for other processes of the same run.

    Example:
        >>> timer = PartTimer(torch.device("cpu"), repeats=1)
        >>> timer.gemm_ms(64, 64, 64, "bf16") > 0
        True
    """

    def __init__(self, device: torch.device, *, cache: pathlib.Path | None = None, repeats: int = 5,
                 target_ms: float = 20.0) -> None:
        self.device = device
        self.cache_path = cache
        self.repeats = repeats
        self.target_ms = target_ms
        self.times: dict[str, Any] = {}
        if cache is not None and cache.is_file():
            self.times = json.loads(cache.read_text())

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time_ms(self, fn: Callable[[], object], *, calls: int | None = None) -> float:
        """Median over ``repeats`` of the mean milliseconds per call of a loop of calls long enough to hide the
        launches (about ``target_ms`` each, or ``calls``: collectives need the same count on every rank), after
        two untimed calls."""
        for _ in range(2):
            fn()
        self._sync()
        if calls is None:
            start = time.perf_counter()
            fn()
            self._sync()
            once = max(time.perf_counter() - start, 1e-6) * 1e3
            calls = max(1, min(200, math.ceil(self.target_ms / once)))
        samples = []
        for _ in range(self.repeats):
            self._sync()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            self._sync()
            samples.append((time.perf_counter() - start) * 1e3 / calls)
        return sorted(samples)[len(samples) // 2]

    def _cached(self, key: str, measure: Callable[[], Any]) -> Any:
        if key not in self.times:
            self.times[key] = measure()
            if self.cache_path is not None:
                self.cache_path.write_text(json.dumps(self.times, indent=1))
        return self.times[key]

    def gemm_ms(self, m: int, n: int, k: int, precision: str) -> float:
        """One ``(m, k) x (k, n)`` product: ``torch.mm`` in bf16, ``torch._scaled_mm`` for ``tensorwise`` /
        ``rowwise`` (e4m3 operands, the second column-major as cuBLAS needs, bf16 output)."""

        def measure() -> float:
            a = torch.randn(m, k, device=self.device, dtype=torch.bfloat16)
            b = torch.randn(n, k, device=self.device, dtype=torch.bfloat16)
            if precision == "bf16":
                # As F.linear multiplies: the second operand a transposed view of a row-major (n, k) weight.
                return self._time_ms(lambda: torch.mm(a, b.t()))
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
            if precision == "rowwise":
                sa = torch.ones(m, 1, device=self.device)
                sb = torch.ones(1, n, device=self.device)
            else:
                sa = sb = torch.ones((), device=self.device)
            return self._time_ms(lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))

        return self._cached(f"gemm {m}x{n}x{k} {precision}", measure)

    def attention_ms(self, batch: int, heads: int, kv_heads: int, seq: int, head_dim: int,
                     window: int | None) -> tuple[float, float]:
        """(forward, backward) milliseconds of sdpa as transformers calls it for this layer (see the module)."""

        def measure() -> list[float]:
            def tensor(h: int) -> torch.Tensor:
                return torch.randn(batch, h, seq, head_dim, device=self.device, dtype=torch.bfloat16,
                                   requires_grad=True)

            q, k, v = tensor(heads), tensor(kv_heads), tensor(kv_heads)
            if window is None:
                def forward() -> torch.Tensor:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
            else:
                rows = torch.arange(seq, device=self.device)
                distance = rows[:, None] - rows[None, :]
                mask = ((distance >= 0) & (distance < window))[None, None]
                groups = heads // kv_heads

                def forward() -> torch.Tensor:
                    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1),
                                                          v.repeat_interleave(groups, 1), attn_mask=mask)

            grad = torch.randn(batch, heads, seq, head_dim, device=self.device, dtype=torch.bfloat16)
            with torch.no_grad():
                fwd = self._time_ms(forward)
            both = self._time_ms(lambda: torch.autograd.backward(forward(), grad))
            return [fwd, max(both - fwd, 0.0)]

        fwd, bwd = self._cached(f"sdpa b{batch} h{heads}/{kv_heads} s{seq} d{head_dim} w{window}", measure)
        return fwd, bwd

    def fsdp_comm_ms(self, parameters: int) -> tuple[float, float]:
        """(all-gather, reduce-scatter) milliseconds of an FSDP2 unit of ``parameters`` bf16 parameters over the
        default process group, as FSDP2 issues them (one flat buffer each). Every rank must call it alike."""
        import torch.distributed as dist

        def measure() -> list[float]:
            world = dist.get_world_size()
            shard = math.ceil(parameters / world)
            local = torch.empty(shard, device=self.device, dtype=torch.bfloat16)
            whole = torch.empty(shard * world, device=self.device, dtype=torch.bfloat16)
            gather = self._time_ms(lambda: dist.all_gather_into_tensor(whole, local), calls=10)
            scatter = self._time_ms(lambda: dist.reduce_scatter_tensor(local, whole), calls=10)
            return [gather, scatter]

        gather, scatter = self._cached(f"fsdp comm {parameters}", measure)
        return gather, scatter

    def bandwidth_GBps(self) -> float:
        """Bytes read + written per second by a copy of 1 GiB (64 MiB on the CPU)."""

        def measure() -> float:
            size = (1 << 30) if self.device.type == "cuda" else (64 << 20)
            src = torch.empty(size, dtype=torch.uint8, device=self.device)
            dst = torch.empty_like(src)
            return 2 * size / (self._time_ms(lambda: dst.copy_(src)) * 1e-3) / 1e9

        return self._cached("copy bandwidth", measure)


def _products(k: int, n: int, tokens: int, forwards: int) -> list[tuple[int, int, int, int]]:
    """(m, n, k, count) of one linear layer's products per step: forward x (T, K) times W^T (K, N), ``forwards``
    times; input gradient dy (T, N) times W (N, K); weight gradient dy^T (N, T) times x (T, K)."""
    return [(tokens, n, k, forwards), (tokens, k, n, 1), (n, k, tokens, 1)]


def _gemms(shape: Shape, tokens: int, *, fp8: str | None, lm_head_fp8: bool,
           checkpointing: bool) -> tuple[Counter[tuple[int, int, int, str]], Counter[tuple[int, int, int, str]]]:
    """(m, n, k, precision) -> products per step, of the whole step and of one decoder layer."""
    layer: Counter[tuple[int, int, int, str]] = Counter()
    for _, k, n in shape.linears():
        for m, n_, k_, count in _products(k, n, tokens, 2 if checkpointing else 1):
            layer[(m, n_, k_, fp8 or "bf16")] += count
    whole = Counter({key: count * shape.layers for key, count in layer.items()})
    for m, n_, k_, count in _products(shape.hidden, shape.vocab, tokens, 1):
        whole[(m, n_, k_, fp8 if fp8 and lm_head_fp8 else "bf16")] += count
    return whole, layer


def _memory_bytes(shape: Shape, tokens: int, *, fp8: str | None, lm_head_fp8: bool,
                  checkpointing: bool) -> tuple[dict[str, float], float]:
    """Bytes per step of each memory-bound part of the whole step (see the module), and of one decoder layer."""
    t, h, i, v = tokens, shape.hidden, shape.intermediate, shape.vocab
    qk = (shape.heads + shape.kv_heads) * shape.head_dim
    forwards = 2 if checkpointing else 1
    per_layer = {
        # forward x -> y (2 tensors), backward dy, x -> dx (3); the q/k norms over the heads likewise.
        "norms": (forwards * 2 + 3) * t * (shape.norms_per_layer * h + (qk if shape.qk_norm else 0)),
        # two residual adds: forward a + b -> c, backward the gradient sum of both branches.
        "residual_adds": 2 * (forwards * 3 + 3) * t * h,
        "rotary": (forwards * 2 + 2) * t * qk,
        "gated_activation": (forwards * 3 + 5) * t * i,
    }
    per_layer = {key: value * BF16 for key, value in per_layer.items()}
    whole = {key: value * shape.layers for key, value in per_layer.items()}
    whole["norms"] += 5 * t * h * BF16  # the final norm
    # Gather forward; backward zero-fills the table's gradient and scatters the rows into it (tied: added to
    # lm_head's weight gradient, a read of two tables and a write of one more).
    whole["embedding"] = (2 * t * h + v * h + 3 * t * h + (3 * v * h if shape.tied else 0)) * BF16
    whole["loss"] = 2 * t * v * BF16
    casts = 0.0
    if fp8:
        def cast(k: int, n: int) -> float:
            # x (T, K), W (N, K), dy (T, N): read for the scale, read for the cast, written in both layouts.
            return (2 * BF16 + 2 * FP8) * (t * k + n * k + t * n)

        per_layer_casts = sum(cast(k, n) for _, k, n in shape.linears())
        per_layer["fp8_casts"] = per_layer_casts
        casts = shape.layers * per_layer_casts + (cast(h, v) if lm_head_fp8 else 0.0)
    whole["fp8_casts"] = casts
    return whole, sum(per_layer.values())


def step_floor(config: Any, *, batch: int, seq: int, timer: PartTimer, fp8: str | None = None,
               lm_head_fp8: bool = False, checkpointing: bool = False,
               comm: Callable[[int], tuple[float, float]] | None = None, layers_per_unit: int = 1,
               reshard_after_forward: bool = True) -> dict[str, Any]:
    """The floor of one training step of ``config`` (a transformers config) at ``batch`` x ``seq`` tokens.

    ``fp8`` (``"tensorwise"`` / ``"rowwise"``): the decoder layers' projections (and ``lm_head`` with
    ``lm_head_fp8``) as FP8 products, plus their casts; ``checkpointing``: the decoder layers' forward runs twice.
    ``comm(parameters) -> (all_gather_ms, reduce_scatter_ms)`` of an FSDP2 unit of that many bf16 parameters adds
    the exposed communication of one unit per ``layers_per_unit`` decoder layers and the root (embedding, final
    norm, lm_head); with ``reshard_after_forward`` each layer unit is gathered again for its backward.

    Returns ``floor_ms``, ``breakdown_ms`` (gemm, attention, memory_bound, fp8_casts, optimizer,
    communication_exposed), ``memory_bound_GB`` per part, ``hbm_GBps``, ``gemms`` (each distinct product: count,
    milliseconds, TFLOP/s) and ``attention`` (per window kind); for a MoE config ``floor_ms`` None and the reason.
    """
    shape = shape_of(config)
    if isinstance(shape, str):
        return {"floor_ms": None, "not_modelled": shape}
    tokens = batch * seq
    gemms = []
    gemm_ms = 0.0
    whole_gemms, layer_gemms = _gemms(shape, tokens, fp8=fp8, lm_head_fp8=lm_head_fp8, checkpointing=checkpointing)
    for (m, n, k, precision), count in sorted(whole_gemms.items()):
        ms = timer.gemm_ms(m, n, k, precision)
        gemm_ms += ms * count
        gemms.append({"m": m, "n": n, "k": k, "precision": precision, "count": count, "ms_each": round(ms, 4),
                      "TFLOPs": round(2 * m * n * k / (ms * 1e-3) / 1e12, 1)})
    attention = []
    attention_ms = 0.0
    layer_attention: list[float] = []
    for window, layers in sorted(Counter(shape.windows).items(), key=lambda item: item[0] or 0):
        fwd, bwd = timer.attention_ms(batch, shape.heads, shape.kv_heads, seq, shape.head_dim, window)
        each = fwd * (2 if checkpointing else 1) + bwd
        attention_ms += each * layers
        layer_attention += [each] * layers
        attention.append({"window": window, "layers": layers, "forward_ms": round(fwd, 4),
                          "backward_ms": round(bwd, 4)})
    bandwidth = timer.bandwidth_GBps()
    memory, layer_memory_bytes = _memory_bytes(shape, tokens, fp8=fp8, lm_head_fp8=lm_head_fp8,
                                               checkpointing=checkpointing)
    casts_ms = memory.pop("fp8_casts") / (bandwidth * 1e6)
    memory_ms = sum(memory.values()) / (bandwidth * 1e6)
    optimizer_ms = 7 * BF16 * shape.parameters() / (bandwidth * 1e6)
    exposed = 0.0
    if comm is not None:
        # Each layer unit's compute: its GEMMs, attention and memory-bound work (the optimizer runs after).
        layer_gemm_ms = sum(timer.gemm_ms(m, n, k, p) * count for (m, n, k, p), count in layer_gemms.items())
        root_ag, root_rs = comm(shape.parameters() - shape.layers * shape.layer_parameters())
        exposed = root_ag + root_rs
        for start in range(0, shape.layers, layers_per_unit):
            size = min(layers_per_unit, shape.layers - start)
            ag, rs = comm(size * shape.layer_parameters())
            compute = size * (layer_gemm_ms + layer_memory_bytes / (bandwidth * 1e6)) + sum(
                layer_attention[start:start + size])
            exposed += max(0.0, ag * (2 if reshard_after_forward else 1) + rs - compute)
    breakdown = {"gemm": gemm_ms, "attention": attention_ms, "memory_bound": memory_ms, "fp8_casts": casts_ms,
                 "optimizer": optimizer_ms, "communication_exposed": exposed}
    return {
        "floor_ms": round(sum(breakdown.values()), 3),
        "breakdown_ms": {key: round(value, 3) for key, value in breakdown.items()},
        "memory_bound_GB": {key: round(value / 1e9, 3) for key, value in memory.items()},
        "hbm_GBps": round(bandwidth, 1),
        "parameters": shape.parameters(),
        "fp8": fp8, "lm_head_fp8": lm_head_fp8, "checkpointing": checkpointing,
        "gemms": gemms,
        "attention": attention,
    }


def attach(row: dict[str, Any], floor: dict[str, Any] | None) -> None:
    """Add a floor to a benchmark row with ``step_ms``: ``floor_ms``, ``floor_fraction`` (floor / step),
    ``floor`` (the breakdown) and, where the row has a one-step profile, where the rest goes: ``gpu_idle_ms``
    (the step's time with no kernel running: host-bound) and ``kernels_above_floor_ms``.

    Example:
        >>> row = {"step_ms": 10.0, "profile_one_step": [{"kernel": "<all kernels>", "gpu_ms": 9.0}]}
        >>> attach(row, {"floor_ms": 8.0, "breakdown_ms": {}})
        >>> row["floor_fraction"], row["gpu_idle_ms"], row["kernels_above_floor_ms"]
        (0.8, 1.0, 1.0)
    """
    if floor is None or not row.get("step_ms"):
        return
    row["floor"] = floor
    if floor.get("floor_ms") is None:
        return
    row["floor_ms"] = floor["floor_ms"]
    row["floor_fraction"] = round(floor["floor_ms"] / row["step_ms"], 3)
    profile = row.get("profile_one_step")
    kernels = profile.get("kernels") if isinstance(profile, dict) else profile
    if kernels:
        busy = next((r["gpu_ms"] for r in kernels if r["kernel"] == "<all kernels>"), None)
        if busy is not None:
            row["gpu_idle_ms"] = round(max(row["step_ms"] - busy, 0.0), 3)
            row["kernels_above_floor_ms"] = round(busy - floor["floor_ms"], 3)
