"""TORCH_CUDA_ARCH_LIST with a family suffix (9.0a, 10.0f), as Hopper and Blackwell images set it, made readable for
DeepSpeed's JIT builder (vim_ds/runtime/cuda_arch.py). DeepSpeed's own CUDA builder parses the lists here: it runs
without a GPU because an arch list is given, so the check is the real parser, not a copy of it."""
import importlib

import pytest

from vim_ds.runtime import cuda_arch


def deepspeed_parses(arch_list: str):
    """Run DeepSpeed's JIT-mode arch-list parsing (CUDAOpBuilder.compute_capability_args) on `arch_list`."""
    builder_module = importlib.import_module("deepspeed.ops.op_builder.builder")

    class Probe(builder_module.CUDAOpBuilder):
        NAME = "probe"

        def __init__(self):
            super().__init__(name="probe")

        def sources(self):
            return []

        def absolute_name(self):
            return "probe"

    probe = Probe()
    probe.jit_mode = True
    probe._jit_arch_list = arch_list
    return probe.compute_capability_args()


@pytest.mark.parametrize("given, read", [
    ("9.0a", "9.0"), ("10.0f", "10.0"), ("8.0;9.0a+PTX", "8.0;9.0+PTX"), ("8.6 9.0a 10.0a", "8.6;9.0;10.0"),
    ("12.0a", "12.0"),
])
def test_a_family_suffix_is_dropped_and_deepspeed_then_parses_the_list(given, read, monkeypatch):
    # the bug this guards: DeepSpeed stops the run on the list as the image sets it
    with pytest.raises(ValueError, match="invalid literal for int"):
        deepspeed_parses(given)
    environ = {cuda_arch.VARIABLE: given}
    note = cuda_arch.readable_by_deepspeed(environ)
    assert environ[cuda_arch.VARIABLE] == read
    assert note == (f"note: TORCH_CUDA_ARCH_LIST={given} read as {read} for the ops DeepSpeed builds (its builder "
                    f"cannot parse the family suffix)")
    monkeypatch.delenv(cuda_arch.VARIABLE, raising=False)
    deepspeed_parses(read)


@pytest.mark.parametrize("given", ["9.0", "8.0;9.0+PTX", "7.5 8.6", "Hopper", ""])
def test_a_list_deepspeed_reads_is_left_alone_without_a_note(given):
    environ = {cuda_arch.VARIABLE: given}
    assert cuda_arch.readable_by_deepspeed(environ) is None
    assert environ == {cuda_arch.VARIABLE: given}
    assert cuda_arch.readable_by_deepspeed({}) is None
