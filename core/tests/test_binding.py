"""Binding: instance attributes set and recorded, put back exactly, and all or nothing."""

from __future__ import annotations

import pytest
import torch
from kernels_core import KernelizeError
from kernels_core._binding import BINDING_ATTR
from kernels_core._binding import MISSING
from kernels_core._binding import Changes
from kernels_core._binding import bind
from kernels_core._binding import check_untouched
from kernels_core._binding import original_forward
from kernels_core._binding import unbind


def _kernel(x):
    return x * 2


def test_unbind_puts_back_what_bind_replaced_and_deletes_what_did_not_exist():
    layer = torch.nn.Linear(2, 2)
    own = layer.__dict__["extra"] = object()
    bind(Changes(), layer, {"forward": _kernel, "extra": "bound"}, (("kind", "k"),))
    record = layer.__dict__[BINDING_ATTR]
    assert layer.forward is _kernel and record.previous == {"forward": MISSING, "extra": own}
    assert original_forward(layer).__func__ is torch.nn.Linear.forward
    assert unbind(Changes(), layer) and not unbind(Changes(), layer)
    assert "forward" not in layer.__dict__ and layer.__dict__["extra"] is own and BINDING_ATTR not in layer.__dict__


def test_a_transaction_that_raises_leaves_every_module_as_it_was():
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    bind(Changes(), first, {"forward": _kernel}, (("kind", "old"),))
    before = [dict(m.__dict__) for m in (first, second)]
    with pytest.raises(KernelizeError, match="would overwrite parameters"), Changes() as changes:
        unbind(changes, first)
        bind(changes, second, {"forward": print}, (("kind", "new"),))
        bind(changes, first, {"weight": _kernel}, (("kind", "new"),))
    assert [m.__dict__ for m in (first, second)] == before
    assert first.__dict__[BINDING_ATTR] is before[0][BINDING_ATTR]


def test_an_attribute_replaced_since_binding_is_never_dropped():
    layer = torch.nn.Linear(2, 2)
    bind(Changes(), layer, {"forward": _kernel}, (("kind", "k"),))
    layer.forward = print  # a wrapper installed after kernelize
    with pytest.raises(KernelizeError, match=r"unkernelize would drop code .*\.forward was set to .* now print"):
        check_untouched(layer, "unkernelize")
