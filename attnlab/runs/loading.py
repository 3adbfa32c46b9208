"""Reopening a finished or interrupted run: its config, model and latest parameters.

``load_run(DIR)`` returns a ``Run``::

    run = attnlab.load_run("runs/char")
    run.step, run.config.model.d_model, run.metrics[-1]["eval_loss"]
    print(run.generate("def ", max_new_tokens=40))
    run.evaluate(), run.checkpoints()

A run trained with an attention variant registered by its experiment file reopens in any
process: loading ``DIR/config.json`` imports the experiment file it records first.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

from attnlab import experiment
from attnlab.config import ModelConfig
from attnlab.config.architectures import architecture
from attnlab.data import make_task
from attnlab.devices import sharding
from attnlab.errors import CheckpointError, DecodeError, WorkdirError
from attnlab.runs.checkpoint import Checkpointer
from attnlab.runs.files import (
    CHECKPOINTS,
    CONFIG_FILE,
    METRICS_FILE,
    check_workdir,
    restore_newest,
)
from attnlab.train import Trainer


@dataclasses.dataclass(frozen=True)
class Run:
    """A trained run reopened from its work directory at one checkpoint.

    ``model`` is the NNX model holding the checkpoint's parameters (``params``; a LoRA run's
    with its adapters merged, as its evaluations saw them, so decoding and export read an
    ordinary model);
    ``metrics`` the rows of ``metrics.jsonl`` up to ``step``; ``tokenizer`` the task's
    tokenizer (None for synthetic tasks, whose ids are their symbols).
    """

    workdir: pathlib.Path
    config: Any  # the experiment's ConfigDict, as saved in DIR/config.json
    step: int
    model: Any
    params: Any
    tokenizer: Any
    metrics: list[dict]
    trainer: Trainer
    task: Any

    @property
    def model_config(self) -> ModelConfig:
        """The run's model as a typed, validated ``ModelConfig`` (what ``init_cache``,
        ``kv_cache_bytes``, ``count_params`` and ``build_model`` take); ``config.model`` is
        the experiment's ``ConfigDict`` of the same fields, which they refuse."""
        return self.trainer.mcfg

    def generate(
        self,
        prompt: str | None = None,
        max_new_tokens: int = 100,
        *,
        on_unknown: str = "raise",
        **options,
    ) -> str:
        """The prompt's continuation as text (``options``: ``temperature``, ``top_k``,
        ``top_p``, ``seed``, as ``attnlab.generate`` takes them); an encoder-decoder run
        reads ``prompt`` as its source. ``None`` is the run's sample prompt
        (``eval.sample_prompt``); an empty prompt (no tokens) is a ``DecodeError``.

        A model whose ``model.vocab_size`` exceeds its tokenizer's may sample ids that have
        no text. ``on_unknown="raise"`` (the default) refuses such a continuation with a
        ``DecodeError`` that counts them; ``"drop"`` returns the text of the others (what
        ``attnlab sample`` prints, with a line on stderr)."""
        from attnlab.runs.sampling import (
            continuation,
            decode_known,
            default_prompt,
            seq2seq_continuation,
        )

        if on_unknown not in ("raise", "drop"):
            raise DecodeError(
                f"Run.generate: on_unknown={on_unknown!r}; use 'raise' (the default) or 'drop'"
            )
        if prompt == "":
            raise DecodeError(
                "Run.generate: the prompt is empty; pass some text, or leave it out (None) "
                "for the run's sample prompt (eval.sample_prompt)"
            )
        if architecture(self.trainer.mcfg).seq2seq:
            if prompt is None:
                raise DecodeError("Run.generate: this run is an encoder-decoder: pass a source")
            tokens = seq2seq_continuation(self.model, self.task, prompt, max_new_tokens, **options)
            return decode_known(self.task, self._known(tokens, on_unknown))
        prompt = default_prompt(self.config, self.task) if prompt is None else prompt
        eos = getattr(self.task, "eos_id", None) if self.task.tokenizer is None else None
        ids = self.task.encode(prompt)
        tokens = continuation(self.model, ids, max_new_tokens, eos_id=eos, **options)
        return decode_known(self.task, self._known(tokens, on_unknown))

    def _known(self, tokens, on_unknown: str):
        """``tokens``, refused (``on_unknown="raise"``) when some have no text."""
        from attnlab.runs.sampling import unknown_ids

        n = unknown_ids(self.task, tokens)
        if n and on_unknown == "raise":
            raise DecodeError(
                f"Run.generate: {n} of the {len(tokens)} sampled ids have no text: the "
                f"tokenizer knows ids 0-{self.task.vocab_size - 1}, the model samples from "
                f"model.vocab_size={self.trainer.mcfg.vocab_size}; pass on_unknown='drop' to "
                f"leave them out, train longer, or set model.vocab_size to {self.task.vocab_size}"
            )
        return tokens

    def evaluate(self, *, full: bool = False) -> dict:
        """``attnlab eval`` of this checkpoint: the validation metrics (see ``evaluate``)."""
        return evaluate(self.workdir, self.step, full=full)

    def checkpoints(self) -> list[int]:
        """The steps of the checkpoints the work directory holds."""
        with Checkpointer(self.workdir / CHECKPOINTS) as ckpt:
            return sorted(ckpt.all_steps())


def saved_config(workdir):
    """The saved config of the run in ``workdir``, its experiment's variants registered."""
    workdir = pathlib.Path(workdir)
    path = workdir / CONFIG_FILE
    check_workdir(workdir)
    if not path.is_file():
        raise WorkdirError(
            f"--workdir {workdir}: no {CONFIG_FILE}; is it an attnlab work directory (one that "
            "`attnlab train` wrote)?"
        )
    try:
        cfg = experiment.from_json(path.read_text())
    except (OSError, ValueError) as e:
        raise WorkdirError(f"{path} cannot be read ({e}); restore it from a backup") from None
    experiment.register_variants(cfg)
    return cfg


def load_run(workdir, step: int | None = None) -> Run:
    """The ``Run`` of checkpoint ``step`` in ``workdir``.

    The default is the newest checkpoint that can be read (unreadable newer ones are reported
    on stderr); parameters that are not finite are refused with a ``CheckpointError``. It
    opens with any number of devices: the saved mesh where it fits them, else a ``data``
    mesh that splits the batch (``sharding.mesh_for_loading``).
    """
    workdir = pathlib.Path(workdir)
    cfg = saved_config(workdir)
    task = make_task(cfg.data, workdir)
    trainer = Trainer(cfg, kind=task.kind, mesh=sharding.mesh_for_loading(cfg))
    if not (workdir / CHECKPOINTS).is_dir():
        raise CheckpointError(f"no checkpoint in {workdir / CHECKPOINTS}; train the run first")
    with Checkpointer(workdir / CHECKPOINTS) as ckpt:
        steps = ckpt.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {ckpt.directory}; train the run first")
        if step is not None and int(step) not in steps:
            raise CheckpointError(
                f"--step {step}: no such checkpoint in {ckpt.directory} (available: {steps})"
            )
        chosen = steps if step is None else [int(step)]
        state, step = restore_newest(
            ckpt, trainer.abstract_state(), chosen, trainer.all_finite,
            empty_acc=trainer.empty_acc(),
        )  # fmt: skip
    path = workdir / METRICS_FILE
    lines = path.read_text().splitlines() if path.is_file() else []
    rows = [json.loads(line) for line in lines if line.strip()]
    params = trainer.weights(state)  # a LoRA run's: its adapters merged
    return Run(
        workdir=workdir,
        config=cfg,
        step=int(step),
        model=trainer.model(params),
        params=params,
        tokenizer=task.tokenizer,
        metrics=[r for r in rows if r.get("step", 0) <= step],
        trainer=trainer,
        task=task,
    )


def evaluate(workdir, step: int | None = None, *, full: bool = False) -> dict:
    """Evaluates checkpoint ``step`` (default: the newest readable one) on the validation
    split: the run's ``eval.batches`` batches, or with ``full`` every token of the split
    once (``Task.full_eval_batches``; the record then counts the ``eval_tokens``). A
    non-finite result is a ``CheckpointError``."""
    run = load_run(workdir, step)
    cfg, trainer, task, params, step = run.config, run.trainer, run.task, run.params, run.step
    batch_size = int(cfg.eval.batch_size)
    if full:
        batches = list(task.full_eval_batches(batch_size))
    else:
        batches = task.eval_batches(batch_size, max(int(cfg.eval.batches), 1))
    record = trainer.evaluate(params, batches)
    if not math.isfinite(record["eval_loss"]):
        raise CheckpointError(
            f"checkpoint step {step} in {pathlib.Path(workdir) / CHECKPOINTS} gives a non-finite "
            "eval_loss; pick an older step with --step N"
        )
    if full:
        record["eval_tokens"] = int(sum(b["loss_mask"].sum() for b in batches))
    return {"step": step, **record}
