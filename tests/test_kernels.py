"""The contract between the C kernels and Python (kvserve.kernels): every signature declared once and as C
declares it, the decode step's structs laid out alike on both sides, allocation failures raised as
MemoryError, and fallbacks that strict mode (KVSERVE_STRICT_KERNELS=1) turns into errors."""
from __future__ import annotations

import ctypes
import re
import shutil

import pytest
import torch

from kvserve import LLM, SamplingParams, kernels
from kvserve.attention import native
from kvserve.attention.textbook import TextbookBackend
from kvserve.engine.native_decode import _Layer, _Model, _Proj
from kvserve.kv import pages
from kvserve.model import layers
from kvserve.sampling import argmax
from kvserve.kv.pages import FullPages
from tiny_models import make_checkpoint

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
RESULTS = {"void": (None,), "int": (kernels.Status, ctypes.c_int), "int64_t": (ctypes.c_int64,)}


def c_functions() -> dict[str, tuple[str, int]]:
    """The functions csrc/*.c exports (not static): name -> (result type, number of parameters)."""
    found = {}
    for path in kernels.CSRC.glob("*.c"):
        for result, name, params in re.findall(r"^(void|int|int64_t) (\w+)\(([^)]*)\)", path.read_text(), re.M):
            found[name] = (result, 0 if params.strip() in ("", "void") else params.count(",") + 1)
    return found


def test_every_kernel_is_declared_once_as_c_declares_it():
    """A kernel whose result or parameters change on one side only (a status that Python would not check,
    an argument it would not pass) fails here; so does a function the library exports that is neither
    declared for Python nor shared between the C files (common.h)."""
    exported = c_functions()
    shared = set(re.findall(r"^\w+ \*?(\w+)\(", (kernels.CSRC / "common.h").read_text(), re.M))
    assert set(kernels.SIGNATURES) <= set(exported) and set(exported) - set(kernels.SIGNATURES) <= shared
    for name in kernels.SIGNATURES:
        result, num_params = exported[name]
        argtypes, restype = kernels.SIGNATURES[name]
        assert restype in RESULTS[result] and len(argtypes) == num_params, name
        assert kernels.function(name).argtypes == list(argtypes)


def test_the_ctypes_structs_are_the_c_structs():
    lib = kernels.library()
    for structure, name in ((_Proj, "Proj"), (_Layer, "Layer"), (_Model, "Model")):
        kernels.check_layout(lib, structure, name)
    assert kernels.c_layout(lib)["Model"] == {"": ctypes.sizeof(_Model),
                                              **{f: getattr(_Model, f).offset for f, _ in _Model._fields_}}


@pytest.mark.parametrize("fields", [[*_Model._fields_, ("extra", ctypes.c_int)], _Model._fields_[:-1],
                                    [*_Model._fields_[:2], *_Model._fields_[3:4], *_Model._fields_[2:3],
                                     *_Model._fields_[4:]]],
                         ids=["a-field-python-only", "a-field-c-only", "two-fields-swapped"])
def test_a_struct_that_differs_from_cs_fails_the_check(fields):
    structure = type("Model", (ctypes.Structure,), {"_fields_": fields})
    with pytest.raises(RuntimeError, match="does not match the C struct Model"):
        kernels.check_layout(kernels.library(), structure, "Model")


# ---- allocations that fail ---------------------------------------------------------------------------------

FAILING_ALLOCATIONS = """#include <stdlib.h>
#define malloc(n) ((void)(n), (void *)0)
#define calloc(n, size) ((void)(n), (void)(size), (void *)0)
#define aligned_alloc(alignment, n) ((void)(alignment), (void)(n), (void *)0)
"""


@pytest.fixture(scope="module")
def no_memory(tmp_path_factory):
    """The kernels built so that every allocation fails."""
    path = tmp_path_factory.mktemp("no-memory")
    (path / "failing.h").write_text(FAILING_ALLOCATIONS)
    wrapper = path / "cc-no-memory"
    wrapper.write_text(f'#!/bin/sh\nexec cc -include {path / "failing.h"} "$@"\n')
    wrapper.chmod(0o755)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("CC", str(wrapper))
        m.setenv("KVSERVE_CACHE", str(path / "cache"))
        return ctypes.CDLL(str(kernels.build()))


@pytest.fixture
def out_of_memory(no_memory, monkeypatch):
    """Every kernel from the library whose allocations fail."""
    monkeypatch.setattr(kernels, "library", lambda: no_memory)
    return no_memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_out_of_memory_raises_memory_error(out_of_memory, dtype):
    from attention_cases import make_case

    # head_dim 72: not the keys-in-lanes decode, which takes no memory (below)
    q, k, v, kv_cache, batch = make_case([1, 1, 20], [9, 30, 20], 2, 8, 2, 72, block_size=4, dtype=dtype)
    with pytest.raises(MemoryError, match="paged_decode: out of memory"):
        native.paged_decode(q[:2], FullPages(kv_cache), batch.block_tables[:2], batch.context_lens[:2], 0.125)
    with pytest.raises(MemoryError, match="paged_prefill: out of memory"):
        native.paged_prefill(q, FullPages(kv_cache), batch.block_tables, batch.context_lens,
                             torch.tensor([0, 1, 2, 22]), 0.125)


def test_keys_in_lanes_decode_takes_no_memory(out_of_memory):
    """Decode over bfloat16 pages with head_dim a multiple of 32 keeps its scratch on the task's stack: it runs, and
    matches the textbook, where every allocation fails."""
    from attention_cases import make_case

    if not kernels.typed(out_of_memory, "keys_in_lanes")(kernels.DTYPE_KINDS[torch.bfloat16], 64, 4, 1):
        pytest.skip("this build of the kernels has no keys-in-lanes decode (no AVX-512 BW)")
    q, k, v, kv_cache, batch = make_case([1, 1], [9, 70], 2, 8, 2, 64, block_size=4, dtype=torch.bfloat16)
    ref = TextbookBackend().forward(q.float(), k.float(), v.float(), FullPages(kv_cache.float()), batch, 0.125)
    out = native.paged_decode(q, FullPages(kv_cache), batch.block_tables, batch.context_lens, 0.125)
    torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def test_rms_norm_out_of_memory_raises_memory_error(out_of_memory):
    norm = layers.RMSNorm(64, 1e-5)
    norm.weight.data.fill_(1.0)
    with pytest.raises(MemoryError, match="add_rms_norm: out of memory"):
        norm(torch.randn(3, 64), torch.randn(3, 64))


@pytest.mark.parametrize("steps, kernel", [(1, "decode_step"), (8, "decode_steps")])
def test_decode_steps_out_of_memory_raise_memory_error(tmp_path, no_memory, monkeypatch, steps, kernel):
    """The step fails with the error, and the engine goes on: nothing the failed step reserved stays held."""
    llm = LLM(str(make_checkpoint(tmp_path, "llama")), block_size=4, num_kv_blocks=64, dtype="float32",
              num_scheduler_steps=steps)
    native_decode = llm.engine.runner.native
    native_decode.fn, native_decode.steps_fn = (kernels.typed(no_memory, n) for n in ("decode_step", "decode_steps"))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with pytest.raises(MemoryError, match=f"{kernel}: out of memory"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_running"] == 0


# ---- strict mode -------------------------------------------------------------------------------------------

def test_strict_mode_is_on_in_the_tests_where_the_kernels_run():
    assert kernels.strict() == all(layers.gemm_packs(dtype) for dtype in kernels.COMPUTE_DTYPES)


def test_argmax_falls_back_to_torch_or_raises_in_strict_mode(monkeypatch):
    x = torch.randn(40, 3, generator=torch.Generator().manual_seed(0)).t()       # rows whose numbers are apart
    monkeypatch.setenv(kernels.STRICT_ENV, "1")
    with pytest.raises(RuntimeError, match="argmax_rows did not run: a row's numbers are not adjacent"):
        argmax(x)
    monkeypatch.setenv(kernels.STRICT_ENV, "0")
    assert torch.equal(argmax(x), x.argmax(-1))


def test_store_kv_copies_tokens_whose_heads_are_apart_into_rows_it_writes(monkeypatch):
    """An eviction's gathered tokens are not views of qkv rows: the C loop still writes them."""
    kv = torch.randn(3, 2, 2, 8).transpose(2, 3).contiguous().transpose(2, 3)     # heads not adjacent
    cache = torch.zeros(2, 2, 4, 4, 8)
    ran, typed = [], pages.function
    monkeypatch.setattr(pages, "function", lambda name: lambda *args: ran.append(name) or typed(name)(*args))
    FullPages(cache).write_tokens(kv, torch.tensor([0, 5, 9]))
    assert ran == ["store_kv"]
    assert torch.equal(cache.view(2, 2, 16, 8)[:, :, [0, 5, 9]], kv.permute(1, 2, 0, 3))


def test_store_kv_falls_back_to_torch_or_raises_in_strict_mode(monkeypatch):
    kv = torch.randn(3, 2, 2, 8)
    cache = torch.zeros(2, 2, 4, 4, 16)[..., :8]     # pages whose rows are apart
    monkeypatch.setenv(kernels.STRICT_ENV, "1")
    with pytest.raises(RuntimeError, match="store_kv did not run: the pages are not contiguous"):
        FullPages(cache).write_tokens(kv, torch.tensor([0, 5, 9]))
    monkeypatch.setenv(kernels.STRICT_ENV, "0")
    FullPages(cache).write_tokens(kv, torch.tensor([0, 5, 9]))
    assert torch.equal(cache.reshape(2, 2, 16, 8)[:, :, [0, 5, 9]], kv.permute(1, 2, 0, 3))
