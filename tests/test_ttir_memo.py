"""flash_backend/_ttir_memo.py: torch's generate_ttir, done once per specialisation of our kernels.

CPU: the cache key, against a stand-in generate_ttir that counts its calls (the real one needs a GPU
target). CUDA: on a compiled model, every call the cache answers is compared with a fresh generation.
"""

import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from flash_backend import _ttir_memo
from flash_backend.kernels.add_dropout_norm_kernels import _add_dropout_norm_fwd_kernel
from flash_backend.kernels.attention_fwd import _attention_fwd_kernel


class _CountingGenerate:
    """Stands in for torch's generate_ttir: returns a fresh object per real call and counts the calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, kernel, kwargs, tma_descriptor_metadata=None):
        self.calls += 1
        return object(), sorted(kwargs)


def _fake_kwargs(mode, dtype=torch.bfloat16, n=64, flag=True):
    with mode:
        x = torch.empty(8, n, dtype=dtype)
        out = torch.empty(8, n, dtype=dtype)
    return {"x": x, "out": out, "n": n, "BLOCK": 128, "FLAG": flag, "eps": 1e-5}


def test_same_specialisation_is_generated_once_and_every_difference_is_a_miss():
    stand_in = _CountingGenerate()
    generate = _ttir_memo._memoize(stand_in, _ttir_memo._copy_ttir)
    mode = FakeTensorMode()
    first = generate(_attention_fwd_kernel, _fake_kwargs(mode), {})
    again = generate(_attention_fwd_kernel, _fake_kwargs(mode), {})  # new fake tensors, same key
    assert stand_in.calls == 1
    assert again[0] is first[0] and again[1] == first[1]
    again[1].append("caller's own list")  # a caller mutating its names must not touch the cache
    assert generate(_attention_fwd_kernel, _fake_kwargs(mode), {})[1] == first[1]
    assert stand_in.calls == 1

    for kernel, kwargs in [
        (_attention_fwd_kernel, _fake_kwargs(mode, dtype=torch.float16)),  # dtype
        (_attention_fwd_kernel, _fake_kwargs(mode, n=65)),  # an int Triton specialises on
        (_attention_fwd_kernel, _fake_kwargs(mode, flag=1)),  # 1 == True, but another type
        (_add_dropout_norm_fwd_kernel, _fake_kwargs(mode)),  # another kernel
    ]:
        before = stand_in.calls
        generate(kernel, kwargs, {})
        assert stand_in.calls == before + 1


def test_torchs_per_call_site_autotuner_wrappers_share_one_entry():
    """A launch with num_warps is traced as a new single-config Autotuner around our kernel per call site."""
    import triton

    def wrapped(num_warps=4, **config_kwargs):
        return triton.autotune(configs=[triton.Config(config_kwargs, num_warps=num_warps)], key=[])(
            _attention_fwd_kernel)

    stand_in = _CountingGenerate()
    generate = _ttir_memo._memoize(stand_in, _ttir_memo._copy_ttir)
    mode = FakeTensorMode()
    for _ in range(3):
        generate(wrapped(), _fake_kwargs(mode), {})
    assert stand_in.calls == 1
    generate(_attention_fwd_kernel, _fake_kwargs(mode), {})  # unwrapped: no config, its own entry
    generate(wrapped(num_warps=8), _fake_kwargs(mode), {})
    generate(wrapped(BLOCK_M=64), _fake_kwargs(mode), {})
    assert stand_in.calls == 4


def test_symbolic_sizes_share_one_entry():
    stand_in = _CountingGenerate()
    generate = _ttir_memo._memoize(stand_in, _ttir_memo._copy_ttir)
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    for _ in range(3):
        kwargs = _fake_kwargs(mode)
        kwargs["n"] = shape_env.create_unbacked_symint()  # generate_ttir replaces every one with 2
        generate(_attention_fwd_kernel, kwargs, {})
    assert stand_in.calls == 1


def _inductor_buffer(dtype, n=64):
    from torch._inductor import ir

    layout = ir.FixedLayout(torch.device("cpu"), dtype, [8, n])
    return ir.TensorBox(ir.StorageBox(ir.InputBuffer(name="buf", layout=layout)))


@pytest.mark.parametrize("tensor_kind", [True, False])
def test_fake_tensors_and_inductor_buffers_share_the_ir_entry_only(tensor_kind):
    """generate_ttir (tensor_kind=False) sees a fake tensor and an Inductor buffer of one dtype alike; the
    analyses (tensor_kind=True) keep them apart. A buffer of another dtype is a miss either way."""
    stand_in = _CountingGenerate()
    generate = _ttir_memo._memoize(stand_in, _ttir_memo._copy_ttir, tensor_kind)
    kwargs = _fake_kwargs(FakeTensorMode())
    generate(_attention_fwd_kernel, kwargs, {})
    lowered = {**kwargs, "x": _inductor_buffer(torch.bfloat16), "out": _inductor_buffer(torch.bfloat16)}
    generate(_attention_fwd_kernel, lowered, {})
    assert stand_in.calls == (2 if tensor_kind else 1)
    generate(_attention_fwd_kernel, {**lowered, "x": _inductor_buffer(torch.float16)}, {})
    assert stand_in.calls == (3 if tensor_kind else 2)
    assert "generate_ttir" in _ttir_memo._TENSOR_KIND_BLIND
    assert not {"identify_mutated_tensors", "identify_accessed_tensors"} & _ttir_memo._TENSOR_KIND_BLIND


@pytest.mark.parametrize("case", ["real tensor", "tma metadata", "unhashable", "not our kernel"])
def test_what_the_key_cannot_describe_is_never_cached(case):
    stand_in = _CountingGenerate()
    generate = _ttir_memo._memoize(stand_in, _ttir_memo._copy_ttir)
    kwargs = _fake_kwargs(FakeTensorMode())
    kernel, tma = _attention_fwd_kernel, {}
    if case == "real tensor":  # Triton specialises on a real pointer's alignment
        kwargs["x"] = torch.randn(8, 64)
    elif case == "tma metadata":
        tma = {"x": ("stable", ([64, 64],))}
    elif case == "unhashable":
        kwargs["n"] = [64]
    else:
        kernel = copy.copy(_attention_fwd_kernel)
        kernel.fn = test_what_the_key_cannot_describe_is_never_cached  # a function of this module
    generate(kernel, kwargs, tma)
    generate(kernel, kwargs, tma)
    assert stand_in.calls == 2


def test_install_is_idempotent_and_wraps_torchs_functions(monkeypatch):
    from torch._higher_order_ops import triton_kernel_wrap

    present = {name: getattr(triton_kernel_wrap, name) for name in _ttir_memo._WRAPPED
               if hasattr(triton_kernel_wrap, name)}
    assert "generate_ttir" in present
    for name, original in present.items():
        monkeypatch.setattr(triton_kernel_wrap, name, getattr(original, "__wrapped__", original))
    assert _ttir_memo.install()
    wrapped = {name: getattr(triton_kernel_wrap, name) for name in present}
    for name, function in wrapped.items():
        assert function.__wrapped__ is getattr(present[name], "__wrapped__", present[name])
    assert _ttir_memo.install()
    assert all(getattr(triton_kernel_wrap, name) is function for name, function in wrapped.items())


@pytest.mark.cuda
def test_cuda_every_cached_answer_equals_a_fresh_computation(monkeypatch):
    """Compile a small GPT-2 with the flash backend; each call the caches answer is checked against torch's
    own function run again on the same arguments (the same IR text and argument names; the same
    written-tensor analysis)."""
    import transformers
    from torch._higher_order_ops import triton_kernel_wrap

    from flash_backend.backend import flash_backend as flash_backend_fn

    hits = {}

    def checking(name, original, copy_result):
        tensor_kind = name not in _ttir_memo._TENSOR_KIND_BLIND
        memoized = _ttir_memo._memoize(original, copy_result, tensor_kind)

        def check(kernel, kwargs, tma_descriptor_metadata=None):
            entries = len(memoized._flash_cache)
            result = memoized(kernel, kwargs, tma_descriptor_metadata)
            key = _ttir_memo._cache_key(kernel, kwargs, tma_descriptor_metadata, tensor_kind)
            cacheable = key is not None
            if cacheable and len(memoized._flash_cache) == entries:  # answered from the cache
                hits[name] = hits.get(name, 0) + 1
                fresh = original(kernel, kwargs, tma_descriptor_metadata)
                if name == "generate_ttir":
                    assert str(result[0]) == str(fresh[0]) and result[1] == list(fresh[1])
                else:
                    assert result == fresh
            return result

        check._flash_cache = memoized._flash_cache  # install() sees it as already wrapped
        return check

    for name, copy_result in _ttir_memo._WRAPPED.items():
        current = getattr(triton_kernel_wrap, name, None)
        if current is not None:
            original = getattr(current, "__wrapped__", current)
            monkeypatch.setattr(triton_kernel_wrap, name, checking(name, original, copy_result))
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=500, n_positions=128,
                                  attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(cfg).cuda().to(torch.bfloat16).train()
    ids = torch.randint(0, 500, (2, 128), device="cuda")
    compiled = torch.compile(model, backend=flash_backend_fn)
    compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert sum(hits.values()) > 0, hits
