"""What the experiment files share besides their configs: the tiny CPU twins' run, a few
steps on a few rows, logged at every step, evaluated on one batch and checkpointed at its end
(``tiny_run``; each twin shrinks its own model and data beside it), and running a file's
``main`` as a script (``run_script``)."""

from __future__ import annotations

import pathlib
import sys

from attnlab.errors import AttnlabError


def tiny_run(c, *, steps: int = 3, batch_size: int = 4, **eval_fields):
    """``c``'s train, eval and checkpoint groups set for a tiny twin: ``steps`` steps of
    ``batch_size`` rows with a log line at each, one evaluation batch of ``batch_size`` rows
    and a checkpoint at the last step; ``eval_fields`` (``sample_tokens=8``, say) join the
    eval group."""
    c.train.update(steps=steps, batch_size=batch_size, log_every_steps=1)
    c.eval.update(every_steps=steps, batches=1, batch_size=batch_size, **eval_fields)
    c.checkpoint.update(every_steps=steps)


def run_script(main, file: str):
    """``main()`` of the experiment file ``file`` run as a script: an expected error (an
    ``AttnlabError``) exits with its message alone, as the ``attnlab`` command does."""
    try:
        main()
    except AttnlabError as e:
        sys.exit(f"{pathlib.Path(file).name}: error: {e}")
