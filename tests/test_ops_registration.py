"""How the ops are registered: ``vim_ds.ops.library.custom_op`` hands torch evaluated annotations.

torch 2.4's ``torch.library.custom_op`` builds the schema from the raw annotations and refuses strings (``Parameter u
has unsupported type Tensor``), which every module here has (``from __future__ import annotations``); newer torch
evaluates them itself. These tests run on any torch: they check what torch 2.4 would read, and that the schema is
the one newer torch derived from the strings (the matrix, tools/version_matrix.sh, imports vim_ds on torch 2.4 for
real).
"""
from __future__ import annotations  # this module's own annotations are strings too: the variant below uses them

import inspect
from typing import Optional

import torch
from torch import Tensor

import vim_ds  # noqa: F401  (registers the ops)
from vim_ds.ops import library, rms_norm, scan_state

OP_MODULES = (library, rms_norm, scan_state)


def _registered_ops():
    ops = [value for module in OP_MODULES for value in vars(module).values()
           if isinstance(value, torch._library.custom_ops.CustomOpDef)]
    assert len(ops) == 12, [op._name for op in ops]  # every torch.ops.vim_ds op
    return ops


def test_the_schemas_use_only_what_torch_24_infers():
    """torch 2.4's schema inference takes typing.List[Tensor], not list[Tensor], as a return (and a dtype as
    ScalarType): the schemas as torch 2.4 builds them."""
    schemas = {op._name: str(getattr(torch.ops.vim_ds, op._name).default._schema) for op in _registered_ops()}
    assert schemas["bimamba_branch_bwd"].endswith("str backend) -> Tensor[]")
    assert schemas["add_rms_norm_bwd"].endswith("ScalarType hidden_dtype, Tensor? scale=None) -> (Tensor, Tensor, "
                                                "Tensor)")


def _string_annotations(fn) -> list[str]:
    signature = inspect.signature(fn)
    named = [(p.name, p.annotation) for p in signature.parameters.values()]
    named.append(("return", signature.return_annotation))
    return [name for name, annotation in named if isinstance(annotation, str)]


def test_every_op_is_registered_with_evaluated_annotations():
    for op in _registered_ops():
        assert _string_annotations(op._init_fn) == [], op._name


def test_a_string_annotated_function_of_another_module_registers_with_its_schema():
    """The variant: a function of this module (its own globals: Tensor, Optional), with a default and a tuple."""
    def scaled(x: Tensor, bias: Optional[Tensor], scale: float = 2.0) -> tuple[Tensor, Tensor]:
        return x * scale, x.clone() if bias is None else x + bias

    op = library.custom_op("vim_ds_test::scaled", mutates_args=())(scaled)
    assert _string_annotations(op._init_fn) == []
    assert str(torch.ops.vim_ds_test.scaled.default._schema) == (
        "vim_ds_test::scaled(Tensor x, Tensor? bias, float scale=2.) -> (Tensor, Tensor)")
    out, plus = op(torch.ones(3), torch.full((3,), 0.5))
    assert out.tolist() == [2.0] * 3 and plus.tolist() == [1.5] * 3
