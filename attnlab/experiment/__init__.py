"""Experiment configs: one Python file per experiment, typed, validated, overridable.

An experiment file defines ``get_config(variant=None) -> ml_collections.ConfigDict`` built on
``base_config()``; ``variant="tiny"`` (``--config experiments/NAME.py:tiny``) gives its tiny
CPU twin. Values are overridden with dotted flags in the ml_collections style::

    attnlab train --config experiments/char_lm.py --config.model.n_layers=4 --workdir runs/x

Every experiment has these groups: ``model`` (the ``ModelConfig`` fields), ``data``
(``attnlab.data.make_task`` fields), ``optim``, ``train``, ``eval``, ``checkpoint``. Field types
are locked: an override of the wrong type, an unknown key or an invalid value is an
``ExperimentError`` naming the key.

Variants: ``NAME.py:VARIANT`` must name one of the file's ``VARIANTS`` (default
``("tiny",)``); anything else is an error listing them.

An experiment file may register attention variants at import time
(``attnlab.register_attention``) for ``model.attention_fn`` to name. ``load_config`` records
the file's absolute path in the top-level ``experiment_file`` key, which is saved in the work
directory's ``config.json``; loading that config (or validating one that names it) imports the
file first, so any process can reopen or repeat the run.
"""

from attnlab.errors import ConfigError  # noqa: F401  (read as attnlab.experiment.ConfigError)
from attnlab.experiment.files import (  # noqa: F401  (read as attnlab.experiment.*)
    ConfigDict,
    _merge,
    as_namespace,
    flat_keys,
    from_json,
    load_config,
    to_json,
)
from attnlab.experiment.harness import run_script, tiny_run  # noqa: F401
from attnlab.experiment.schema import (  # noqa: F401  (read as attnlab.experiment.*)
    ExperimentError,
    _load_python,
    base_config,
    import_experiment,
    import_file,
    model_config,
    register_variants,
    validate,
)
