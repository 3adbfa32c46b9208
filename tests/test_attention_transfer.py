"""The attention-transfer pipeline (``attnlab.transfer``, ``experiments/attention_transfer.py``):
``:tiny`` end to end from a Hugging Face folder in ``../shared`` (skipped without it) and
from a run trained here; a student built from a teacher decodes through its cache as by
recomputation; bad plans, mixers and LoRA targets fail in one line before step 1; both
stages on 8 devices train as on one."""

import json
import os
import pathlib

import jax
import numpy as np
import pytest
import xla_flags

import attnlab
from attnlab import experiment
from attnlab.errors import ConfigError
from attnlab.transfer import pipeline, plan

REPO = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENT = REPO / "experiments" / "attention_transfer.py"
LLAMA = REPO.parent / "shared" / "fixtures" / "hf" / "llama"
needs_llama = pytest.mark.skipif(not LLAMA.is_dir(), reason="../shared/fixtures/hf is absent")


def tiny(teacher, *overrides):
    return experiment.load_config(
        f"{EXPERIMENT}:tiny", [f"--config.transfer.teacher={teacher}", *overrides]
    )


def _check_results(res, workdir):
    saved = json.loads((workdir / pipeline.RESULTS).read_text())
    for key in ("teacher_eval_loss", "student_eval_loss", "swap_only_eval_loss",
                "trainable_fraction", "attention_mse_start", "attention_mse_end"):  # fmt: skip
        assert key in saved, key
    assert set(saved["attention_mse_start"]) == set(saved["layers"])
    assert all(np.isfinite(v) for v in saved["attention_mse_end"].values())
    assert 0 < saved["trainable_fraction"] < 1
    assert saved["decode"]["student"]["64"]["cache_bytes"] > 0
    for stage in ("stage1", "stage2", "swap_only"):
        assert (workdir / stage / "done.json").is_file()


@needs_llama
@pytest.mark.slow(reason="trains three tiny stages and compiles decode steps (about a minute)")
def test_tiny_pipeline_from_a_hugging_face_folder(tmp_path):
    cfg = tiny(LLAMA, "--config.transfer.mixer_settings.window=4")
    res = pipeline.run(cfg, tmp_path, say=lambda *_: None)
    _check_results(res, tmp_path)
    assert res["layers"] == {"0": "lolcats", "1": "lolcats"}
    assert res["swap_trains"] == "lora"  # the recipe less stage 1: adapters alone
    assert json.loads(res["swap_settings"]) == {"window": 0}  # and less the window


@pytest.mark.slow(reason="trains a teacher run, then the three tiny stages, with a resume")
def test_tiny_pipeline_from_a_run_trained_here_resumes(tmp_path):
    from attnlab.runs.loop import train

    run_dir = tmp_path / "teacher"
    tcfg = experiment.load_config(f"{REPO}/experiments/char_lm.py:tiny",
                                  ["--config.model.n_layers=2"])  # fmt: skip
    train(tcfg, run_dir, progress=False)
    cfg = tiny(run_dir, "--config.transfer.plan=('keep','lolcats')",
               "--config.transfer.swap_trains=lora+mixer")  # fmt: skip
    work = tmp_path / "at"
    stopped = pipeline.run(cfg, work, say=lambda *_: None, stop_after={"stage2": 1})
    assert stopped == {"stopped": "stage2"}
    res = pipeline.run(cfg, work, say=lambda *_: None)
    _check_results(res, work)
    assert res["layers"] == {"1": "lolcats"}
    assert res["swap_trains"] == "lora+mixer"


@needs_llama
@pytest.mark.slow(reason="compiles cached and recomputed generation of a student")
def test_a_student_decodes_with_its_cache_as_by_recomputation():
    cfg = tiny(LLAMA, "--config.transfer.mixer_settings.window=3")
    teacher = plan.load_teacher(cfg.transfer)
    scfg, params, _ = plan.build_student(cfg.transfer, teacher, seed=0)
    from flax import nnx

    model = nnx.merge(nnx.graphdef(attnlab.build_model(scfg, seed=0)), params)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]
    cached = attnlab.generate(model, prompts, 6, eos_id=None)
    again = attnlab.generate(model, prompts, 6, eos_id=None, recompute=True)
    np.testing.assert_array_equal(np.asarray(cached.tokens), np.asarray(again.tokens))


@needs_llama
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--config.transfer.layers.index=(5,)"], r"^transfer\.layers\.index=5 is invalid"),
        (
            ["--config.transfer.plan=('keep','keep','lolcats')"],
            r"^transfer\.plan=.*one name per layer of the teacher \(2 layers\)",
        ),
        (["--config.lora.targets=('*mlp*',)"], r"^lora\.targets=.*matches no weight"),
        (["--config.transfer.init=copy"], r"^transfer\.init='copy' is invalid"),
        (["--config.transfer.swap_trains=all"], r"^transfer\.swap_trains='all' is invalid"),
        (['--config.transfer.swap_settings={"windw": 0}'], r"^transfer\.swap_settings=.*windw"),
        (["--config.transfer.swap_settings=[0]"], r"^transfer\.swap_settings=.*JSON object"),
        (["--config.transfer.harness_tasks=needle"], r"^transfer\.harness_tasks='needle'"),
    ],
)
def test_bad_input_fails_in_one_line_before_step_one(tmp_path, overrides, message):
    cfg = tiny(LLAMA, *overrides)
    with pytest.raises(ConfigError, match=message) as e:
        pipeline.run(cfg, tmp_path, say=lambda *_: None)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "stage1").exists()


@needs_llama
def test_a_mixer_with_other_heads_cannot_take_the_attention_weights():
    cfg = tiny(LLAMA, "--config.transfer.init=attention")
    with cfg.unlocked():
        cfg.transfer.mixer = "gated_deltanet"
        cfg.transfer.mixer_settings = {"num_v_heads": 8}
    with pytest.raises(ConfigError, match=r"^transfer\.init='attention' is invalid") as e:
        pipeline.check(cfg)
    assert "4 query heads, 2 key-value heads" in str(e.value) and "\n" not in str(e.value)


CHILD = os.environ.get("ATTNLAB_MESH_CHILD") == "1"
on_mesh = pytest.mark.skipif(not CHILD, reason="runs in the child process with 8 CPU devices")


@pytest.mark.slow(reason="a second pytest process on 8 CPU devices compiles the stages")
def test_mesh_tests_pass_on_eight_cpu_devices():
    xla_flags.run_on_devices(__file__, "-k", "eight_devices")


def _stages_trained(mesh, workdir):
    """Stage 1 (attention MSE) and stage 2 (LoRA, next-token + KL) of a tiny random teacher,
    three steps each: the losses and what each stage trained."""
    from flax import nnx
    from ml_collections import ConfigDict

    from attnlab.experiment.schema import layer_selection
    from attnlab.train import distill, lora
    from attnlab.transfer.stages import Batches, Stage, assemble, select

    tcfg = attnlab.ModelConfig(arch="decoder", vocab_size=64, d_model=32, n_layers=2,
                               n_heads=4, n_kv_heads=2, max_len=16, position="rope",
                               ffn="swiglu", d_ff=48)  # fmt: skip
    teacher = plan.Teacher(tcfg, nnx.state(attnlab.build_model(tcfg, seed=3)), None, "-", "hf")
    group = ConfigDict(dict(teacher="-", plan=(), mixer="lolcats", layers=layer_selection(),
                            mixer_settings=dict(window=4, feature_dim=0, factor_init=0.0),
                            init="matching"))  # fmt: skip
    scfg, params, layers = plan.build_student(group, teacher, 0)
    names = plan.new_parameters(teacher, scfg, params, layers, "matching")
    ids = np.random.default_rng(0).integers(0, 64, 4000)
    common = dict(student_cfg=scfg, teacher_cfg=tcfg, lr=1e-2, steps=3, warmup=1, mesh=mesh,
                  log_every=1, checkpoint_every=10)  # fmt: skip
    s1 = Stage("stage1", workdir, spec=distill.DistillSpec(ce=0.0, attention_mse=1.0),
               mse_layers=sorted(layers), **common)  # fmt: skip
    got1 = s1.run({"params": select(params, names)}, params, teacher.params,
                  Batches(ids, 12, 8, 0), say=lambda *_: None)  # fmt: skip
    base2 = assemble(params, got1)
    spec = lora.spec_from(dict(rank=2, alpha=4.0, targets=("q", "v"), dropout=0.0))
    s2 = Stage("stage2", workdir, spec=distill.DistillSpec(ce=1.0, kl=1.0), lora_spec=spec,
               **common)  # fmt: skip
    start2 = {"lora": lora.init(spec, base2, jax.random.key(1)), "params": {}}
    got2 = s2.run(start2, base2, teacher.params, Batches(ids, 12, 8, 1), say=lambda *_: None)
    read = lambda s: [json.loads(x)["loss"] for x in (workdir / s / "metrics.jsonl").open()]
    return read("stage1") + read("stage2"), jax.device_get((got1, got2))


@on_mesh
def test_stages_on_eight_devices_train_as_on_one(tmp_path):
    from attnlab.devices import sharding

    assert len(jax.devices()) == 8
    one_losses, one = _stages_trained(None, tmp_path / "one")
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    many_losses, many = _stages_trained(mesh, tmp_path / "many")
    np.testing.assert_allclose(many_losses, one_losses, rtol=2e-5)
    for x, y in zip(jax.tree.leaves(one), jax.tree.leaves(many), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-6)


def test_the_ablation_table_is_each_rows_mean_and_t_interval_over_seeds(tmp_path):
    from attnlab.transfer.report import report

    def write(name, **values):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(values))

    swaps, students = [2.0, 2.1, 2.3], [1.9, 1.95, 2.0]
    for seed, (sw, st) in enumerate(zip(swaps, students, strict=True)):
        write(f"linear_seed{seed}", swap_only_eval_loss=sw, student_eval_loss=st,
              teacher_eval_loss=1.6)  # fmt: skip
    write("window_seed0", student_eval_loss=1.61, teacher_eval_loss=1.6,
          passkey={"teacher": 0.5, "student": 0.25}, layers={"0": "lolcats"})  # fmt: skip
    (tmp_path / "window_seed0" / "stage1").mkdir()
    (tmp_path / "window_seed0" / "stage1" / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "attention_mse": [0.1]}) + "\n"
    )
    lines = {r.split(" | ")[0]: r for r in report(tmp_path).splitlines()}
    # mean 2.1333, sample sd 0.15275, t(0.975, 2 dof) = 4.303: half-width 0.37949
    assert lines["| swap + finetune"].startswith("| swap + finetune | 2.133 ± 0.379 | +0.533 |")
    assert "| 1.950 ± 0.124 |" in lines["| + attention transfer"]  # sd 0.05
    assert lines["| + sliding window"] == "| + sliding window | 1.610 | +0.010 | 0.25 | 1 |"
    assert "| swap + finetune, with the window" not in lines  # no run had that arm
    assert (tmp_path / "stage1_mse.png").is_file() and (tmp_path / "gap_per_task.png").is_file()


@pytest.mark.slow(reason="imports the harness and decodes a task through the cache")
def test_the_harness_scores_a_student_on_the_tasks_at_its_length(tmp_path):
    pytest.importorskip("lm_eval")
    from attnlab.data.tokenizers import ByteTokenizer
    from attnlab.transfer import measure

    cfg = attnlab.ModelConfig(arch="decoder", vocab_size=256, d_model=32, n_layers=1,
                              n_heads=2, max_len=160, position="rope", mixer="lolcats",
                              mixer_settings={"window": 8})  # fmt: skip
    got = measure.harness(attnlab.build_model(cfg, seed=0), ByteTokenizer(), "passkey,vt", 128,
                          tmp_path, examples=2, seed=0)  # fmt: skip
    assert set(got) == {"ruler_passkey_128"}  # variable tracking needs more than 128 bytes
    assert all(0.0 <= v <= 1.0 for v in got.values())
    rows = [json.loads(x) for x in (tmp_path / "passkey_128.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["outputs"][0] in r["input"] for r in rows)
