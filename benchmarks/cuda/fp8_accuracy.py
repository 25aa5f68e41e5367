"""Does FP8 training keep the loss? bf16 against kernels-cuda's FP8 linear kernels on a learnable synthetic task.

The task: sequences drawn from a fixed random Markov chain over ``--vocab`` tokens (4096), each token followed by
one of ``--branching`` successors (8) with random probabilities (a seeded generator builds the chain, and the
batches, once; every variant sees the same ones). The best possible loss is the chain's entropy rate (about 1.7
nats for 8 successors), far below log(vocab) (8.3 nats), so a model that learns the transitions shows a long,
falling loss curve on which FP8 rounding could show. The model: the Llama-3.1-8B shape cut to 4 layers (hidden 4096,
MLP 14336, 32 heads, 8 KV heads) with the task's vocabulary, bf16 weights, the same initial weights in every
variant (``--seed``).

Variants, each in its own process: ``bf16`` (kernelize + torch.compile), ``fp8_rowwise`` and ``fp8_tensorwise``
(the same with ``[kinds.linear] prefer = { any = ["cuda.linear.float8_<recipe>"] }``: every decoder-layer
projection in FP8). AdamW (fused; betas 0.9, 0.95; weight decay 0.1) at ``--lr`` 3e-4 after ``--warmup`` linear
steps, cosine decay to a tenth; gradients clipped to norm 1.0. Per step: the loss and the gradient norm before
clipping. Summary per FP8 variant: final loss (mean of the last 20 steps) against bf16's, relative difference,
the first non-finite step if any, the median ratio of gradient norms. JSON and a PNG chart (matplotlib, if
installed) go to ``--out``.

    python -m benchmarks.cuda.fp8_accuracy --out benchmarks/results/fp8-accuracy-h100      # ~10 min on an H100
    python -m benchmarks.cuda.fp8_accuracy --tiny --out /tmp/fp8-smoke                    # CPU smoke test, ~1 min

A run with ``--variants`` naming some of them keeps the other rows of an earlier run in the same ``--out`` with the
same settings, so the variants can run as separate commands (``--variants bf16``, then ``--variants fp8_rowwise``...).

``--layers N`` sets the depth (32: the Llama-3.1-8B shape at full depth) and ``--checkpointing`` turns on
activation checkpointing (non-reentrant) in every variant alike, for depths whose activations do not fit:

    python -m benchmarks.cuda.fp8_accuracy --layers 32 --checkpointing --steps 300 --out /tmp/fp8-accuracy-32l

``--variants`` also takes ``fp8_rowwise+lm_head`` / ``fp8_tensorwise+lm_head``: ``lm_head`` in FP8 too (the
fused loss then declines and the loss runs unfused), and any variant a ``@initN`` suffix: initial weights drawn
with seed ``--seed + N``, the task and the batches unchanged. ``bf16@init1`` against ``bf16`` is how far two bf16
runs that differ only in their initial weights end apart: the scale against which an FP8 difference reads.

``--tiny``: a 2-layer model of hidden size 64 on a 256-token chain, 20 steps of 2 x 64 tokens at lr 3e-3, for
checking the script anywhere; on a machine without an FP8-capable GPU the FP8 variants are skipped, with the reason
in the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time
import traceback

import torch


LLAMA_8B_4L = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                   max_position_embeddings=131072, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
VARIANTS = ("bf16", "fp8_rowwise", "fp8_tensorwise")
FINAL_WINDOW = 20


def markov_chain(vocab: int, branching: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(successors [V, k], their probabilities [V, k]) of a random chain: k distinct successors per token, with
    Dirichlet(1) probabilities.

    Example:
        >>> successors, probs = markov_chain(16, 3, seed=0)
        >>> successors.shape, bool(torch.allclose(probs.sum(-1), torch.ones(16, dtype=probs.dtype)))
        (torch.Size([16, 3]), True)
    """
    gen = torch.Generator().manual_seed(seed)
    successors = torch.stack([torch.randperm(vocab, generator=gen)[:branching] for _ in range(vocab)])
    weights = -torch.rand(vocab, branching, generator=gen, dtype=torch.float64).log()  # Exp(1): Dirichlet(1) rows
    return successors, weights / weights.sum(-1, keepdim=True)


def entropy_rate(successors: torch.Tensor, probs: torch.Tensor, *, iterations: int = 500) -> float:
    """The chain's entropy rate in nats, sum_i pi_i H(P_i) with pi its stationary distribution (power iteration):
    the loss a perfect model of the chain reaches, for tokens after the first."""
    vocab = successors.shape[0]
    pi = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    for _ in range(iterations):
        pi = torch.zeros_like(pi).index_add_(0, successors.flatten(), (pi[:, None] * probs).flatten())
    row_entropy = -(probs * probs.log()).sum(-1)
    return float((pi * row_entropy).sum())


def sample(successors: torch.Tensor, probs: torch.Tensor, *, sequences: int, length: int, seed: int) -> torch.Tensor:
    """``sequences`` token sequences of ``length`` from the chain, each starting at a uniformly drawn token."""
    gen = torch.Generator().manual_seed(seed)
    vocab = successors.shape[0]
    cdf = probs.cumsum(-1)
    out = torch.empty(sequences, length, dtype=torch.long)
    out[:, 0] = torch.randint(vocab, (sequences,), generator=gen)
    uniforms = torch.rand(sequences, length, generator=gen, dtype=torch.float64)
    for t in range(1, length):
        current = out[:, t - 1]
        choice = (uniforms[:, t, None] > cdf[current]).sum(-1).clamp_max(successors.shape[1] - 1)
        out[:, t] = successors[current, choice]
    return out


def fp8_unavailable(device: torch.device) -> str | None:
    """Why the FP8 variants cannot run here, or None."""
    if device.type != "cuda":
        return f"FP8 kernels need an NVIDIA GPU of compute capability 8.9 or newer; this run is on {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return f"FP8 kernels need compute capability 8.9 or newer; this GPU has {capability[0]}.{capability[1]}"
    try:
        import torchao  # noqa: F401
    except ImportError as exc:
        return f"torchao is not importable ({exc}); pip install 'kernels-cuda[fp8]'"
    return None


def split_variant(variant: str) -> tuple[str, str, int]:
    """``fp8_rowwise+lm_head@init1`` -> (``fp8_rowwise``, ``lm_head``, 1): recipe, modifier, offset of the seed the
    initial weights are drawn with (the task and the batches keep ``--seed``).

    Example:
        >>> split_variant("bf16@init2"), split_variant("fp8_tensorwise+lm_head")
        (('bf16', '', 2), ('fp8_tensorwise', 'lm_head', 0))
    """
    name, _, init = variant.partition("@")
    base, _, modifier = name.partition("+")
    return base, modifier, int(init.removeprefix("init") or 0)


def build(args: argparse.Namespace, device: torch.device, *, init_offset: int = 0) -> torch.nn.Module:
    import transformers

    shape = {**(TINY if args.tiny else LLAMA_8B_4L), **({"num_hidden_layers": args.layers} if args.layers else {})}
    config = transformers.LlamaConfig(**shape, vocab_size=args.vocab, attn_implementation="sdpa",
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(args.seed + init_offset)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    if args.checkpointing:
        from benchmarks.common import enable_checkpointing

        enable_checkpointing(model)
    return model


def learning_rate(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(variant: str, args: argparse.Namespace, data: torch.Tensor) -> dict:
    """One variant's run: per-step loss and gradient norm."""
    import kernels_core
    from kernels_core import Mode

    device = torch.device(args.device)
    base, modifier, init_offset = split_variant(variant)
    model = build(args, device, init_offset=init_offset)
    model.train()
    config = None
    if base.startswith("fp8_"):
        from benchmarks.common import fp8_linear_config

        config = fp8_linear_config(base.removeprefix("fp8_"), lm_head=modifier == "lm_head")
    kernels_core.kernelize(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE, config=config)
    report = kernels_core.get_report(model)
    fp8_layers = sum(1 for e in report.entries if e.kind == "linear" and e.kernel)
    declined = sorted({e.reason for e in report.entries if e.kind == "linear" and not e.kernel and e.reason})
    runner = torch.compile(model)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
    losses: list[float] = []
    grad_norms: list[float] = []
    non_finite: int | None = None
    start = time.perf_counter()
    first_step_s = None
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, args)
        batch = data[step].to(device, non_blocking=True)
        loss = runner(input_ids=batch, labels=batch).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        grad_norms.append(float(norm))
        if first_step_s is None:
            first_step_s = time.perf_counter() - start
            start = time.perf_counter()
        if non_finite is None and not (math.isfinite(losses[-1]) and math.isfinite(grad_norms[-1])):
            non_finite = step
            break
        if step % 25 == 0:
            print(f"{variant} step {step}: loss {losses[-1]:.4f} grad norm {grad_norms[-1]:.3f}", flush=True)
    seconds = time.perf_counter() - start
    timed = max(1, len(losses) - 1)
    return {
        "variant": variant,
        "losses": [round(v, 5) for v in losses],
        "grad_norms": [round(v, 5) for v in grad_norms],
        "final_loss": round(statistics.fmean(losses[-FINAL_WINDOW:]), 5),
        "first_non_finite_step": non_finite,
        "tokens_per_s": round(timed * data[0].numel() / seconds),
        "first_step_s": round(first_step_s or 0.0, 2),
        "fp8_linears": fp8_layers,
        "linears_declined": declined,
        "kernelize": report.summary(),
    }


def summarise(rows: dict[str, dict], floor: float) -> dict:
    """Each other variant against bf16 (``fp8_<recipe>@initN`` against ``bf16@initN`` where that ran; ``bf16@initN``
    is bf16 against itself from other initial weights): final losses, their relative difference, gradient norms."""
    out = {}
    for name, row in rows.items():
        recipe, _, offset = split_variant(name)
        # An FP8 run against bf16 from the same initial weights where that ran; bf16@initN against bf16.
        twin = f"bf16@init{offset}"
        base = rows[twin] if recipe != "bf16" and twin in rows else rows.get("bf16")
        if name == "bf16" or "losses" not in row or base is None or "losses" not in base:
            continue
        steps = min(len(row["losses"]), len(base["losses"]))
        ratios = [a / b for a, b in zip(row["grad_norms"][:steps], base["grad_norms"][:steps], strict=True) if b > 0]
        out[name] = {
            "final_loss": row["final_loss"],
            "against": base["variant"],
            "bf16_final_loss": base["final_loss"],
            "final_loss_rel_diff": round((row["final_loss"] - base["final_loss"]) / base["final_loss"], 5),
            "excess_over_entropy_rate_ratio": round((row["final_loss"] - floor) / (base["final_loss"] - floor), 4)
            if base["final_loss"] > floor else None,
            "max_abs_loss_diff_last_50": round(max(abs(a - b) for a, b in zip(
                row["losses"][steps - 50:steps], base["losses"][steps - 50:steps], strict=True)), 5)
            if steps >= 50 else None,
            "grad_norm_ratio_median": round(statistics.median(ratios), 4) if ratios else None,
            "non_finite": row["first_non_finite_step"] is not None,
            "tokens_per_s_ratio": round(row["tokens_per_s"] / base["tokens_per_s"], 3),
        }
    return out


def chart(rows: dict[str, dict], floor: float, path: pathlib.Path) -> str | None:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed; no chart"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, norm_ax) = plt.subplots(1, 2, figsize=(14, 5))
    for name, row in rows.items():
        if "losses" in row:
            loss_ax.plot(row["losses"], label=f"{name} (final {row['final_loss']:.4f})", linewidth=1)
            norm_ax.plot(row["grad_norms"], label=name, linewidth=1)
    loss_ax.axhline(floor, color="grey", linestyle="--", linewidth=1, label=f"entropy rate {floor:.3f}")
    loss_ax.set(title="training loss (nats)", xlabel="step", yscale="log")
    norm_ax.set(title="gradient norm before clipping", xlabel="step", yscale="log")
    for ax in (loss_ax, norm_ax):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True, help="folder for fp8-accuracy.json / .png")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tokens", default="2x2048", help="batch x sequence length")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--branching", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a small model and chain, 20 steps: a smoke test")
    parser.add_argument("--layers", type=int, help="decoder layers (default 4; 32 is the Llama-3.1-8B depth)")
    parser.add_argument("--checkpointing", action="store_true",
                        help="activation checkpointing (non-reentrant) on the decoder layers, in every variant")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per variant")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.vocab, args.steps, args.tokens, args.warmup = min(args.vocab, 256), min(args.steps, 20), "2x64", 4
        args.lr = 3e-3  # so that 20 steps of a tiny model show the loss falling
    batch, length = (int(v) for v in args.tokens.split("x"))
    successors, probs = markov_chain(args.vocab, args.branching, args.seed)
    data = sample(successors, probs, sequences=args.steps * batch, length=length, seed=args.seed + 1)
    data = data.view(args.steps, batch, length)
    if args.child:
        row: dict = {"variant": args.child}
        try:
            row = train(args.child, args, data)
        except Exception as exc:  # noqa: BLE001 - a failing variant is a result to report
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            row["traceback"] = traceback.format_exc()[-4000:]
        (args.out / f".{args.child}.json").write_text(json.dumps(row))
        return
    from benchmarks.common import python_m
    from benchmarks.common import run_child

    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    floor = entropy_rate(successors, probs)
    skip = fp8_unavailable(device)
    layers = args.layers or (TINY if args.tiny else LLAMA_8B_4L)["num_hidden_layers"]
    shape = (f"tiny ({layers} layers, hidden 64)" if args.tiny else
             f"Llama-3.1-8B shape, {layers} layers" + (" (full depth)" if layers == 32 else ""))
    shape += ", activation checkpointing" if args.checkpointing else ""
    config = (f"{shape}, vocabulary {args.vocab}, bf16 weights, kernelize + torch.compile, AdamW(lr {args.lr}, "
              f"betas 0.9/0.95, wd 0.1, {args.warmup} warm-up steps, cosine to 0.1x), clip 1.0, {args.tokens} "
              f"tokens per step, {args.steps} steps, seed {args.seed}")
    result_file = args.out / "fp8-accuracy.json"
    earlier = json.loads(result_file.read_text()) if result_file.exists() else {}
    # Rows of an earlier run with the same settings stay (variants run as separate commands).
    same = earlier.get("config") == config
    rows: dict[str, dict] = {r["variant"]: r for r in earlier.get("rows", [])} if same else {}
    for variant in args.variants.split(","):
        if variant.startswith("fp8_") and skip:
            rows[variant] = {"variant": variant, "skipped": skip}
            print(f"{variant}: skipped: {skip}", flush=True)
            continue
        cmd = python_m("benchmarks.cuda.fp8_accuracy", "--child", variant, *sys.argv[1:])
        result, error = run_child(cmd, args.out / f".{variant}.json", timeout=args.timeout)
        rows[variant] = result or {"variant": variant}
        if error:
            rows[variant]["process_error"] = error
        done = rows[variant]
        print(json.dumps({k: v for k, v in done.items() if k not in ("losses", "grad_norms", "traceback")}),
              flush=True)
    summary = summarise(rows, floor)
    environment = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        from benchmarks.common import environment as cuda_environment

        environment = cuda_environment()
        try:
            import importlib.metadata

            environment["torchao"] = importlib.metadata.version("torchao")
        except importlib.metadata.PackageNotFoundError:
            environment["torchao"] = None
    payload = {
        "environment": environment,
        "config": config,
        "task": {"kind": "random Markov chain", "vocab": args.vocab, "branching": args.branching,
                 "entropy_rate_nats": round(floor, 5), "log_vocab_nats": round(math.log(args.vocab), 5)},
        "summary": summary,
        "rows": list(rows.values()),
    }
    result_file.write_text(json.dumps(payload, indent=2) + "\n")
    problem = chart(rows, floor, args.out / "fp8-accuracy.png")
    print(json.dumps({"entropy_rate": round(floor, 4), "summary": summary}, indent=2), flush=True)
    if problem:
        print(problem, flush=True)


if __name__ == "__main__":
    main()
