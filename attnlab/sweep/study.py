"""The Optuna study of a search (``attnlab.sweep.search``): where it is stored, the
heartbeat a worker records for the trials it trains, and which trials count towards
``num_trials``.

A study lives in ``sqlite:///DIR/study.db`` by default, or in a database server (PostgreSQL,
MySQL) that several workers share; there each worker records a heartbeat for its trials,
and a trial whose worker died is failed and asked again (``make_storage``). Workers that ask
at once may ask too many trials: those beyond ``num_trials`` are marked and failed
(``surplus``), and a dead worker's trial and its retry count once (``counted``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import re
import threading
import time
import warnings

from attnlab.errors import optional_import
from attnlab.experiment import ExperimentError

STUDY_FILE = "study.db"


def _optuna():
    optuna = optional_import("optuna", "optuna", "sweep: method='optuna'")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    # the ask-and-tell loop records its trials' heartbeats itself (``Heartbeat``)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
    return optuna


def default_storage(root) -> str:
    return f"sqlite:///{pathlib.Path(root).resolve() / STUDY_FILE}"


CONNECT_TIMEOUT_S = 10  # a database server that does not answer in this time is unreachable
DRIVERS = ("postgresql", "mysql")  # servers whose drivers take a connect_timeout


def redact(url: str) -> str:
    """``url`` with its password hidden, for log lines and errors."""
    return re.sub(r"//([^:/@]+):[^@/]*@", r"//\1:***@", str(url))


def with_heartbeat(url: str) -> bool:
    """Whether a study in ``url`` tracks its workers' heartbeats: a database server's (many
    workers, some of which may die); SQLite's file stays the one-machine default."""
    return not str(url).startswith("sqlite")


def make_storage(url: str, search):
    """Optuna's storage at ``url``. In a database server, each trial's worker records a
    heartbeat; a trial whose worker died is failed once its heartbeat is ``grace_period``
    old, and asked again as a new trial with the same values and directory
    (``RetryHeartbeatStaleTrialCallback``), which resumes from its checkpoint."""
    optuna = _optuna()
    if not with_heartbeat(url):
        return url
    scheme = str(url).split(":", 1)[0].split("+")[0]
    engine = {"connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}} if scheme in DRIVERS else {}
    given = url
    if (
        url.startswith("postgresql://")
        and importlib.util.find_spec("psycopg") is None  # SQLAlchemy 2.1's default driver
        and importlib.util.find_spec("psycopg2") is not None
    ):
        url = "postgresql+psycopg2://" + url.removeprefix("postgresql://")
    retry = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
    options = {"heartbeat_interval": search.heartbeat_interval}
    options["grace_period"] = search.grace_period
    if retry is None:  # Optuna before 4.9
        options["failed_trial_callback"] = optuna.storages.RetryFailedTrialCallback(
            inherit_intermediate_values=True
        )
    else:
        options["heartbeat_stale_trial_callback"] = retry(inherit_intermediate_values=True)
    try:
        return _rdb_storage(url, engine, options)
    except ImportError:  # Optuna's words for a missing driver
        extra = "'attnlab[postgres]'" if scheme == "postgresql" else f"a {scheme} driver"
        raise ExperimentError(
            f"--storage {redact(given)}: no database driver for {scheme} is installed; pip "
            f"install {extra}"
        ) from None
    except Exception as e:  # SQLAlchemy's errors: the server is down, the name is wrong
        why = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
        raise ExperimentError(
            f"--storage {redact(given)}: the study database cannot be reached ({why}); start "
            "the database server, or check the URL's host, port, name and user"
        ) from None


def _rdb_storage(url, engine, options, attempts: int = 5):
    """``RDBStorage``; workers that start together on an empty database race to create its
    tables, and the losers' second attempt finds them made."""
    import sqlalchemy.exc

    optuna = _optuna()
    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine, **options)
        except sqlalchemy.exc.OperationalError:  # no server there: no use trying again
            raise
        except sqlalchemy.exc.DBAPIError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.5 * (attempt + 1))


SURPLUS = "surplus"  # the user attribute of a trial asked beyond num_trials, given back


def _counting(trials) -> list:
    """The trials that count towards ``num_trials``: all but the failed ones that a later
    trial retries (a dead worker's trial and its retry are one trial) and the surplus."""
    retried = {n for t in trials for n in t.system_attrs.get("retry_history", ())}
    return [t for t in trials if t.number not in retried and not t.user_attrs.get(SURPLUS)]


def counted(study) -> int:
    return len(_counting(study.get_trials(deepcopy=False)))


def surplus(study, trial, num_trials: int) -> bool:
    """Whether ``trial``, just asked, lies beyond the first ``num_trials`` (workers that ask
    at once may together ask too many); if so it is marked and failed, counting for none.
    Trials rank by the number of the trial they retry, else their own."""
    ranked = sorted(
        _counting(study.get_trials(deepcopy=False)),
        key=lambda t: (t.system_attrs.get("failed_trial", t.number), t.number),
    )
    if trial.number in {t.number for t in ranked[:num_trials]}:
        return False
    trial.set_user_attr(SURPLUS, True)
    study.tell(trial, state=_optuna().trial.TrialState.FAIL)
    return True


class Heartbeat:
    """Records the heartbeat of ``trials`` every ``interval`` seconds while training them
    (``Study.optimize`` does this for its own trials; an ask-and-tell loop does it itself)."""

    def __init__(self, study, trials, interval: float):
        self._storage, self._ids = study._storage, [t._trial_id for t in trials]
        self._interval, self._stop = float(interval), threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self):
        while True:
            for trial_id in self._ids:
                # a trial told meanwhile refuses the beat; the others go on
                with contextlib.suppress(Exception):
                    self._storage.record_heartbeat(trial_id)
            if self._stop.wait(self._interval):
                return

    def __enter__(self):
        if self._ids:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
