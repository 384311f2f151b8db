"""The launch-time specialisation settings of the Triton kernels (checked without a GPU)."""
from kernels.jit_stats import compiled_variant_count
from kernels.triton_attention import _merge_segments_kernel, _paged_attention_kernel


def _unspecialised(fn) -> set[str]:
    """Argument names excluded from specialisation (compiled JITFunction or the interpreter's wrapper)."""
    names = fn.arg_names if hasattr(fn, "arg_names") else list(fn.signature.parameters)
    dns = getattr(fn, "do_not_specialize", None)
    if dns is None:
        dns = fn.kwargs["do_not_specialize"]  # TRITON_INTERPRET=1: InterpretedFunction keeps the jit kwargs
    return {n for i, n in enumerate(names) if i in dns or n in dns}


def test_step_varying_integers_are_not_specialised():
    assert _unspecialised(_paged_attention_kernel) == {"num_seqs", "ml_plane", "stride_bt_seq", "decode_only"}
    assert _unspecialised(_merge_segments_kernel) == {"num_seqs", "ml_plane"}


def test_compiled_variant_count_is_a_count_or_none():
    n = compiled_variant_count()
    assert n is None or (isinstance(n, int) and n >= 0)
