"""The attention-transfer pipeline (LoLCATs' recipe) as one resumable run in a directory.

``run(cfg, workdir)``:

1. checks everything first (the teacher's config, the layer plan, the mixers' settings,
   ``lora``, ``distill``, the data's vocabulary against the teacher's), then loads the
   teacher and builds the student (``attnlab.transfer.plan``);
2. stage 1, attention transfer (``DIR/stage1``): only the new mixers' own parameters train,
   each replaced layer's mixer output matched to the teacher's under MSE, layer by layer
   (the student's layers fed the teacher's inputs);
3. stage 2 (``DIR/stage2``): LoRA adapters (``lora``) on the stage-1 student with the
   ``distill`` objective (next-token loss and/or logit KL, hidden-state alignment);
4. with ``transfer.swap_baseline``, the same student without stage 1 (``DIR/swap_only``):
   trained with the stage-2 objective for the tokens of both stages, the adapters alone
   (``transfer.swap_trains="lora"``: the recipe less stage 1, LoLCATs' "swap & finetune")
   or the adapters and the new mixers' parameters together (``"lora+mixer"``);
5. evaluation of teacher and students side by side (``attnlab.transfer.measure``) into
   ``DIR/results.json``; the adapters alone in ``DIR/lora_adapters.npz``.

Each stage resumes from its own checkpoints; a finished one is read back, not rerun.
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
from flax import nnx

from attnlab.errors import ConfigError
from attnlab.transfer import measure, plan
from attnlab.transfer.stages import Batches, Stage, assemble, eval_batches, select, trainable_count

RESULTS = "results.json"
SWAP_TRAINS = ("lora", "lora+mixer")


def _data(cfg, tokenizer, teacher_cfg):
    """``(tokenizer, train_ids, val_ids)`` of ``cfg.data`` in the teacher's tokenizer."""
    from attnlab.data.corpus import split_train_val
    from attnlab.data.text import _load_corpus, _text_tokenizer

    d = cfg.data
    text = _load_corpus(d.path, d.max_chars)
    if tokenizer is None:
        tokenizer = _text_tokenizer(d.tokenizer, text, None, d.get("vocab_size", 0))
    ids = np.asarray(tokenizer.encode(text))
    if ids.max() >= teacher_cfg.vocab_size:
        raise ConfigError(
            f"data.tokenizer={d.tokenizer!r} is invalid: its ids reach {int(ids.max())}, past "
            f"the teacher's vocab_size={teacher_cfg.vocab_size}; give the teacher's folder its "
            "tokenizer.json or set --config.data.tokenizer to the one it was trained with"
        )
    train, val = split_train_val(ids, d.val_fraction)
    return tokenizer, train, val


def check(cfg):
    """Every check that needs no parameters: the plan, the settings, ``distill``, ``lora``
    (its parse; its targets are matched on the student once built)."""
    from attnlab.train import distill, lora

    trains = cfg.transfer.get("swap_trains", "lora")
    if trains not in SWAP_TRAINS:
        raise ConfigError(
            f"transfer.swap_trains={trains!r} is invalid: the swap baseline trains one of "
            f"{SWAP_TRAINS}; set --config.transfer.swap_trains=lora"
        )
    tasks = cfg.transfer.get("harness_tasks")
    if tasks:
        from attnlab.data import ruler_tasks
        from attnlab.errors import optional_import

        try:
            ruler_tasks.task_names(str(tasks))
        except ConfigError:
            raise ConfigError(
                f"transfer.harness_tasks={tasks!r} is invalid: a comma list of "
                f"{list(ruler_tasks.TASKS)} ('': none)"
            ) from None
        optional_import("lm_eval", "eval", "transfer.harness_tasks (the EleutherAI harness)")
    teacher_cfg, _ = plan.teacher_config(cfg.transfer)
    student_cfg, layers = plan.student_config(cfg.transfer, teacher_cfg)
    if cfg.transfer.get("swap_baseline"):
        plan.swap_config(cfg.transfer, teacher_cfg)
    if not layers:
        raise ConfigError(
            "transfer.layers selects no layer to replace: name layers "
            "(--config.transfer.layers.index=0,1) or a transfer.plan"
        )
    return teacher_cfg, student_cfg, distill.spec_from(cfg.distill), lora.spec_from(cfg.lora)


def run(cfg, workdir, *, say=print, stop_after: dict | None = None) -> dict:
    """The whole pipeline (module docstring); returns the results."""
    from attnlab.train import distill, lora

    workdir = pathlib.Path(workdir)
    t = cfg.transfer
    seed = int(cfg.train.seed)
    teacher_cfg, _, spec2, lora_spec = check(cfg)
    mesh, rules = _mesh(cfg, int(t.batch_size))
    if lora_spec is None:
        raise ConfigError(
            "lora.rank=0 is invalid here: stage 2 trains adapters; set --config.lora.rank=8"
        )
    teacher = plan.load_teacher(t)
    tokenizer, train_ids, val_ids = _data(cfg, teacher.tokenizer, teacher.cfg)
    student_cfg, student_params, layers = plan.build_student(t, teacher, seed)
    new_names = plan.new_parameters(teacher, student_cfg, student_params, layers, t.init)
    lora.targets(lora_spec, student_params)  # a target that matches nothing fails here
    workdir.mkdir(parents=True, exist_ok=True)  # every check has passed
    (workdir / "student_config.json").write_text(json.dumps(student_cfg.to_dict(), indent=1))
    say(
        f"teacher {teacher.where} ({teacher.kind}); layers {sorted(layers)} -> "
        f"{sorted({m for m, _ in layers.values()})}; stage 1 trains {len(new_names)} tensors"
    )
    B, T = int(t.batch_size), int(t.seq_len)
    evals = eval_batches(val_ids, T, B, int(t.eval_batches))
    mse_layers = sorted(layers)
    stop = stop_after or {}

    def stage(name, spec, lr, steps, cfg=None, **kw) -> Stage:
        return Stage(name, workdir, spec=spec, lr=float(lr), steps=int(steps),
                     warmup=int(t.warmup), student_cfg=cfg or student_cfg, teacher_cfg=teacher.cfg,
                     seed=seed, log_every=int(t.log_every),
                     checkpoint_every=int(t.checkpoint_every), mesh=mesh, rules=rules,
                     **kw)  # fmt: skip

    def fit(st: Stage, start, base, data_seed):
        """``st`` trained from ``start`` (resumed if begun); None when stopped early."""
        batches = Batches(train_ids, T, B, data_seed)
        return st.run(start, base, teacher.params, batches, stop_after=stop.get(st.name), say=say)

    # Stage 1: attention transfer.
    s1 = stage("stage1", distill.DistillSpec(ce=0.0, attention_mse=1.0), t.stage1_lr,
               t.stage1_steps, mse_layers=mse_layers)  # fmt: skip
    start1 = {"params": select(student_params, new_names)}
    mse_start = _mse(s1, student_params, start1, teacher.params, evals)
    trained1 = fit(s1, start1, student_params, seed)
    if trained1 is None:
        return {"stopped": "stage1"}
    mse_end = _mse(s1, student_params, trained1, teacher.params, evals)
    # Stage 2: LoRA with the distill objective.
    base2 = jax.device_get(assemble(student_params, trained1))
    adapters = lora.init(lora_spec, base2, jax.random.key(seed + 1))
    start2 = {"lora": adapters, "params": {}}
    s2 = stage("stage2", spec2, t.stage2_lr, t.stage2_steps, lora_spec=lora_spec)
    trained2 = fit(s2, start2, base2, seed + 1)
    if trained2 is None:
        return {"stopped": "stage2"}
    student = s2.student(base2, trained2)
    lora.save(workdir / lora.FILE, lora_spec, trained2["lora"])
    n_params = trainable_count(nnx.state(student, nnx.Param))
    results = {
        "teacher": teacher.where,
        "layers": {str(i): m for i, (m, _) in sorted(layers.items())},
        "student_config": student_cfg.to_dict(),
        "tokens": {
            "stage1": s1.steps * B * T,
            "stage2": s2.steps * B * T,
            "teacher": _teacher_tokens(teacher),
        },
        "attention_mse_start": dict(zip(map(str, mse_layers), mse_start, strict=True)),
        "attention_mse_end": dict(zip(map(str, mse_layers), mse_end, strict=True)),
        "trainable_stage1": trainable_count(start1),
        "trainable_stage2": trainable_count(start2),
        "params": n_params,
        "trainable_fraction": trainable_count(start2) / n_params,
        "lora_bytes": (workdir / lora.FILE).stat().st_size,
    }
    tmodel = nnx.merge(s1.teacher_graph, teacher.params)
    results["teacher_eval_loss"] = measure.eval_loss(tmodel, evals)
    results["student_eval_loss"] = measure.eval_loss(student, evals)
    if t.swap_baseline:
        # The swap arm: the student less stage 1 (with transfer.swap_settings laid over it).
        group = plan.swap_group(t)
        swap_cfg, swap_params, _ = plan.build_student(group, teacher, seed)
        names = plan.new_parameters(teacher, swap_cfg, swap_params, layers, t.init)
        trains = t.get("swap_trains", "lora")
        mixers = select(swap_params, names) if trains == "lora+mixer" else {}
        start = {"lora": adapters, "params": mixers}
        sw = stage("swap_only", spec2, t.stage2_lr, s1.steps + s2.steps, cfg=swap_cfg,
                   lora_spec=lora_spec)  # fmt: skip
        got = fit(sw, start, swap_params, seed + 2)
        if got is None:
            return {"stopped": "swap_only"}
        results["swap_only_eval_loss"] = measure.eval_loss(sw.student(swap_params, got), evals)
        results["swap_trains"] = trains
        results["swap_settings"] = str(t.get("swap_settings") or "{}")
    if t.passkey_rows:
        rows = measure.passkey_rows(
            tokenizer.encode, val_ids, seq_len=T, rows=int(t.passkey_rows), seed=seed
        )
        results["passkey"] = {
            "teacher": measure.passkey(tmodel, *rows),
            "student": measure.passkey(student, *rows),
        }
    if t.get("harness_tasks"):
        tasks, n = str(t.harness_tasks), int(t.get("harness_examples", 16))
        results["harness"] = {
            who: measure.harness(m, tokenizer, tasks, T, workdir / "harness", examples=n, seed=seed)
            for who, m in (("teacher", tmodel), ("student", student))
        }
    if t.decode_lengths:
        lengths = tuple(int(x) for x in t.decode_lengths)
        results["decode"] = {
            "teacher": measure.decode_profile(tmodel, lengths),
            "student": measure.decode_profile(student, lengths),
        }
    (workdir / RESULTS).write_text(json.dumps(results, indent=1))
    say(f"results in {workdir / RESULTS}")
    return results


def _mse(stage: Stage, base, trainable, teacher_params, batches) -> list[float]:
    """Per-layer attention MSE of ``trainable`` on ``batches`` (mean over them)."""
    from attnlab.train import distill

    @jax.jit
    def one(trainable, base, teacher_params, batch):
        tm = nnx.merge(stage.teacher_graph, teacher_params)
        seen = distill.teacher_pass(tm, batch["inputs"], stage.names)[1]
        return distill.attention_mse_per_layer(
            stage.student(base, trainable),
            batch["inputs"],
            seen,
            stage.mse_layers,
            stage.n_layers,
        )

    per = np.mean([np.asarray(one(trainable, base, teacher_params, b)) for b in batches], 0)
    return [float(x) for x in per]


def _mesh(cfg, batch_size: int):
    """The run's mesh (its ``mesh`` group) and sharding rules; ``(None, None)`` on one
    device. A batch the mesh's batch axes do not divide fails here, before step 1."""
    from attnlab.devices import sharding

    if jax.device_count() == 1:
        return None, None
    mesh = sharding.mesh_from_config(cfg)
    rules = sharding.resolve_rules(cfg.get("mesh", {}).get("rules"))
    sharding.check_batch(mesh, rules, batch_size, "transfer.batch_size")
    return mesh, rules


def _teacher_tokens(teacher) -> int | None:
    """Tokens the teacher trained on, when it is an attnlab run (None for a folder)."""
    if teacher.kind != "run":
        return None
    from attnlab.runs.loading import saved_config

    c = saved_config(teacher.where)
    return int(c.train.steps) * int(c.train.batch_size) * int(c.data.seq_len)
