"""The attention-transfer pipeline (``attnlab.transfer``, ``experiments/attention_transfer.py``):
``:tiny`` end to end from a Hugging Face folder in ``../shared`` (skipped without it) and
from a run trained here; a student built from a teacher decodes through its cache as by
recomputation; bad plans, mixers and LoRA targets fail in one line before step 1."""

import json
import pathlib

import numpy as np
import pytest

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
