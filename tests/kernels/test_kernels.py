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
from kvserve.engine.native_decode import STRUCTS, step_plan
from kvserve.kv import pages
from kvserve.model import layers
from kvserve.sampling import argmax
from kvserve.kv.pages import FullPages

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


HEADER = (kernels.CSRC / "decode_step.h").read_text()


def test_the_ctypes_structs_are_the_headers_and_the_librarys():
    """Built from csrc/decode_step.h, field by field in its order and of its types, and laid out as the compiler
    laid out the library's."""
    lib = kernels.library()
    for name in ("Proj", "Layer", "Model"):
        kernels.check_layout(lib, STRUCTS[name])
    layout = kernels.c_layout(lib)
    assert set(layout) == {"Proj", "Layer", "Model"}
    model = layout["Model"]
    assert [f for f, _, _ in model[1:]] == [f for f, _ in STRUCTS["Model"]._fields_]
    types = {f: t for f, t, _ in model}
    assert (types["embed"], types["lm_head"], types["layers"], types["all_reduce"], types["vocab_start"]) == \
        ("const void *", "Proj", "const Layer *", "AllReduce", "int64_t")
    assert dict(STRUCTS["Model"]._fields_)["layers"] is ctypes.POINTER(STRUCTS["Layer"])


def _header_with(old: str, new: str) -> str:
    assert old in HEADER
    return HEADER.replace(old, new)


@pytest.mark.parametrize("old, new", [
    ("    int64_t vocab_start;\n", "    int64_t vocab_start;\n    int extra;\n"),
    ("    int64_t vocab_start;\n", ""),
    ("float eps, scale;", "float scale, eps;"),
    ("int64_t window;", "int64_t sliding_window;"),
    # of the same size, at the same offset: only its type tells
    ("int kv_kind, rotate_keys;", "float kv_kind;\n    int rotate_keys;"),
], ids=["a-field-python-only", "a-field-c-only", "two-fields-swapped", "a-field-renamed", "a-field-retyped"])
def test_structs_that_differ_from_the_librarys_fail_the_check(old, new):
    structs = kernels.c_structs(_header_with(old, new))
    name = "Layer" if "kv_kind" in old or "window" in old else "Model"
    with pytest.raises(RuntimeError, match=f"ctypes structure {name} does not match"):
        kernels.check_layout(kernels.library(), structs[name])


@pytest.mark.parametrize("header", ["typedef struct { double x; } S;", "typedef struct { int a, *b; } S;",
                                    "typedef struct { Unknown *p; } S;", "int f(void);"])
def test_the_header_reader_refuses_what_it_does_not_read(header):
    with pytest.raises(ValueError, match="c_structs"):
        kernels.c_structs(header)


def test_the_step_plan_fills_every_field_and_refuses_one_left_out(tiny_llama):
    """kernels.fill sets every field of the structs by name, those of the nested Proj and of each Layer too: a plan
    that leaves a field out, or names one the struct has not, is refused, naming it."""
    llm = LLM(str(tiny_llama), block_size=4, num_kv_blocks=16, dtype="float32")
    plan = step_plan(llm.engine.model, llm.engine.storage, STRUCTS["AllReduce"]())
    model = kernels.fill(STRUCTS["Model"], plan)
    assert model.num_layers == 2 and model.layers[1].qkv.kind == plan["layers"][1]["qkv"]["kind"]
    assert model.layers[1].kv == llm.engine.storage.layer(1).pages.data_ptr()
    for part, field in [(lambda p: p, "logit_cap"), (lambda p: p["layers"][1], "window"),
                        (lambda p: p["lm_head"], "amx_from"), (lambda p: p["layers"][0]["down"], "b")]:
        plan = step_plan(llm.engine.model, llm.engine.storage, STRUCTS["AllReduce"]())
        del part(plan)[field]
        with pytest.raises(ValueError, match=f"unset: {field}$"):
            kernels.fill(STRUCTS["Model"], plan)
    plan = step_plan(llm.engine.model, llm.engine.storage, STRUCTS["AllReduce"]())
    plan["layers"][0]["sliding"] = 4
    with pytest.raises(ValueError, match="Layer: .*not its fields: sliding"):
        kernels.fill(STRUCTS["Model"], plan)


# ---- allocations that fail ---------------------------------------------------------------------------------

FAILING_ALLOCATIONS = """#include <stdlib.h>
#define malloc(n) ((void)(n), (void *)0)
#define calloc(n, size) ((void)(n), (void)(size), (void *)0)
#define aligned_alloc(alignment, n) ((void)(alignment), (void)(n), (void *)0)
"""


# aligned_alloc (csrc/gemm.c's per-thread scratch) failing on the odd threads of a team only
FAILING_ON_ODD_THREADS = """#include <omp.h>
#include <stdlib.h>
#define aligned_alloc(alignment, n) (omp_get_thread_num() % 2 ? (void *)0 : aligned_alloc(alignment, n))
"""


def build_with(path, header: str) -> ctypes.CDLL:
    """The kernels built with `header` included first in every source (its macros in force)."""
    (path / "failing.h").write_text(header)
    wrapper = path / "cc-failing"
    wrapper.write_text(f'#!/bin/sh\nexec cc -include {path / "failing.h"} "$@"\n')
    wrapper.chmod(0o755)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("CC", str(wrapper))
        m.setenv("KVSERVE_CACHE", str(path / "cache"))
        return ctypes.CDLL(str(kernels.build()))


@pytest.fixture(scope="module")
def no_memory(tmp_path_factory):
    """The kernels built so that every allocation fails."""
    return build_with(tmp_path_factory.mktemp("no-memory"), FAILING_ALLOCATIONS)


@pytest.fixture(scope="module")
def odd_threads_no_memory(tmp_path_factory):
    """The kernels built so that a thread's scratch memory runs out on the odd threads of a team."""
    return build_with(tmp_path_factory.mktemp("odd-threads-no-memory"), FAILING_ON_ODD_THREADS)


def _gemm_by(lib: ctypes.CDLL, monkeypatch, *args, **kwargs) -> torch.Tensor:
    """layers.gemm by the kernels of lib, on two threads."""
    monkeypatch.setattr(kernels, "library", lambda: lib)
    layers._gemm_function.cache_clear()
    try:
        torch.set_num_threads(2)
        return layers.gemm(*args, **kwargs)
    finally:
        monkeypatch.undo()
        layers._gemm_function.cache_clear()


def test_a_thread_whose_scratch_runs_out_takes_its_team_another_way(no_memory, odd_threads_no_memory, monkeypatch):
    """csrc/gemm.c's int4 products of bfloat16 rows by VNNI put each thread's rows in fixed point in its own scratch;
    where that memory runs out on one thread of the team, every thread widens the chunks instead (as where every
    allocation fails), so that each output is computed one way, whichever thread computes it."""
    if not layers.gemm_packs(torch.bfloat16) or "avx512_vnni" not in open("/proc/cpuinfo").read() or \
            "avx512" not in layers.gemm_kernels(torch.bfloat16):
        pytest.skip("csrc/gemm.c multiplies int4 weights by bfloat16 rows without VNNI here: no scratch to run out")
    g = torch.Generator().manual_seed(0)
    # each group of 32 inputs leads with 2^20, whose weight is 0: the others' fixed point is coarse (see
    # test_weight_quant's test_int4_bfloat16_products_take_x_in_fixed_point_per_group), the widened ones exact
    w, x = torch.rand(256, 512, generator=g), torch.randn(5, 512, generator=g)
    w[:, ::32], x[:, ::32] = 0.0, 2.0 ** 20
    q, scales, mins = layers.quantize_int4(w)
    packed, groups = layers.gemm_pack(q, dtype=torch.bfloat16), layers.gemm_pack_groups(scales, mins, False,
                                                                                          torch.bfloat16)
    x = x.bfloat16()
    fixed, widened, odd = (_gemm_by(lib, monkeypatch, x, packed, None, 256, scales=groups)
                           for lib in (kernels.library(), no_memory, odd_threads_no_memory))
    assert not torch.equal(fixed, widened)          # the two ways round apart: a mix of them would show
    assert torch.equal(odd, widened)


def test_a_thread_whose_amx_copies_run_out_takes_its_team_to_avx512(odd_threads_no_memory, monkeypatch):
    """AMX's tiles read each thread's copy of the rows from its scratch: where that memory runs out on one thread of
    the team, the whole team runs AVX-512's kernel (a thread that went alone into AVX-512's loops would leave the
    AMX loops' share of it undone, and its team waiting): AVX-512's products, bit for bit."""
    monkeypatch.setattr(kernels, "library", lambda: odd_threads_no_memory)
    layers._gemm_function.cache_clear()
    amx = "amx" in layers.gemm_kernels(torch.bfloat16)       # (asks the OS for the tile state in this build too)
    monkeypatch.undo()
    layers._gemm_function.cache_clear()
    if not amx or "amx" not in layers.gemm_kernels(torch.bfloat16):
        pytest.skip("this CPU has no AMX (or the OS does not grant it)")
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 2048, generator=g).bfloat16(), torch.randn(35, 2048, generator=g).bfloat16()
    packed = layers.gemm_pack(w)
    avx512 = _gemm_by(kernels.library(), monkeypatch, x, packed, None, 96, amx_from=layers.NEVER)
    assert not torch.equal(_gemm_by(kernels.library(), monkeypatch, x, packed, None, 96, amx_from=1), avx512)
    assert torch.equal(_gemm_by(odd_threads_no_memory, monkeypatch, x, packed, None, 96, amx_from=1), avx512)


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
def test_decode_steps_out_of_memory_raise_memory_error(checkpoint, no_memory, monkeypatch, steps, kernel):
    """The step fails with the error, and the engine goes on: nothing the failed step reserved stays held."""
    llm = LLM(str(checkpoint("llama")), block_size=4, num_kv_blocks=64, dtype="float32",
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
