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
from kvserve.kv import storage
from kvserve.kv.storage import KVStorage
from kvserve.model import layers
from kvserve.sampling import argmax
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
    assert model.layers[1].kv == llm.engine.storage.layer(1).data_ptr()
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
        native.paged_decode(q[:2], kv_cache, batch.block_tables[:2], batch.context_lens[:2], 0.125)
    with pytest.raises(MemoryError, match="paged_prefill: out of memory"):
        native.paged_prefill(q, kv_cache, batch.block_tables, batch.context_lens, torch.tensor([0, 1, 2, 22]), 0.125)


def test_keys_in_lanes_decode_takes_no_memory(out_of_memory):
    """Decode over bfloat16 pages with head_dim a multiple of 32 keeps its scratch on the task's stack: it runs, and
    matches the textbook, where every allocation fails."""
    from attention_cases import make_case

    if not kernels.typed(out_of_memory, "keys_in_lanes")(kernels.DTYPE_KINDS[torch.bfloat16], 64, 4, 1):
        pytest.skip("this build of the kernels has no keys-in-lanes decode (no AVX-512 BW)")
    q, k, v, kv_cache, batch = make_case([1, 1], [9, 70], 2, 8, 2, 64, block_size=4, dtype=torch.bfloat16)
    ref = TextbookBackend().forward(q.float(), k.float(), v.float(), kv_cache.float(), batch, 0.125)
    out = native.paged_decode(q, kv_cache, batch.block_tables, batch.context_lens, 0.125)
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
    ran, typed = [], storage.function
    monkeypatch.setattr(storage, "function", lambda name: lambda *args: ran.append(name) or typed(name)(*args))
    KVStorage.write(cache, kv, torch.tensor([0, 5, 9]))
    assert ran == ["store_kv"]
    assert torch.equal(cache.view(2, 2, 16, 8)[:, :, [0, 5, 9]], kv.permute(1, 2, 0, 3))


def test_store_kv_falls_back_to_torch_or_raises_in_strict_mode(monkeypatch):
    kv = torch.randn(3, 2, 2, 8)
    cache = torch.zeros(2, 2, 4, 4, 16)[..., :8]     # pages whose rows are apart
    monkeypatch.setenv(kernels.STRICT_ENV, "1")
    with pytest.raises(RuntimeError, match="store_kv did not run: the pages are not contiguous"):
        KVStorage.write(cache, kv, torch.tensor([0, 5, 9]))
    monkeypatch.setenv(kernels.STRICT_ENV, "0")
    KVStorage.write(cache, kv, torch.tensor([0, 5, 9]))
    assert torch.equal(cache.reshape(2, 2, 16, 8)[:, :, [0, 5, 9]], kv.permute(1, 2, 0, 3))
