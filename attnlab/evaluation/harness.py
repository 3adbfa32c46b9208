"""``AttnlabLM``: an attnlab model as an ``lm_eval.api.model.LM``, and ``run_harness``.

``loglikelihood`` scores ``(context, continuation)`` pairs the harness's way
(``TemplateLM``: trailing spaces of the context move to the continuation, the continuation's
ids are those of ``context + continuation`` after the context's; an empty context is
conditioned on ``Backend.prefix_id``), rows cut to their last ``max_len + 1`` ids.
``loglikelihood_rolling`` sums disjoint windows of the model's context over the whole text
(the harness's ``get_rolling_token_windows``). ``generate_until`` decodes greedily with the
KV-cache decoder in batches of requests that share their generation settings, prompts cut
to leave room for ``max_gen_toks``, and cuts each text at its first stop sequence.

Nothing is downloaded: tasks come from the harness's own task folders or ``include_path``
(local YAML files); the data sets they name must be on disk (``dataset_path: json`` with
``data_files``, say) or in the Hugging Face cache with ``HF_DATASETS_OFFLINE=1``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys

from attnlab.errors import ConfigError, optional_import


def _lm_eval():
    lm_eval = optional_import("lm_eval", "eval", "--harness (the EleutherAI harness)")
    from lm_eval.api.model import TemplateLM

    return lm_eval, TemplateLM


def make_lm(backend, batch_size: int = 8):
    """The ``LM`` of ``backend`` (an ``attnlab.evaluation.Backend``)."""
    _, TemplateLM = _lm_eval()
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class AttnlabLM(TemplateLM):
        def __init__(self):
            super().__init__()
            self.backend, self.batch_size = backend, batch_size

        @property
        def eot_token_id(self):
            return backend.prefix_id if backend.eos_id is None else backend.eos_id

        @property
        def prefix_token_id(self):
            return backend.prefix_id

        @property
        def tokenizer_name(self) -> str:
            return backend.name

        def tok_encode(self, string, add_special_tokens=None, **kwargs):
            return backend.encode(string)

        def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
            rows = [(list(ctx) + list(cont), len(cont)) for _, ctx, cont in requests]
            return backend.scores(rows, self.batch_size)

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            out = []
            for (text,) in [r.args for r in requests]:
                windows = get_rolling_token_windows(
                    backend.encode(text), backend.prefix_id, backend.max_len, 1
                )
                rows = [(ctx + cont, len(cont)) for ctx, cont in map(make_disjoint_window, windows)]
                out.append(sum(s for s, _ in backend.scores(rows, self.batch_size)))
            return out

        def generate_until(self, requests, disable_tqdm=False):
            return _generate_until(backend, requests, self.batch_size)

    return AttnlabLM()


def _generate_until(backend, requests, batch_size: int) -> list[str]:
    """Greedy continuations, decoded together per generation settings, cut at the first
    stop sequence."""
    from lm_eval.models.utils import handle_stop_sequences

    out = [None] * len(requests)
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(json.dumps(r.args[1], sort_keys=True, default=str), []).append(i)
    for key, members in groups.items():
        kwargs = json.loads(key)
        until = handle_stop_sequences(kwargs.get("until"), None)
        n = int(kwargs.get("max_gen_toks", 256))
        keep = max(backend.max_len - n, 1)
        for first in range(0, len(members), batch_size):
            chunk = members[first : first + batch_size]
            prompts = [
                (backend.encode(requests[i].args[0]) or [backend.prefix_id])[-keep:] for i in chunk
            ]
            for i, ids in zip(chunk, backend.generate(prompts, n), strict=True):
                text = backend.decode(ids)
                for stop in until:
                    text = text.split(stop)[0] if stop else text
                out[i] = text
    return out


def _quiet_git_hash():
    """The harness's ``get_git_commit_hash`` without git's "fatal: not a git repository"
    on stderr when the working directory is not in a repository."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        done = subprocess.run(
            ["git", "describe", "--always"], capture_output=True, text=True, check=False
        )
    except FileNotFoundError:  # no git on the machine
        done = None
    if done is not None and done.returncode == 0:
        return done.stdout.strip()
    return get_commit_from_path(os.getcwd())


@contextlib.contextmanager
def _quiet_harness():
    """While the harness runs: git asked quietly, bootstrap resamples drawn in this
    process (the harness's ``DISABLE_MULTIPROC``: the same seeds, no fork of a process
    that runs JAX's threads) and its progress prints on stderr, keeping stdout for the
    results."""
    import lm_eval.evaluator

    saved_env, saved_hash = os.environ.get(_NO_FORK), lm_eval.evaluator.get_git_commit_hash
    os.environ[_NO_FORK] = "1"
    lm_eval.evaluator.get_git_commit_hash = _quiet_git_hash
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = saved_hash
        if saved_env is None:
            os.environ.pop(_NO_FORK, None)
        else:
            os.environ[_NO_FORK] = saved_env


_NO_FORK = "DISABLE_MULTIPROC"


def run_harness(
    backend,
    tasks,
    *,
    include_path=None,
    limit=None,
    num_fewshot=None,
    batch_size: int = 8,
    log_samples: bool = False,
    bootstrap_iters: int = 100_000,
) -> dict:
    """The harness's ``results`` per task (as ``lm_eval.simple_evaluate`` gives them), and
    with ``log_samples`` each task's ``samples`` (documents, responses, metrics).

    Each metric's ``<metric>_stderr`` is the harness's own: closed form for means such as
    ``acc``, ``bootstrap_iters`` resamples (the harness's default) for the metrics it
    bootstraps, "N/A" where it has none or with ``bootstrap_iters=0``.
    """
    lm_eval, _ = _lm_eval()
    from lm_eval.tasks import TaskManager

    names = [t for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t]
    if not names:
        raise ConfigError("--harness needs task names, e.g. --harness lambada_openai,hellaswag")
    if include_path is not None and not pathlib.Path(include_path).is_dir():
        raise ConfigError(f"--include-path {include_path}: no such directory of task YAML files")
    manager = TaskManager(include_path=None if include_path is None else str(include_path))
    unknown = [t for t in names if not manager.match_tasks([t])]
    if unknown:
        raise ConfigError(
            f"--harness: unknown task {unknown[0]!r}; `lm-eval ls tasks` lists them, or pass "
            "--include-path DIR with its YAML file"
        )
    with _quiet_harness():
        results = lm_eval.simple_evaluate(
            model=make_lm(backend, batch_size),
            tasks=names,
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=log_samples,
            bootstrap_iters=bootstrap_iters,
        )
    out = {"results": results["results"], "versions": results.get("versions", {})}
    if log_samples:
        out["samples"] = results["samples"]
    return out
