"""The fused causal-LM loss under FSDP2: bound where FSDP's gathered lm_head weight is the whole plain weight (FSDP
over one mesh dimension, HSDP over two), declined where it stays a tensor-parallel DTensor (TP inside FSDP).

One CPU process over gloo (a world of one rank) is enough: the mesh's dimensions, not their sizes, decide what
FSDP's all-gather returns, and a TP DTensor on a one-rank ``tp`` dimension fails the fused loss's plain matmul
exactly as on many ranks.
"""

from __future__ import annotations

import socket

import kernels_core
import pytest
import torch
from kernels_core import Mode
from kernels_core.testing import assert_close
from kernels_core.testing import tiny_causal_lm
from torch import nn


pytest.importorskip("transformers")
dist = torch.distributed
pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="this torch build has no torch.distributed with the gloo backend",
)


@pytest.fixture(scope="module")
def one_rank():
    """A gloo process group of this process alone, for device meshes and fully_shard."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _mesh(names: tuple[str, ...]):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,) * len(names), mesh_dim_names=names)


def _tensor_parallel_lm_head(lm_head: nn.Linear, tp_mesh) -> None:
    """Column-parallel lm_head as transformers 5.17 builds it: the weight a DTensor split over the vocabulary on
    ``tp_mesh``, and an instance forward (no hooks) that replicates the input and gathers the logits."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import distribute_tensor

    # A new Parameter also unties lm_head from the input embedding, which stays a plain tensor.
    lm_head.weight = nn.Parameter(distribute_tensor(lm_head.weight.detach().clone(), tp_mesh, [Shard(0)]))
    class_forward = type(lm_head).forward.__get__(lm_head)

    def tp_forward(x: torch.Tensor) -> torch.Tensor:
        x = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)
        # A copy: FSDP warns about a module output that is a view (to_local's is).
        return class_forward(x).redistribute(placements=[Replicate()]).to_local().clone()

    lm_head.forward = tp_forward


def _build(layout: str) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = tiny_causal_lm("llama", tie_word_embeddings=False)
    if layout == "fsdp":
        mesh = _mesh(("dp",))
    elif layout == "hsdp":  # a 2-D mesh, replicate x shard, and no tensor parallelism
        mesh = _mesh(("replicate", "shard"))
    else:  # "tp_fsdp": TP over mesh["tp"], then FSDP2 over mesh["dp"]
        two_d = _mesh(("dp", "tp"))
        _tensor_parallel_lm_head(model.lm_head, two_d["tp"])
        mesh = two_d["dp"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _loss_entry(model: nn.Module):
    return next(e for e in kernels_core.get_report(model).entries if e.kind == "causal_lm_loss")


def _step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grad = model.lm_head.weight.grad.full_tensor().clone()
    model.zero_grad(set_to_none=True)
    return loss.detach(), grad


@pytest.mark.parametrize("layout", ["fsdp", "hsdp"])
def test_lm_head_gathered_whole_by_fsdp_gets_the_fused_loss(layout, one_rank, ref_pm, calls):
    model = _build(layout)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    eager_loss, eager_grad = _step(model, ids)
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    entry = _loss_entry(model)
    assert entry.kernel == "ref.causal_lm_loss", entry.reason
    calls.clear()
    loss, grad = _step(model, ids)
    assert calls["causal_lm_loss"] == 1
    assert_close(loss, eager_loss)
    assert_close(grad, eager_grad)


def test_tensor_parallel_lm_head_inside_fsdp_is_declined_with_the_reason(one_rank, ref_pm, calls):
    from torch.distributed.tensor import DTensor

    model = _build("tp_fsdp")
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    eager_loss, eager_grad = _step(model, ids)
    kernels_core.kernelize(model, mode=Mode.TRAINING, plugin_manager=ref_pm)
    entry = _loss_entry(model)
    assert entry.kernel is None and not entry.applied, f"bound {entry.kernel} to a TP lm_head inside FSDP"
    assert "tensor-parallel" in entry.reason and "'tp'" in entry.reason, entry.reason
    # Looking at the gathered weight gave the shards back: lm_head is sharded over (dp, tp) again.
    weight = model.lm_head.weight
    assert isinstance(weight, DTensor) and weight.device_mesh.mesh_dim_names == ("dp", "tp"), weight
    # The model's own loss still trains: the same loss and lm_head gradient as before kernelize.
    calls.clear()
    loss, grad = _step(model, ids)
    assert calls["causal_lm_loss"] == 0
    assert_close(loss, eager_loss)
    assert_close(grad, eager_grad)
