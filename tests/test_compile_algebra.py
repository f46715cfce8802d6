"""benchmarks/compile_algebra.py (issue 56): on a tiny layer, the per-layer algebra compiled by inductor gives what the
eager path gives, with positive operator and launch counts; skipped where inductor cannot compile (no C++ compiler)."""

import argparse

import pytest
import torch

from helpers import load_benchmark

ca = load_benchmark("compile_algebra")
# maps (in, out, input id) at T = 12: two factored ones reading one input (their Grams grouped by
# summed_self_products), one materialized (materializing_saves_memory: 8 x 32 <= 12 x (8 + 32))
TINY = [(32, 32, 0), (32, 48, 0), (8, 32, 1)]


@pytest.fixture(scope="module")
def inductor():
    """Inductor's config for these tests (its caches off, compiling in this process), restored after them; skips
    where it cannot compile at all."""
    with torch._inductor.config.patch(compile_threads=1, fx_graph_cache=False):
        try:
            torch._dynamo.reset()
            torch.compile(lambda x: (x * 2 + 1).sum(0))(torch.ones(4, 4))
        except Exception as error:  # noqa: BLE001 - no C++ compiler, a broken toolchain: not this test's subject
            pytest.skip(f"inductor cannot compile here: {type(error).__name__}: {error}")
        yield
    torch._dynamo.reset()


def args(**over):
    base = dict(modes=["default"], batch=4, repeats=1, budget=5.0, device="cpu")
    return argparse.Namespace(**{**base, **over})


def test_compiled_layer_equals_eager_and_counts_are_positive(inductor, monkeypatch):
    monkeypatch.setitem(ca.SHAPES, "tiny", TINY)
    row = ca.measure("tiny", 12, "float32", args())
    compiled = row["default"]
    assert compiled["max_rel_diff"] <= 1e-5, compiled
    assert row["graph_breaks"] == 0 and compiled["fullgraph"] is True, row
    for count in (row["eager_ops"], row["eager_ops"] - row["eager_views"], compiled["launches"],
                  compiled["extern"], compiled["kernels"], compiled["generated_kernels"]):
        assert isinstance(count, int) and count > 0, row
    assert compiled["compile_s"] > 0 and all(s > 0 for s in row["seconds"]["default"].values())
    # a completion length the graph has not seen: compiled anew (the shape-keyed dicts of factors.py specialize T)
    assert [r["new_graphs"] for r in compiled["recompiles"]][0] >= 1
    md = ca.render(dict(machine=dict(ca.harness.machine_info(), loadavg_end=[0.0] * 3), command="test", batch=4,
                        modes=["default"], rows=[row], emulate_precision_casts=False))
    assert "| tiny | 12 | float32 |" in md


def test_bf16_compiled_rounds_as_eager_with_emulated_casts(inductor):
    """bf16 factors: the materialized per-sample gradients are held in bf16 (per_sample_dtype); inductor keeps them
    in float32 inside a fused kernel unless emulate_precision_casts, with which it matches eager."""
    inputs = ca.make_inputs(TINY, 4, 12, torch.bfloat16, "cpu")
    torch._dynamo.reset()
    with torch._inductor.config.patch(emulate_precision_casts=True), torch.no_grad():
        compiled = torch.compile(ca.layer_work, fullgraph=True)(*inputs)
    assert ca.max_rel_diff(compiled, ca.layer_work(*inputs)) <= 1e-5


def test_the_comparison_sees_a_difference():
    lefts, rights, scale = ca.make_inputs(TINY, 4, 12, torch.float32, "cpu")
    out = ca.layer_work(lefts, rights, scale)
    norms, grads, sq = out
    assert ca.max_rel_diff(out, out) == 0
    bumped = [g.clone() for g in grads]
    bumped[1].view(-1)[0] += 1e-3 * grads[1].abs().max()
    assert ca.max_rel_diff((norms, bumped, sq), out) == pytest.approx(1e-3, rel=1e-3)


def test_wrapper_calls_counts_kernels_externs_and_fallbacks():
    code = ("kernels = async_compile.cpp_pybinding(...)\ndef call(self, args):\n"
            "    extern_kernels.bmm(a, b, out=buf0)\n    cpp_fused_mul_sum_0(buf0, buf1)\n"
            "    triton_poi_fused_1.run(buf1, stream=s)\n    buf2 = torch.ops.aten.sort.default(buf1)\n"
            "    buf3 = reinterpret_tensor(buf2, (4,), (1,), 0)\n\nrunner = Runner(partitions=[])\n")
    assert ca.wrapper_calls([code]) == dict(kernels=2, extern=1, fallback=1, launches=4, graphs=1)
