"""kernelize on a model spread over two GPUs by ``from_pretrained(..., device_map=...)`` (accelerate's hooks).

    python device_map_worker.py                 # 2 GPUs: layers 0-1 on cuda:0, 2-3 on cuda:1, bfloat16
    python device_map_worker.py --device cpu    # the same hooks on CPU (accelerate.dispatch_model, force_hooks)

One process, no torchrun. A tiny Qwen3ForCausalLM is saved and loaded back with the device map, then
``kernelize(mode=INFERENCE)``. Checks: accelerate really hooked the modules; the report has no probe that raised and
nothing declined as "already replaced by other code" (accelerate's hook partial is not a foreign kernel), every
expected kind (RoPE included, on GPU) got a kernel on every module it matched, and on GPU both devices appear in
it; prefill logits close to eager's; greedy ``generate`` (16 new tokens, 16 prompts) gives eager's tokens;
``unkernelize`` leaves every module's instance ``forward`` and ``_old_forward`` as they were (the same objects, or
equal bound methods / partials), and the model then reproduces eager's logits and tokens exactly.

Greedy decoding of a random model in bfloat16 meets exact and near ties (its logits are rounded to 8 bits; a
runner-up within one rounding step of the top is common over 16 steps), where any change in rounding flips the
argmax and every later token differs. So the tokens must be identical, except that a row may diverge at a step
where eager's top-1 logit beat the runner-up by at most ``--margin`` of the largest logit; and at every step up to
a row's divergence (where both runs saw the same tokens) the kernelized logits must be close to eager's. A kernel
bug in the decode path (RoPE at an offset, the KV cache) breaks the second condition, or the first at a decisive
step.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
from typing import Any

import torch
from _shared import DTYPES
from _shared import check
from _shared import check_report
from _shared import rel_norm
from _shared import tiny_model


MISSING = object()
LAYERS = 4


def device_map(devices: tuple[str, str]) -> dict[str, str]:
    """Embedding and the first half of the layers on the first device; the rest, final norm and lm_head on the
    second: every decoder layer's RoPE, norms and MLP see their own device, and activations cross between them."""
    first, second = devices
    mapping = {"model.embed_tokens": first, "model.rotary_emb": first}
    mapping.update({f"model.layers.{i}": first if i < LAYERS // 2 else second for i in range(LAYERS)})
    mapping.update({"model.norm": second, "lm_head": second})
    return mapping


def load(path: str, args: argparse.Namespace, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    if args.device == "cuda":
        return AutoModelForCausalLM.from_pretrained(path, device_map=device_map(("cuda:0", "cuda:1")), dtype=dtype)
    # Without two GPUs, attach the same AlignDevicesHook per module that from_pretrained's dispatch attaches.
    import accelerate

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    accelerate.dispatch_model(model, device_map(("cpu", "cpu")), main_device="cpu", force_hooks=True)
    return model


def forwards(model: torch.nn.Module) -> dict[str, tuple[object, object]]:
    """Each module's instance-level ``forward`` and ``_old_forward`` (accelerate's), MISSING where not set."""
    return {name: (m.__dict__.get("forward", MISSING), m.__dict__.get("_old_forward", MISSING))
            for name, m in model.named_modules()}


def same_callable(a: object, b: object) -> bool:
    """Identical, or equal bound methods, or partials of the same function with identical arguments."""
    if a is b or (not isinstance(a, functools.partial) and a == b):
        return True
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        same_args = len(a.args) == len(b.args) and all(x is y for x, y in zip(a.args, b.args, strict=True))
        return a.func is b.func and same_args and a.keywords == b.keywords
    return False


def generate(model: Any, prompts: torch.Tensor, new_tokens: int) -> Any:
    # min_new_tokens = max_new_tokens: no row stops early at a random EOS, so both runs produce the same shape.
    return model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True)


def compare_generations(eager: Any, kernelized: Any, prompt_len: int, *, margin: float) -> dict[str, Any]:
    """Per row: identical, or where it diverges and eager's top-1 margin there; the logits error up to divergence."""
    e_tokens, k_tokens = eager.sequences[:, prompt_len:].cpu(), kernelized.sequences[:, prompt_len:].cpu()
    e_scores, k_scores = torch.stack(eager.scores, 1).float().cpu(), torch.stack(kernelized.scores, 1).float().cpu()
    finite = torch.isfinite(e_scores) & torch.isfinite(k_scores)  # EOS is -inf in both (min_new_tokens)
    e_scores, k_scores = e_scores.where(finite, 0), k_scores.where(finite, 0)
    identical, near_ties, decisive, worst = 0, [], [], 0.0
    for row in range(e_tokens.shape[0]):
        differ = torch.nonzero(e_tokens[row] != k_tokens[row]).flatten().tolist()
        last = differ[0] if differ else e_tokens.shape[1] - 1  # scores up to here were computed on equal prefixes
        for step in range(last + 1):
            worst = max(worst, rel_norm(k_scores[row, step], e_scores[row, step]))
        if not differ:
            identical += 1
            continue
        top = e_scores[row, last].topk(2).values
        gap = ((top[0] - top[1]) / e_scores[row, last].abs().amax().clamp_min(1e-30)).item()
        (near_ties if gap <= margin else decisive).append({"row": row, "step": last, "margin": round(gap, 5)})
    return {"identical_rows": identical, "near_tie_divergences": near_ties, "decisive_divergences": decisive,
            "max_logits_rel_error_before_divergence": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--rows", type=int, default=16, help="prompts generated in one batch")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--margin", type=float, help="top-1 minus runner-up, relative to the largest logit, at "
                        "or below which a divergence is a near-tie (default: 0.02 in bfloat16, 1e-3 in float32)")
    args = parser.parse_args()

    import kernels_core

    dtype = DTYPES[args.dtype]
    bf16 = dtype == torch.bfloat16
    # Margin: about 5 bfloat16 rounding steps of the largest logit. Logits: the kernels compute in float32 and round
    # once where eager rounds twice; perturbing every norm weight by one bfloat16 step moves this model's logits by
    # ~1.5e-2, a RoPE with the wrong frequencies by 0.16-0.4 (measured on CPU), hence 5e-2.
    args.margin = args.margin if args.margin is not None else (2e-2 if bf16 else 1e-3)
    tolerance = 5e-2 if bf16 else 1e-4
    with tempfile.TemporaryDirectory() as path:
        tiny_model(LAYERS).save_pretrained(path)
        model = load(path, args, dtype)
    model.eval()
    hooked = [name for name, m in model.named_modules() if "_hf_hook" in m.__dict__]
    check(len(hooked) > LAYERS, f"accelerate attached hooks to only {len(hooked)} modules: the check would be vacuous")
    if args.device == "cuda":
        where = {str(p.device) for p in model.parameters()}
        check(where == {"cuda:0", "cuda:1"}, f"parameters on {where}, expected both GPUs")

    first = next(model.parameters()).device
    prompts = torch.randint(3, 1024, (args.rows, 8), generator=torch.Generator().manual_seed(7)).to(first)
    original = forwards(model)
    with torch.no_grad():
        eager_logits = model(input_ids=prompts).logits.float()
    eager = generate(model, prompts, args.new_tokens)

    kernels_core.kernelize(model, mode=kernels_core.Mode.INFERENCE)
    report = kernels_core.get_report(model)
    print(report.table(), flush=True)
    check_report(report, args.device, what="device_map", inference=True)
    if args.device == "cuda":
        devices = {e.device for e in report.entries}
        check({"cuda:0", "cuda:1"} <= devices, f"report resolves modules on {devices}, expected both GPUs", report)
    with torch.no_grad():
        kernel_logits = model(input_ids=prompts).logits.float()
    error = rel_norm(kernel_logits.cpu(), eager_logits.cpu())
    check(error <= tolerance, f"kernelized prefill logits differ from eager's by {error:.2e} (> {tolerance})", report)
    kernelized = generate(model, prompts, args.new_tokens)

    outcome = compare_generations(eager, kernelized, prompts.shape[1], margin=args.margin)
    print(f"prefill logits rel error {error:.2e}; greedy decoding vs eager: {outcome}", flush=True)
    check(not outcome["decisive_divergences"], f"greedy tokens differ from eager's at decisive steps: {outcome}\n"
          f"eager      {eager.sequences.tolist()}\nkernelized {kernelized.sequences.tolist()}", report)
    worst = outcome["max_logits_rel_error_before_divergence"]
    check(worst <= tolerance, f"decode-step logits differ from eager's by {worst:.2e} (> {tolerance})", report)
    check(outcome["identical_rows"] > 0, f"no row decoded identically to eager: {outcome}", report)

    kernels_core.unkernelize(model)
    restored = forwards(model)
    changed = [name for name in original if not (same_callable(original[name][0], restored[name][0])
                                                 and same_callable(original[name][1], restored[name][1]))]
    check(not changed, f"unkernelize did not restore forward/_old_forward of {changed}", report)
    check(set(restored) == set(original), "unkernelize changed the set of modules")
    with torch.no_grad():
        after_logits = model(input_ids=prompts).logits.float()
    check(torch.equal(after_logits, eager_logits), "after unkernelize, logits differ from eager's")
    again = generate(model, prompts, args.new_tokens)
    check(torch.equal(again.sequences, eager.sequences), "after unkernelize, greedy tokens differ from eager's")
    print(f"device_map {args.device} {args.dtype}: OK; {report.summary()}", flush=True)


if __name__ == "__main__":
    main()
