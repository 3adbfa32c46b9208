"""benchmarks/profile.py: kernels matched to their HLO instructions and sorted by kind."""

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
profile = pytest.importorskip("profile_step")


def test_category_sorts_ops_by_what_they_compute():
    assert profile.category({"dot", "add"}) == "matmul"
    assert profile.category({"convolution"}) == "matmul"
    assert profile.category({"copy", "transpose"}) == "layout"
    assert profile.category({"dynamic-update-slice"}) == "layout"
    assert profile.category({"exponential", "reduce", "subtract"}) == "reduction"
    assert profile.category({"erf", "multiply"}) == "elementwise"
    assert profile.category({"all-reduce"}) == "collective"
    assert profile.category({"while"}) is None  # its body's kernels count instead
    assert profile.category({"custom-call"}) == "matmul"  # a GPU's cuBLAS and cuDNN calls


def test_breakdown_finds_the_matmul_and_the_rest_of_a_program():
    # The softmax-like sum reads its own input, so no kernel can fuse it into the dot.
    f = jax.jit(lambda a, b, c: (a @ b, jnp.sum(jnp.exp(c), axis=0)))
    a, b, c = jnp.ones((64, 128)), jnp.ones((128, 256)), jnp.ones((512, 256))
    hlo = f.lower(a, b, c).compile().as_text()
    ops = profile.instruction_ops(hlo)
    assert any("dot" in found for found in ops.values())
    out = profile.breakdown(lambda _: f(a, b, c), hlo, calls=2)
    assert out["kernel_ms"] > 0
    assert out["share"]["matmul"] > 0
    assert out["share"].get("reduction", 0) > 0, "the sum of exp(c) runs outside the dot"
    assert sum(out["share"].values()) == pytest.approx(1.0, abs=1e-3)
    assert all(row["ms"] >= 0 for row in out["top_not_matmul"])


def test_report_prints_the_profile_shares(tmp_path):
    report = pytest.importorskip("report")
    run = dict(
        benchmark="profile",
        machine=dict(cpu="AMD EPYC", cores_in_use=2, date="2026-11-25", load_average=[3.0]),
        programs={"train medium": dict(wall_ms=5000.0, kernel_ms=9000.0,
                                       share={"matmul": 0.75, "layout": 0.05, "elementwise": 0.2})},
    )  # fmt: skip
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(run))
    text = report.table([str(path)])
    assert "profile: train medium" in text
    assert "matmul 75.0%; layout 5.0%, elementwise 20.0%" in text


def test_report_names_a_gpu_profiles_kernels_not_its_host_spans(tmp_path):
    report = pytest.importorskip("report")
    events = [
        ("PjitFunction(_train_step)", 6.2),
        ("gemm_fusion_dot_general_292", 2.8),
        ("cuGraphLaunch (CudaGraph:341)", 1.5),
        ("nvjet_sm90_tst_128x128", 1.2),
    ]
    run = dict(
        benchmark="profile",
        machine=dict(cpu="Xeon", backend="gpu", device_kind="NVIDIA H200", date="2026-11-26"),
        programs={"train gpt2": dict(wall_ms=24.5, kernel_ms=0.2, share={"elementwise": 1.0},
                                     top_events=[dict(event=e, ms=m) for e, m in events])},
    )  # fmt: skip
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(run))
    text = report.table([str(path)])
    row = next(line for line in text.splitlines() if "train gpt2" in line)
    assert "`gemm_fusion_dot_general_292` 2.80, `nvjet_sm90_tst_128x128` 1.20" in row
    assert "Pjit" not in row and "cuGraph" not in row
