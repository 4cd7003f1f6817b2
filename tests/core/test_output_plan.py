"""Issue 21: one decision per layer of which output control absorbs dv (`output_plan`), applied
by the engine's hooks and named by the controllability plan."""

from __future__ import annotations

import pytest
from ctxpatch.core.adapters.base import LayerSites, SharedExpert
from ctxpatch.core.controllability import output_plan
from torch import nn

_M = nn.Linear(2, 2)


def _sites(**kw) -> LayerSites:  # type: ignore[no-untyped-def]
    return LayerSites(layer=_M, v_sources=(), inputs=(), **{"out_matrix": _M, **kw})


@pytest.mark.parametrize(("sites", "control", "method", "kind"), [
    (_sites(), "matrix", "direct", "matrix"),
    (_sites(), "bias", "direct", "bias"),
    (_sites(), "experts", "stable", "matrix"),  # a dense layer of an MoE model
    (_sites(out_norm=_M), "scale", "direct", "scale"),
    (_sites(out_norm=_M), "scale", "stable", "stable"),
    (_sites(out_norm=_M), "matrix", "stable", "fit"),  # the frozen-scale demonstration
    (_sites(out_matrix=None, out_norm=_M), "scale", "stable", "scale"),  # no down to fit
    (_sites(out_matrix=None, router=_M, experts=_M), "experts", "direct", "experts"),
    (_sites(out_matrix=None, router=_M, experts=_M, shared=(SharedExpert((), _M),)),
     "matrix", "direct", "shared"),
    (_sites(out_matrix=None, out_norm=_M, router=_M, experts=_M), "scale", "stable", "beside"),
    (_sites(out_matrix=None), "matrix", "direct", "none"),
])
def test_each_layer_shape_gets_one_output_kind(sites, control, method, kind) -> None:  # type: ignore[no-untyped-def]
    plan = output_plan(sites, control, method)
    assert (plan.kind, plan.frozen, plan.acting) == (kind, False, kind)


def test_a_frozen_output_keeps_its_kind_but_nothing_acts() -> None:
    plan = output_plan(_sites(out_norm=_M), "scale", "stable", frozenset({"output"}))
    assert (plan.kind, plan.frozen, plan.acting) == ("stable", True, "none")
    assert output_plan(_sites(), "matrix", "direct", frozenset({"input"})).acting == "matrix"
