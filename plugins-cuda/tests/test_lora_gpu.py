"""LoRA and QLoRA training with kernels-core on one NVIDIA GPU: the same losses and adapter gradients as plain PEFT,
and what the kernels change in tokens/s and peak memory against plain PEFT and against Liger.

Three cases on a Qwen3-shaped model: LoRA on every linear layer (``target_modules="all-linear"``, which leaves
``lm_head`` out), LoRA on every linear layer and ``lm_head``, and QLoRA (4-bit nf4 base layers with a bfloat16
quant storage, the floating-point storage FSDP needs; LoRA on every linear layer).

- ``test_losses_and_adapter_gradients_match_plain_peft``: float32 with TF32 off, 20 AdamW steps on distinct
  batches, both orders (kernelize then ``get_peft_model``, and the reverse). Every step's loss within 1e-3 relative
  of plain PEFT's and every LoRA gradient of the first step within 1e-3 relative norm error. The kernels compute
  in float32 and differ from eager by summation order only (about 1e-6 per step; AdamW at lr 1e-3 over 20 steps
  keeps the losses within about 1e-5), so 1e-3 leaves room without hiding a missing term: an adapter the fused
  loss skipped would have no gradient at all, and a dropped LoRA path changes the loss by percents.
- ``test_speed_and_memory_against_plain_peft_and_liger``: bfloat16, the Qwen3-0.6B shape cut to 8 layers (full
  151,936-token vocabulary), 4 x 1024 tokens, 20 steps, kernelize first. Prints tokens/s (steps 5-20) and peak
  memory of plain PEFT, kernels-core and, if ``liger_kernel`` imports, ``apply_liger_kernel_to_qwen3`` applied
  before ``get_peft_model``. kernels-core's losses must stay within 2e-2 of plain PEFT's (bfloat16 activations
  round at 2^-8 relative, and 20 optimizer steps compound it); Liger's are printed, with whether its fused loss
  trained the ``lm_head`` adapter. With ``KERNELS_LORA_GPU_OUT=<file>`` the numbers are also written as JSON.

The QLoRA cases skip without ``bitsandbytes``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import time
import warnings

import pytest
import torch


pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA build of torch); CI is CPU-only"
)
peft = pytest.importorskip("peft", reason="the LoRA checks need PEFT (installed with kernels-cuda[test])")
pytest.importorskip("transformers")

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = {
    "lora": "all-linear",
    "lora_lm_head": [*LINEARS, "lm_head"],
    "qlora": "all-linear",
}
ORDERS = ("kernelize_first", "peft_first")
STEPS = 20
TIMED_FROM = 4  # the first steps build Triton kernels and caches
DEVICE = "cuda"

BASE = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=4096, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
# Small, for the float32 comparison; untied head so that lm_head's adapter sits on a weight of its own.
SMALL = dict(BASE, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=5003, tie_word_embeddings=False)
# Qwen3-0.6B's published configuration (tied head), cut to 8 of its 28 layers.
QWEN3_06B = dict(BASE, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)


def _bnb_or_skip():
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("QLoRA needs bitsandbytes (not installed)")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Random-weight checkpoints of both shapes, saved once: QLoRA quantizes while loading one."""
    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM

    paths = {}
    for name, shape in (("small", SMALL), ("qwen3-0.6b-8l", QWEN3_06B)):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(**shape))
        with torch.no_grad():  # norms away from ones, so that a kernel misreading them shows
            for param_name, param in model.named_parameters():
                if "norm" in param_name:
                    param.add_(torch.randn_like(param) * 0.1)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        paths[name] = str(path)
    return paths


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _load(path: str, case: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers import BitsAndBytesConfig

    kwargs = {}
    if case == "qlora":
        _bnb_or_skip()
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_storage=torch.bfloat16)
    where = torch.cuda.current_device() if DEVICE == "cuda" else DEVICE
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map={"": where}, **kwargs)
    model.config.use_cache = False
    return model


def _peft(model: torch.nn.Module, case: str, *, dropout: float) -> torch.nn.Module:
    config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout, target_modules=CASES[case],
                             init_lora_weights=False)  # random B too: A's gradient is not trivially zero
    torch.manual_seed(7)  # the same adapter weights in every variant
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Model has `tie_word_embeddings=True`", UserWarning)
        model = peft.get_peft_model(model, config)
    model.train()
    return model


def _batches(vocab: int, batch: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator(device=DEVICE).manual_seed(3)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(3, vocab, (batch, seq), device=DEVICE, generator=g)
        labels = ids.clone()
        labels[:, : seq // 8] = -100  # an unlabelled prompt, as SFT data has
        out.append((ids, labels))
    return out


def _train(model: torch.nn.Module, batches: list) -> dict:
    """20 AdamW steps: losses, the first step's trainable gradients (None where none arrived), tokens/s, peak."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    losses, first, fused = [], {}, []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, tokens = None, 0
    for step, (ids, labels) in enumerate(batches):
        if step == TIMED_FROM:
            torch.cuda.synchronize()
            start = time.perf_counter()
        torch.manual_seed(100 + step)  # the same LoRA dropout masks in every variant
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        if step == 0:
            first = {n: None if p.grad is None else p.grad.detach().float().clone()
                     for n, p in model.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.detach().float())
        fused.append(out.logits is None)
        if step >= TIMED_FROM:
            tokens += ids.numel()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {"losses": torch.stack(losses).tolist(), "grads": first, "fused": all(fused),
            "tokens_per_s": tokens / elapsed, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def _kernelized(path: str, case: str, order: str, dtype: torch.dtype, *, dropout: float) -> tuple:
    import kernels_core
    from kernels_core import Mode

    base = _load(path, case, dtype)
    if order == "kernelize_first":
        kernels_core.kernelize(base, mode=Mode.TRAINING)
        return _peft(base, case, dropout=dropout), base
    model = _peft(base, case, dropout=dropout)
    kernels_core.kernelize(model, mode=Mode.TRAINING)
    return model, model


def _applied(model: torch.nn.Module) -> dict[str, str | None]:
    import kernels_core

    return {e.kind: e.kernel for e in kernels_core.get_report(model).entries}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_losses_and_adapter_gradients_match_plain_peft(case, order, checkpoints, no_tf32):
    path = checkpoints["small"]
    batches = _batches(SMALL["vocab_size"], 2, 256)
    # No LoRA dropout here: the CPU tests check that the fused paths draw PEFT's masks; on CUDA, torch does not
    # promise the same mask for a [B, S, H] and an [N, H] draw of the same numbers.
    plain = _train(_peft(_load(path, case, torch.float32), case, dropout=0.0), batches)
    model, kernelized = _kernelized(path, case, order, torch.float32, dropout=0.0)
    got = _train(model, batches)
    applied = _applied(kernelized)
    assert applied.get("causal_lm_loss") and applied.get("silu_gated_mlp"), applied
    assert got["fused"], "the fused loss did not run (the model returned logits)"
    worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], plain["losses"], strict=True))
    assert worst <= 1e-3, f"losses differ by {worst:.2e} relative: {got['losses']} vs {plain['losses']}"
    assert got["grads"].keys() == plain["grads"].keys()
    for name, expected in plain["grads"].items():
        assert got["grads"][name] is not None, f"{name} got no gradient"
        err = _rel(got["grads"][name], expected)
        assert err <= 1e-3, f"{name}: relative gradient error {err:.2e}"
    head = [n for n in got["grads"] if "lm_head.lora_" in n]
    assert len(head) == (2 if case == "lora_lm_head" else 0)
    print(f"\n{case} {order}: {len(plain['grads'])} LoRA tensors, worst loss error {worst:.1e}")


@contextlib.contextmanager
def _liger_patches_undone():
    """Liger patches transformers' Qwen3 module globals (RMSNorm, MLP, RoPE); put them back for the next models."""
    from transformers.models.qwen3 import modeling_qwen3

    saved = dict(vars(modeling_qwen3))
    forward = modeling_qwen3.Qwen3ForCausalLM.__dict__["forward"]
    try:
        yield
    finally:
        for name in set(vars(modeling_qwen3)) - set(saved):
            delattr(modeling_qwen3, name)
        for name, value in saved.items():
            if vars(modeling_qwen3).get(name) is not value:
                setattr(modeling_qwen3, name, value)
        modeling_qwen3.Qwen3ForCausalLM.forward = forward


def _liger(path: str, case: str, batches: list) -> dict | str | None:
    """Liger's run, or why it failed (a comparison only: its failure is printed, not the test's), or None."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    from liger_kernel.transformers import apply_liger_kernel_to_qwen3

    try:
        with _liger_patches_undone():
            base = _load(path, case, torch.bfloat16)
            apply_liger_kernel_to_qwen3(model=base)
            return _train(_peft(base, case, dropout=0.05), batches)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"[:300]


def _head_trained(result: dict) -> str:
    head = {n: g for n, g in result["grads"].items() if "lm_head.lora_" in n}
    if not head:
        return "-"
    return "yes" if all(g is not None and bool(g.abs().max() > 0) for g in head.values()) else "NO (no gradient)"


@pytest.mark.parametrize("case", sorted(CASES))
def test_speed_and_memory_against_plain_peft_and_liger(case, checkpoints):
    path = checkpoints["qwen3-0.6b-8l"]
    batches = _batches(QWEN3_06B["vocab_size"], 4, 1024)
    results = {"plain PEFT": _train(_peft(_load(path, case, torch.bfloat16), case, dropout=0.05), batches)}
    torch.cuda.empty_cache()
    model, kernelized = _kernelized(path, case, "kernelize_first", torch.bfloat16, dropout=0.05)
    results["kernels-core"] = _train(model, batches)
    applied = _applied(kernelized)
    del model, kernelized
    torch.cuda.empty_cache()
    liger = _liger(path, case, batches)
    torch.cuda.empty_cache()
    if isinstance(liger, dict):
        results["liger"] = liger
    plain = results["plain PEFT"]
    lines = [f"\n{case} on {torch.cuda.get_device_name()}, bf16, Qwen3-0.6B shape (8 layers), 4 x 1024 tokens:",
             f"{'variant':<14}{'tokens/s':>10}{'vs plain':>10}{'peak GiB':>10}{'vs plain':>10}{'last loss':>11}"
             f"  lm_head adapter trained"]
    for name, r in results.items():
        lines.append(f"{name:<14}{r['tokens_per_s']:>10.0f}{r['tokens_per_s'] / plain['tokens_per_s']:>9.2f}x"
                     f"{r['peak_gib']:>10.2f}{r['peak_gib'] / plain['peak_gib']:>9.2f}x{r['losses'][-1]:>11.4f}"
                     f"  {_head_trained(r)}")
    lines.append(f"kernels-core kernels: {sorted(k for k, v in applied.items() if v)}")
    if isinstance(liger, str):
        lines.append(f"liger failed: {liger}")
    elif liger is None:
        lines.append("liger: not installed")
    print("\n".join(lines))
    out = os.environ.get("KERNELS_LORA_GPU_OUT")
    if out:
        previous = json.load(open(out)) if os.path.exists(out) else {}
        previous[case] = {"device": torch.cuda.get_device_name(), "shape": "qwen3-0.6b, 8 layers, bf16",
                          "tokens": "4 x 1024", **{name: {k: r[k] for k in ("tokens_per_s", "peak_gib", "losses")}
                                                   | {"lm_head_adapter_trained": _head_trained(r)}
                                                   for name, r in results.items()}}
        with open(out, "w") as f:
            json.dump(previous, f, indent=2)
    kc = results["kernels-core"]
    assert kc["fused"] and _head_trained(kc) in ("-", "yes")
    worst = max(abs(a - b) / abs(b) for a, b in zip(kc["losses"], plain["losses"], strict=True))
    assert worst <= 2e-2, f"bf16 losses differ by {worst:.2e} relative: {kc['losses']} vs {plain['losses']}"
