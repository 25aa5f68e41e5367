"""What the distributed workers share: the tiny Qwen3, process-group setup, report checks, failing loudly.

Workers are scripts run by ``torchrun`` (or plain ``python``); this folder is their ``sys.path[0]``, so they import
this module as ``_shared``. Nothing here is collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

import torch
import torch.distributed as dist


# Small enough to run in seconds on CPU, large enough that every Qwen3 layer kind is matched and tensor parallel
# splits heads evenly over two ranks (4 heads, 2 KV heads, vocabulary divisible by 2).
TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=1024,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# The kinds a Qwen3 decoder has kernels for; a worker requires each one that some loaded plugin declares for the
# backend in use (on CPU only the portable ones: no RoPE kernel there) to be applied on every module it matched.
EXPECTED_KINDS = ("rms_norm", "silu_gated_mlp", "rotary_embedding", "causal_lm_loss")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def set_distributed_env() -> None:
    # NVLink SHARP / multicast objects fail on the lent H200 hosts; NCCL reads these when a communicator is created.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def init_distributed(device_type: str) -> torch.device:
    """NCCL with this rank's GPU bound, or gloo on CPU; returns the device this rank computes on."""
    set_distributed_env()
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def wrap(model: torch.nn.Module, how: str, device: torch.device, *, reshard_after_forward: bool = True,
         mesh: Any = None, layers_per_unit: int = 1) -> torch.nn.Module:
    """FSDP2 (``fully_shard`` on every decoder layer, then the root: the usual recipe; over ``mesh``, by default
    every rank) or DDP around ``model``. ``layers_per_unit`` > 1 shards that many consecutive decoder layers as one
    FSDP unit (one all-gather and one reduce-scatter for the group: fewer collectives and hooks per step, more
    parameters gathered at once)."""
    if how == "fsdp":
        from torch.distributed.fsdp import fully_shard

        layers = list(model.model.layers)
        for start in range(0, len(layers), layers_per_unit):
            group = layers[start:start + layers_per_unit]
            fully_shard(group if len(group) > 1 else group[0], mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def log(message: str) -> None:
    """Rank 0 speaks for the job (the checks are symmetric); a failure prints from every rank."""
    if rank() == 0:
        print(message, flush=True)


def fail(message: str, report: Any = None) -> None:
    """Print what failed (and the kernelize report, if any) and exit non-zero; torchrun then stops the other rank."""
    text = f"[rank {rank()}] FAIL: {message}"
    if report is not None:
        text += f"\n{report.table(collapse=False)}"
    print(text, file=sys.stderr, flush=True)
    sys.exit(1)


def check(condition: bool, message: str, report: Any = None) -> None:
    if not condition:
        fail(message, report)


def tiny_model(layers: int, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Any:
    """A seeded tiny Qwen3ForCausalLM; norm weights perturbed so that a kernel that drops or misplaces them shows."""
    from transformers import Qwen3Config
    from transformers import Qwen3ForCausalLM

    config = Qwen3Config(**TINY, num_hidden_layers=layers, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model.to(device=device, dtype=dtype)


def shared_checkpoint(layers: int, *, prefix: str) -> str:
    """A tiny Qwen3 checkpoint every rank can load: rank 0 saves it to a fresh temporary folder, all learn where."""
    import tempfile

    where = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    if dist.get_rank() == 0:
        tiny_model(layers).save_pretrained(where[0])
    dist.barrier()
    return where[0]


def normalise(module_name: str) -> str:
    """A module path as if unwrapped: DDP prefixes ``module.``; FSDP2 keeps the names."""
    return re.sub(r"^module(\.|$)", "", module_name) or "(model)"


def choices(report: Any) -> dict[str, str | None]:
    """(module, kind) -> kernel id (None where declined): what must not depend on when kernelize ran."""
    return {f"{normalise(e.module)}|{e.kind}": e.kernel for e in report.entries}


def choice_differences(a: Any, b: Any) -> list[str]:
    """The (module, kind) pairs two reports gave different kernels, as ``key: a / b`` lines."""
    ca, cb = choices(a), choices(b)
    return [f"{key}: {ca.get(key)} / {cb.get(key)}" for key in sorted(set(ca) | set(cb)) if ca.get(key) != cb.get(key)]


def finish(checkpoint: str | None = None) -> None:
    """End a worker whose checks all passed: wait for every rank, remove the shared checkpoint, leave.

    Only on success: after a failure the ranks may be in different places, and a barrier there would hang. The
    process leaves without the interpreter's teardown: now and then a gloo thread still joinable there aborts it
    ("terminate called without an active exception") after every check has passed.
    """
    import shutil

    dist.barrier()
    if checkpoint is not None and dist.get_rank() == 0:
        shutil.rmtree(checkpoint, ignore_errors=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def declared_kinds(backend: str) -> set[str]:
    """Layer kinds that some loaded plugin declares a kernel for on ``backend`` (or on any backend)."""
    import kernels_core

    return {k.spec.kind for k in kernels_core.get_plugin_manager().kernels() if k.spec.backend in (backend, "any")}


def check_report(report: Any, backend: str, *, what: str, inference: bool = False) -> None:
    """No probe that raised, no foreign wrapper refused, every expected kind applied on every module it matched.

    ``inference``: the model was kernelized in ``Mode.INFERENCE``, where the fused loss declines by design (no
    training step, the model's own forward returns logits), so the loss kind is not expected.
    """
    check(report is not None, f"{what}: get_report returned None (was kernelize called on this object?)")
    for entry in report.entries:
        reason = entry.reason or ""
        refused = "probe forward raised" in reason or "already replaced" in reason
        check(not refused, f"{what}: {entry.module} ({entry.kind}) declined: {reason}", report)
    expected = set(EXPECTED_KINDS) - ({"causal_lm_loss"} if inference else set())
    for kind in sorted(expected & declared_kinds(backend)):
        entries = [e for e in report.entries if e.kind == kind]
        check(bool(entries), f"{what}: no module matched as {kind}", report)
        missing = [f"{e.module}: {e.reason}" for e in entries if not (e.applied or e.covered)]
        check(not missing, f"{what}: {kind} got no kernel on {len(missing)} of {len(entries)} modules: {missing}",
              report)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor
