"""Family-specific checks of the dense 2025-26 and classic adapters (issue 17) and of the
declarative layouts that read the MLP's matrices from the config's tensor-parallel plan.

The exactness of every family is tests/core/test_ground_truth.py's (tests/tiny_dense.py's
configs are merged into its families); these check where the adapters point.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ctxpatch.core.adapters import REGISTRY, adapter_for_config
from ctxpatch.core.adapters.declarative import Layout, declarative, tp_plan_mlp
from ctxpatch.core.compare import RunSpec, iter_token_patches
from ctxpatch.core.errors import UserError
from ctxpatch.core.prompt import build_prompt
from tiny import tiny_config, tiny_loaded

EXACT = 1e-6  # of the logit scale, as in test_ground_truth.py


def _config(name: str):  # type: ignore[no-untyped-def]
    return tiny_config(name)


def _model(name: str, **overrides):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    config = _config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()


def _sites(name: str, **overrides):  # type: ignore[no-untyped-def]
    model = _model(name, **overrides)
    adapter = adapter_for_config(model.config)
    return adapter, adapter.sites(adapter.layers(model)[1])


def test_the_tp_plan_names_the_mlp_input_and_output_matrices() -> None:
    assert tp_plan_mlp(tiny_config("llama")) == (("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj")
    assert tp_plan_mlp(tiny_config("glm4")) == (("mlp.gate_up_proj",), "mlp.down_proj")
    assert tp_plan_mlp(tiny_config("apertus")) == (("mlp.up_proj",), "mlp.down_proj")
    assert tp_plan_mlp(tiny_config("codegen")) == (("mlp.fc_in",), "mlp.fc_out")
    # an MoE plan's experts are not the dense MLP; a plan without the MLP names nothing
    assert tp_plan_mlp(tiny_config("mixtral")) == ((), None)
    assert tp_plan_mlp(tiny_config("hunyuan_v1_dense")) == ((), None)


def test_a_plan_without_the_mlp_needs_the_layout_to_name_it() -> None:
    model = _model("hunyuan_v1_dense")
    with pytest.raises(NotImplementedError, match="base_model_tp_plan"):
        Layout()(model.model.layers[0])


def test_a_llama_like_family_is_one_line_and_matches_the_llama_adapter() -> None:
    """`declarative` with the default layout points where the hand-written Llama adapter does,
    and runs exactly."""
    loaded = tiny_loaded(tiny_config("llama"))
    layer = loaded.adapter.layers(loaded.model)[0]
    one_line = declarative("Llama again", ("llama",))
    assert one_line.sites(layer) == REGISTRY["llama"].sites(layer)
    loaded = dataclasses.replace(loaded, adapter=one_line)
    prompt = build_prompt(loaded.tokenizer, "The quick brown fox.", "Hello world!")
    steps = list(iter_token_patches(loaded, prompt, RunSpec(max_new_tokens=2)))
    assert all(s.patched.match and s.patched.linf <= 1e-6 * s.logit_scale for s in steps)


@pytest.mark.parametrize("name,inputs,out,norm,parallel", [
    ("ministral3", ("gate_proj", "up_proj"), "down_proj", None, False),
    ("ernie4_5", ("gate_proj", "up_proj"), "down_proj", None, False),
    ("seed_oss", ("gate_proj", "up_proj"), "down_proj", None, False),
    ("hunyuan_v1_dense", ("gate_proj", "up_proj"), "down_proj", None, False),
    ("olmo3", ("gate_proj", "up_proj"), "down_proj", "post_feedforward_layernorm", False),
    ("exaone4", ("gate_proj", "up_proj"), "down_proj", "post_feedforward_layernorm", False),
    ("glm4", ("gate_up_proj",), "down_proj", "post_mlp_layernorm", False),
    ("apertus", ("up_proj",), "down_proj", None, False),
    ("arcee", ("up_proj",), "down_proj", None, False),
    ("phi", ("fc1",), "fc2", None, True),
    ("starcoder2", ("c_fc",), "c_proj", None, False),
    ("stablelm", ("gate_proj", "up_proj"), "down_proj", None, False),
    ("stablelm_parallel", ("gate_proj", "up_proj"), "down_proj", None, True),
    ("codegen", ("fc_in",), "fc_out", None, True),
    ("gpt_bigcode", ("c_fc",), "c_proj", None, False),
    ("bloom", ("dense_h_to_4h",), "dense_4h_to_h", None, False),
    ("opt", ("fc1",), "fc2", None, False),
    ("mpt", ("up_proj",), "down_proj", None, False),
])
def test_sites_name_the_family_modules(
    name: str, inputs: tuple[str, ...], out: str, norm: str | None, parallel: bool
) -> None:
    adapter, s = _sites(name)
    owner = s.layer if name.startswith("opt") else (s.layer.ffn if name == "mpt" else s.layer.mlp)
    assert [m for _, m in s.inputs] == [getattr(owner, n) for n in inputs]
    assert s.out_matrix is getattr(owner, out)
    assert (s.out_norm is None) == (norm is None)
    if norm is not None:
        assert s.out_norm is getattr(s.layer, norm)
        assert adapter.output_controls[0] == "scale"
    assert s.parallel == parallel
    if parallel:
        assert [k for _, k in s.v_sources] == ["input", "output"]
        assert s.v_sources[0][0] is s.layer


def test_where_v_is_read_in_the_classic_variants() -> None:
    _, s = _sites("bloom")
    assert s.v_sources == ((s.layer.post_attention_layernorm, "input"),)
    _, s = _sites("bloom_post_ln_residual")  # the MLP's residual is its normed input: v = z
    assert s.v_sources == ((s.layer.post_attention_layernorm, "output"),)
    _, s = _sites("opt")
    assert s.v_sources == ((s.layer.final_layer_norm, "input"),)
    _, s = _sites("opt_post_ln")  # OPT-350m: post-LayerNorm, the MLP reads v itself
    assert s.v_sources == ((s.layer.self_attn_layer_norm, "output"),)
    _, s = _sites("mpt")
    assert s.v_sources == ((s.layer.norm_2, "input"),)


def test_mpt_layers_are_found_under_transformer_blocks() -> None:
    model = _model("mpt")
    assert adapter_for_config(model.config).layers(model) is model.transformer.blocks


def test_bloom_slow_but_exact_tensor_parallel_mlp_is_refused() -> None:
    model = _model("bloom", pretraining_tp=2, slow_but_exact=True)
    adapter = adapter_for_config(model.config)
    with pytest.raises(UserError, match="slow_but_exact"):
        adapter.sites(adapter.layers(model)[0])


def test_bias_controls_are_offered_where_the_family_can_have_biases() -> None:
    for name in ("ernie4_5", "seed_oss", "arcee", "phi", "starcoder2", "codegen", "gpt_bigcode",
                 "bloom", "opt"):
        adapter, s = _sites(name)
        assert "bias" in adapter.output_controls, name
        assert s.out_matrix.bias is not None, name  # the tiny configs build them
    for name in ("ministral3", "hunyuan_v1_dense", "stablelm", "mpt", "glm4", "apertus"):
        assert "bias" not in adapter_for_config(_config(name)).output_controls, name
