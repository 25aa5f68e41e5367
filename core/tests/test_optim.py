"""``kernels_core.optim``: an optimizer stepping FSDP2's parameters on their local shards computes, bitwise, what
it computes through DTensor dispatch; what it refuses, it refuses by name.

The equality checks run FSDP2 on two CPU processes over gloo (``_optim_worker.py``), with shards of unequal
length and an empty one. Bitwise is the right bound: the same foreach kernels run on the same local memory either
way, so any difference at all would mean another computation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import two_ranks
from kernels_core.optim import NO_DTENSOR
from kernels_core.optim import LocalShardSteps
from kernels_core.optim import installed_local_shard_steps
from kernels_core.optim import local_shard_problem
from kernels_core.optim import restore_step
from kernels_core.optim import step_on_local_shards


WORKER = Path(__file__).with_name("_optim_worker.py")
distributed = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="this torch build has no torch.distributed with the gloo backend",
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return two_ranks.launch(WORKER, "optim", tmp_path_factory.mktemp("optim"))


@distributed
@pytest.mark.parametrize("setting", ["adamw_foreach", "adamw_for_loop", "adamw_fused", "adam_amsgrad",
                                     "sgd_nesterov", "rmsprop_centered", "adagrad"])
def test_local_shard_steps_are_bitwise_the_dtensor_steps(ranks, setting):
    for rank, result in enumerate(ranks):
        assert result[setting]["bitwise"], f"rank {rank}: {setting} differs from its DTensor steps"
        # The states stay DTensors: state_dict() and distributed checkpoints see what they always saw.
        assert result[setting]["state_types"] == result[setting]["plain_state_types"] == ["DTensor"], result[setting]


@distributed
def test_hsdp_replicated_and_sharded_placements_step_bitwise(ranks):
    for rank, result in enumerate(ranks):
        hsdp = result["hsdp"]
        assert hsdp["placements"] == ["(Replicate(), Shard(dim=0))"], hsdp["placements"]
        assert hsdp["bitwise"], f"rank {rank}: HSDP's local-shard steps differ from its DTensor steps"
        assert hsdp["state_types"] == ["DTensor"]


@distributed
def test_an_lr_scheduler_made_before_or_after_keeps_working(ranks):
    for result in ranks:
        assert result["scheduler"]["first_bitwise"] and result["scheduler"]["after_bitwise"]
        # The scheduler still sees the optimizer step (no "lr_scheduler.step() before optimizer.step()" warning).
        assert result["scheduler"]["warnings"] == []


@distributed
def test_a_step_that_raises_leaves_the_optimizer_as_it_was(ranks):
    for result in ranks:
        message, params_back, states_back = result["failing_step"]["raised"]
        assert message == "a step pre-hook failed"
        assert params_back and states_back, "the local tensors stayed in the optimizer after the failed step"
        assert result["failing_step"]["then_bitwise"], "training after the failed step differs"


@distributed
def test_restore_and_reinstall(ranks):
    for result in ranks:
        assert result["restore"] == {"first": True, "again": False, "instance_step_left": False}
        assert result["installed_twice_same"]
        assert result["through_wrapper"] == {"installed": True, "on_inner": True, "restored": True}


@distributed
def test_partial_placements_are_refused(ranks):
    for result in ranks:
        assert "Partial placement" in result["partial"]


def _param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.zeros(3))


class _MyAdamW(torch.optim.AdamW):
    pass


@pytest.mark.parametrize(("make", "names"), [
    (lambda: torch.optim.LBFGS([_param()]), "LBFGS is not one of the elementwise optimizers"),
    (lambda: _MyAdamW([_param()]), "_MyAdamW is not one of the elementwise optimizers"),
    (lambda: object(), "object is not a torch.optim.Optimizer"),
    (lambda: torch.optim.AdamW([_param()]), "no parameter is a DTensor"),
])
def test_what_cannot_step_on_local_shards_is_named(make, names):
    optimizer = make()
    assert names in local_shard_problem(optimizer)
    with pytest.raises(ValueError, match=names):
        step_on_local_shards(optimizer)
    assert installed_local_shard_steps(optimizer) is None
    assert restore_step(optimizer) is False


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="this torch has no torch.optim.Adafactor")
def test_adafactor_is_refused_for_its_factored_moments():
    assert "Adafactor is not one of the elementwise optimizers" in local_shard_problem(
        torch.optim.Adafactor([_param()]))


class _Wrapper(torch.optim.Optimizer):
    """A wrapper that keeps the optimizer as ``.optimizer``, as accelerate's AcceleratedOptimizer does."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def test_a_wrapped_optimizer_is_judged_by_the_one_inside():
    inner = torch.optim.LBFGS([_param()])
    assert local_shard_problem(_Wrapper(inner)) == local_shard_problem(inner)
    assert "LBFGS is not one of the elementwise optimizers" in local_shard_problem(_Wrapper(_Wrapper(inner)))
    assert restore_step(_Wrapper(inner)) is False and installed_local_shard_steps(_Wrapper(inner)) is None


def test_a_step_replaced_by_other_code_is_not_bypassed():
    optimizer = torch.optim.AdamW([_param()])
    optimizer.step = lambda closure=None: None
    assert "already replaced on the instance" in local_shard_problem(optimizer)


def test_no_dtensor_message_is_the_constant():
    assert local_shard_problem(torch.optim.SGD([_param()], lr=0.1)) == NO_DTENSOR


def test_describe():
    steps = LocalShardSteps(optimizer="AdamW", sharded_parameters=3, parameters=4)
    assert steps.describe() == "AdamW steps on local shards (3 of 4 parameters are DTensors)"
    with pytest.raises(AttributeError):
        steps.parameters = 5  # type: ignore[misc]
