"""Standard evaluation: attnlab models scored by the EleutherAI harness (``lm-eval``).

``attnlab eval --harness TASKS --workdir RUN`` (or ``--pretrained DIR``) runs the harness's
tasks with the model as an ``lm_eval.api.model.LM`` (``harness.make_lm``) over a
``backends.Backend`` (``from_run``, ``from_pretrained``); the harness is the optional extra
``eval`` (``pip install -e ".[eval]"``).
"""
