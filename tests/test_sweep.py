"""Sweeps: specification, naming, planning, vmap-parallel trials, resumption, results, CLI."""

import json
import math
import pathlib
import shlex
import shutil

import pytest

from attnlab import cli, experiment, runs, sweep
from attnlab.experiment import ExperimentError

REPO = pathlib.Path(__file__).resolve().parents[1]
CHAR_LM = f"{REPO / 'experiments' / 'char_lm.py'}:tiny"
DETERMINISTIC = ("step", "train_loss", "learning_rate", "grad_norm", "eval_loss", "eval_accuracy")
BASE = [
    "--config.train.steps=4",
    "--config.train.log_every_steps=1",
    "--config.eval.every_steps=2",
    "--config.eval.sample_tokens=4",
    "--config.checkpoint.every_steps=2",
    "--config.model.dropout=0.1",
]
NAN_TRIAL = {"optim.learning_rate": 1e30, "train.seed": 0}  # params overflow within 3 steps
SWEEP_SOURCE = """

def sweep(variant=None):
    from attnlab.sweep import grid

    nan = [{"optim.learning_rate": 1e30, "train.seed": 0}]
    return nan + grid({"optim.learning_rate": [1e-3, 3e-3], "train.seed": [0, 1]})
"""


def _metrics(workdir):
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [{k: r[k] for k in DETERMINISTIC if k in r} for r in map(json.loads, lines)]


@pytest.fixture(scope="module")
def experiment_file(tmp_path_factory):
    """char_lm with a sweep(): a NaN trial, then learning rate x seed (one vmap group)."""
    path = tmp_path_factory.mktemp("exp") / "char_lm_sweep.py"
    path.write_text((REPO / "experiments" / "char_lm.py").read_text() + SWEEP_SOURCE)
    return f"{path}:tiny"


@pytest.fixture(scope="module")
def vmapped(experiment_file, tmp_path_factory):
    """The sweep run once through the CLI with --parallel vmap; returns (dir, stdout).

    Its NaN trial fails, so the command exits with 1."""
    root = tmp_path_factory.mktemp("sweep") / "vmapped"
    argv = ["sweep", "--config", experiment_file, *BASE, "--workdir", str(root), "--no-progress"]
    return root, _run_cli(argv, expect=1)


def _run_cli(argv, expect=0):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    assert code == expect, out.getvalue()
    return out.getvalue()


# Specifications and names -------------------------------------------------------------------
def test_grid_expands_every_combination_last_key_fastest():
    trials = sweep.grid({"optim.learning_rate": [1e-3, 3e-3], "train.seed": [0, 1, 2]})
    assert len(trials) == 6
    assert trials[0] == {"optim.learning_rate": 1e-3, "train.seed": 0}
    assert trials[1] == {"optim.learning_rate": 1e-3, "train.seed": 1}
    assert trials[-1] == {"optim.learning_rate": 3e-3, "train.seed": 2}


def test_random_search_is_reproducible_and_in_range():
    space = {
        "optim.learning_rate": sweep.log_uniform(1e-4, 1e-2),
        "model.dropout": sweep.choice([0.0, 0.1]),
        "optim.b1": sweep.uniform(0.8, 0.95),
        "train.steps": 7,
    }
    a = sweep.random_search(space, num_trials=8, seed=0)
    assert a == sweep.random_search(space, num_trials=8, seed=0)
    assert a != sweep.random_search(space, num_trials=8, seed=1)
    assert len(a) == 8 and len({sweep.trial_name(t) for t in a}) == 8
    for t in a:
        assert 1e-4 <= t["optim.learning_rate"] <= 1e-2 and 0.8 <= t["optim.b1"] <= 0.95
        assert t["model.dropout"] in (0.0, 0.1) and t["train.steps"] == 7


def test_product_merges_and_lists_concatenate():
    trials = sweep.product(
        sweep.grid({"model.position": ["rope", "alibi"]}), [{"train.seed": 0}, {"train.seed": 1}]
    )
    assert trials == [
        {"model.position": "rope", "train.seed": 0},
        {"model.position": "rope", "train.seed": 1},
        {"model.position": "alibi", "train.seed": 0},
        {"model.position": "alibi", "train.seed": 1},
    ]
    assert len(sweep.as_trials(trials + [{"model.position": "learned"}])) == 5
    with pytest.raises(ExperimentError, match="train.seed"):
        sweep.product([{"train.seed": 0}], [{"train.seed": 1}])


def test_trial_names_are_stable_unique_and_filesystem_safe():
    name = sweep.trial_name({"train.seed": 1, "optim.learning_rate": 0.001})
    assert name == "optim.learning_rate=0.001,train.seed=1"  # keys sorted, values as flags
    assert sweep.trial_name({}) == "base"
    odd = [
        {"data.path": "a/b c.txt"},
        {"data.path": "a_b c.txt"},
        {"data.path": "a/b_c.txt"},
        {"name": "x" * 300},
        {"name": "x" * 301},
    ]
    names = [sweep.trial_name(t) for t in odd]
    assert len(set(names)) == len(names)
    for n in names:
        assert len(n) <= sweep.spec.MAX_NAME and "/" not in n and " " not in n
        assert n == n.strip() and not n.startswith(("-", "."))
    # A fixed value gives a fixed name, across processes and versions of this code.
    assert names[0] == sweep.trial_name({"data.path": "a/b c.txt"})
    assert names[0].startswith("data.path=a_b_c.txt-") and len(names[0].rsplit("-", 1)[1]) == 8


@pytest.mark.parametrize(
    "spec,needle",
    [
        ([{"optim.learning_rat": 1e-3}], "optim.learning_rat"),
        ([{"nosuchgroup.x": 1}], "nosuchgroup.x"),
        ([{"optim.learning_rate": "0.001"}], "optim.learning_rate"),
        ([{"train.steps": 2.5}], "train.steps"),
        ([{"train.steps": True}], "train.steps"),
        ([{"model.causal": 1}], "model.causal"),
        ([{"model.n_kv_heads": 3}], "model.n_kv_heads"),  # validate(): 2 heads
        ([{"model.n_kv_heads": None}], "model.n_kv_heads"),
        ([{"optim": 1}], "optim"),
        ([], "no trials"),
        ({"optim.learning_rate": [1e-3]}, "list of override dicts"),
        ([{"train.seed": 1}, {"train.seed": 1}], "train.seed=1"),
    ],
)
def test_invalid_sweeps_name_the_key(spec, needle):
    with pytest.raises(ExperimentError, match=needle):
        sweep.plan_sweep(CHAR_LM, [], spec)


def test_a_block_pattern_is_a_sweep_value():
    block = ("mha", {"mixer": "sinks"})
    plan = sweep.plan_sweep(
        CHAR_LM, [], [{"model.block_pattern.block": block, "model.n_layers": 2}]
    )
    (trial,) = plan.trials
    assert trial.overrides["model.block_pattern.block"] == block
    assert trial.cfg.model.block_pattern.block == block
    with pytest.raises(ExperimentError, match="model.block_pattern.block"):
        sweep.plan_sweep(CHAR_LM, [], [{"model.block_pattern.block": [1, 2]}])


def test_invalid_builders_name_the_key():
    with pytest.raises(ExperimentError, match="grid"):
        sweep.grid({})
    with pytest.raises(ExperimentError, match="train.seed"):
        sweep.grid({"train.seed": []})
    with pytest.raises(ExperimentError, match="num_trials"):
        sweep.random_search({"train.seed": sweep.choice([0, 1])}, num_trials=0)
    with pytest.raises(ExperimentError, match="model.dropout"):
        sweep.random_search({"model.dropout": [0.0, 0.1]}, num_trials=2)
    with pytest.raises(ExperimentError, match="log_uniform"):
        sweep.log_uniform(0.0, 1.0)
    with pytest.raises(ExperimentError, match="max-trials"):
        sweep.plan_sweep(CHAR_LM, [], [{"train.seed": 0}], max_trials=0)


def test_every_shipped_sweep_plans_on_its_tiny_config():
    for path in sorted((REPO / "experiments").glob("*.py")):
        if "def sweep(" in path.read_text():
            plan = sweep.load_sweep(f"{path}:tiny", ["--config.data.path="])
            assert len(plan.trials) >= 2 and sweep.group_trials(plan.trials)


def test_shape_changing_trials_fall_back_to_their_own_groups():
    spec = sweep.grid(
        {"model.d_model": [16, 48], "optim.learning_rate": [1e-3, 1e-2], "train.seed": [0, 1]}
    )
    spec += [{"model.dropout": 0.1, "train.seed": 5}, {"data.seq_len": 8}]
    spec += [{"optim.weight_decay": 0.0}, {"model.init_std": 0.1, "optim.b2": 0.95}]
    plan = sweep.plan_sweep(CHAR_LM, [], spec)
    groups = sweep.group_trials(plan.trials, "vmap")
    layout = [(g.mode, len(g.trials), g.shared) for g in groups]
    assert layout == [
        ("vmap", 4, {"model.d_model": 16}),
        ("vmap", 4, {"model.d_model": 48}),
        ("sequential", 1, {"model.dropout": 0.1}),  # a static rate: a different program
        ("sequential", 1, {"data.seq_len": 8}),
        ("vmap", 2, {}),  # initialisation and optimiser values stack with the base shape
    ]
    for g in groups:
        assert len({runs.stack_key(t.cfg) for t in g.trials}) == 1
    assert [len(g.trials) for g in sweep.group_trials(plan.trials, "sequential")] == [1] * 12


def test_print_commands_reparse_into_the_trial_configs(experiment_file, tmp_path):
    out = _run_cli(
        [
            "sweep",
            "--config",
            experiment_file,
            *BASE,
            "--workdir",
            str(tmp_path),
            "--print-commands",
        ]
    )
    lines = out.strip().splitlines()
    plan = sweep.load_sweep(experiment_file, BASE)
    assert len(lines) == len(plan.trials) == 5
    parser = cli.build_parser()
    for line, trial in zip(lines, plan.trials, strict=True):
        argv = shlex.split(line)
        assert argv[:2] == ["attnlab", "train"]
        args, extra = parser.parse_known_args(argv[1:])
        assert pathlib.Path(args.workdir) == tmp_path / trial.name
        cfg = experiment.load_config(args.config, extra)
        assert cfg.to_dict() == trial.cfg.to_dict()
    assert json.loads((tmp_path / "sweep.json").read_text())["trials"][0]["overrides"] == NAN_TRIAL


# Running -------------------------------------------------------------------------------------
def test_cli_prints_groups_and_trial_dirs_look_like_train_dirs(vmapped, experiment_file):
    root, out = vmapped
    assert "1 group(s)" in out and "group 1: vmap, 5 trial(s)" in out
    plan = sweep.load_sweep(experiment_file, BASE)
    for trial in plan.trials[1:]:
        d = root / trial.name
        saved = experiment.from_json((d / "config.json").read_text())
        assert saved.to_dict() == trial.cfg.to_dict()
        assert (d / "samples.jsonl").exists()
        assert json.loads((d / "status.json").read_text())["status"] == "finished"
        step = runs.load_run(d).step
        assert step == 4
        assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["2", "4"]


def test_nan_trial_is_recorded_as_failed_and_the_others_finish(vmapped):
    root, _ = vmapped
    status = json.loads((root / sweep.trial_name(NAN_TRIAL) / "status.json").read_text())
    assert status["status"] == "failed" and "non-finite training loss" in status["reason"]
    results = json.loads((root / "results.json").read_text())
    by_status = [r["status"] for r in results["trials"]]
    assert by_status == ["failed"] + ["finished"] * 4
    assert all(r["steps"] == 4 for r in results["trials"][1:])


def test_vmapped_trials_match_each_trial_run_alone(vmapped, experiment_file, tmp_path):
    root, _ = vmapped
    plan = sweep.load_sweep(experiment_file, BASE, max_trials=3)  # NaN, (1e-3, 0), (1e-3, 1)
    results = sweep.run_sweep(plan, tmp_path, parallel="sequential", log=lambda *a: None)
    assert [r["status"] for r in results["trials"]] == ["failed", "finished", "finished"]
    for trial in plan.trials:
        alone, stacked = _metrics(tmp_path / trial.name), _metrics(root / trial.name)
        assert [r["step"] for r in alone] == [r["step"] for r in stacked]
        for a, s in zip(alone, stacked, strict=True):
            for key in ("train_loss", "eval_loss"):
                if key in a and math.isfinite(a[key]):
                    assert s[key] == pytest.approx(a[key], rel=1e-5, abs=0), (trial.name, a)


@pytest.mark.slow(reason="runs a sweep twice, interrupted then resumed")
def test_interrupted_sweep_resumes_to_the_same_results(vmapped, experiment_file, tmp_path):
    root, _ = vmapped
    plan = sweep.load_sweep(experiment_file, BASE)
    sweep.run_sweep(plan, tmp_path, stop_after=3, log=lambda *a: None)
    statuses = [sweep.read_status(tmp_path / t.name)["status"] for t in plan.trials]
    assert statuses == ["failed"] + ["stopped"] * 4
    lines = []
    sweep.run_sweep(plan, tmp_path, log=lines.append)
    assert f"skip {plan.trials[0].name} (failed)" in lines
    for trial in plan.trials:
        assert _metrics(tmp_path / trial.name) == _metrics(root / trial.name)
    again = []
    sweep.run_sweep(plan, tmp_path, log=again.append)
    assert sum(line.startswith("skip ") for line in again) == 5
    assert not any("training" in line for line in again)


def test_collect_rebuilds_the_results_identically(vmapped, tmp_path):
    root, _ = vmapped
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    before = {n: (copy / n).read_bytes() for n in ("results.csv", "results.json")}
    for n in ("results.csv", "results.json", "loss_curves.png", "final_metric.png"):
        (copy / n).unlink()
    out = _run_cli(["sweep", "--collect", str(copy)])
    assert {n: (copy / n).read_bytes() for n in before} == before
    assert (copy / "loss_curves.png").exists() and (copy / "final_metric.png").exists()
    assert "mean ± std" in out
    rows = list(csv_rows(copy / "results.csv"))
    assert [r["kind"] for r in rows] == ["trial"] * 5 + ["mean_over_seeds"] * 3
    means = {r["trial"]: r for r in rows if r["kind"] == "mean_over_seeds"}
    assert means["optim.learning_rate=0.001"]["seeds"] == "2"
    assert float(means["optim.learning_rate=0.001"]["final_eval_loss_std"]) > 0

    # Trials run by a scheduler from --print-commands: no sweep.json, no status files.
    (copy / "sweep.json").unlink()
    for d in copy.iterdir():
        if (d / "status.json").exists():
            (d / "status.json").unlink()
    results = sweep.collect(copy)
    assert sorted(results["keys"]) == ["optim.learning_rate", "train.seed"]
    status = {r["trial"]: r["status"] for r in results["trials"]}
    assert status.pop(sweep.trial_name(NAN_TRIAL)) == "failed"
    assert set(status.values()) == {"finished"}


def csv_rows(path):
    import csv

    with open(path) as f:
        yield from csv.DictReader(f)
