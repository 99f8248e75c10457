"""Where studies and the strategy library live: one database URL. The default is a SQLite
file under KILN_HOME; a PostgreSQL URL (`postgresql://user@host/db`) shares one study and one
library between machines. Unreachable or malformed URLs are one clear error."""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa

from kiln.errors import KilnError
from kiln.home import kiln_home

# A worker's heartbeat; a trial whose worker is silent for the grace period is failed and
# retried by the others (heartbeats need study.optimize, not ask/tell).
HEARTBEAT_S = 10
GRACE_S = 60
SQLITE_TIMEOUT_S = 120  # simultaneous writers wait instead of "database is locked"
# What two processes creating one storage's tables at the same moment see: the loser of the
# race finds the tables or the version row the winner just made. Creating again then succeeds.
CREATION_RACE = ("already exists", "unique constraint failed", "duplicate key", "duplicate column")
CREATION_TRIES = 5
T = TypeVar("T")


def default_url() -> str:
    home = kiln_home()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'tune.db'}"


def engine_kwargs(url: str) -> dict[str, Any]:
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
    return {"pool_pre_ping": True}


def connect(url: str) -> sa.Engine:
    """An engine on `url`, checked to answer now."""
    try:
        engine = sa.create_engine(url, **engine_kwargs(url))
        with engine.connect() as connection:
            connection.execute(sa.text("SELECT 1"))
        return engine
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as exc:
        raise KilnError(
            f"--storage {safe_url(url)}: not a database URL Kiln can use ({exc})."
        ) from (None)
    except ModuleNotFoundError as exc:
        raise KilnError(
            f"--storage {safe_url(url)}: its driver is not installed ({exc.name}); for PostgreSQL "
            "pip install 'psycopg[binary]' and use postgresql+psycopg://..."
        ) from None
    except sa.exc.SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        raise KilnError(f"--storage {safe_url(url)}: cannot connect ({reason}).") from None


def optuna_storage(url: str, heartbeat_s: int = HEARTBEAT_S, grace_s: int = GRACE_S) -> Any:
    """Optuna's RDB storage on `url`, with heartbeats and retry of a dead worker's trial."""
    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    connect(url)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    quiet_optuna()
    try:
        return create_once(url, lambda: RDBStorage(
            url,
            engine_kwargs=engine_kwargs(url),
            heartbeat_interval=heartbeat_s,
            grace_period=grace_s,
            heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=2),
        ))  # fmt: skip
    except Exception as exc:  # optuna wraps the database's errors in its own and others
        raise KilnError(
            f"--storage {safe_url(url)}: cannot open the study storage ({exc})."
        ) from None


def create_study(
    storage: Any,
    name: str,
    directions: list[str],
    *,
    trials: int,
    seed: int | None,
    clash: str,
    constraints: Callable[[Any], list[float]] | None = None,
    group: bool = False,
) -> Any:
    """The study `name` on `storage` (an `optuna_storage`), created or resumed, with the
    sampler both tuners search with: multivariate TPE that starts from a quarter of `trials`
    random ones (2 to 8: a short study must still learn). `constraints` gives a trial's
    violations (≤ 0: met); `group` splits a space whose knobs exist only for some values of
    others. A stored study of other `directions` is refused with `clash`."""
    import optuna

    sampler = optuna.samplers.TPESampler(
        seed=seed, constraints_func=constraints, n_startup_trials=min(8, max(2, trials // 4)),
        multivariate=True, group=group,
    )  # fmt: skip
    try:
        study = optuna.create_study(study_name=name, storage=storage, directions=directions,
                                    sampler=sampler, load_if_exists=True)  # fmt: skip
    except ValueError as exc:
        raise KilnError(f"study '{name}': {exc}") from None
    if [d.name.lower() for d in study.directions] != directions:
        raise KilnError(clash)
    return study


def fail_dead_trials(study: Any) -> None:
    """Fail and retry every trial whose worker is dead: silent past the grace period after a
    heartbeat (Optuna's check) or without ever having sent one (`fail_silent_trials`)."""
    import optuna

    optuna.storages.fail_stale_trials(study)
    fail_silent_trials(study)


def fail_silent_trials(study: Any) -> list[int]:
    """Fail (and retry, through the storage's stale-trial callback) the running trials that
    never sent a heartbeat and started more than the grace period ago: their worker died
    before its heartbeat thread wrote once. Optuna's `fail_stale_trials` skips a trial without
    a heartbeat, so such a trial stayed RUNNING for ever and every waiting worker with it.
    A live trial writes its first heartbeat as it starts, so only a dead one stays silent
    that long. The start is the creating machine's clock: across machines, clocks must agree
    within the grace period (NTP does)."""
    import datetime

    import optuna
    from optuna.storages._rdb.models import TrialHeartbeatModel, TrialModel

    storage = study._storage
    backend = getattr(storage, "_backend", storage)
    grace = getattr(backend, "grace_period", None)
    if grace is None or not hasattr(backend, "scoped_session"):
        return []
    cutoff = datetime.datetime.now() - datetime.timedelta(seconds=grace)
    with backend.scoped_session() as session:
        silent = [
            t.trial_id
            for t in session.query(TrialModel).filter(
                TrialModel.study_id == study._study_id,
                TrialModel.state == optuna.trial.TrialState.RUNNING,
                TrialModel.datetime_start < cutoff,
                ~sa.exists().where(TrialHeartbeatModel.trial_id == TrialModel.trial_id),
            )
        ]
        session.rollback()
    failed = []
    for trial_id in silent:
        try:
            if storage.set_trial_state_values(trial_id, optuna.trial.TrialState.FAIL):
                failed.append(trial_id)
        except optuna.exceptions.UpdateFinishedTrialError:  # another worker failed it first
            pass
    retry = storage.get_heartbeat_stale_trial_callback()
    for trial_id in failed if retry is not None else []:
        retry(study, storage.get_trial(trial_id))
    return failed


def create_once(url: str, make: Callable[[], T]) -> T:
    """`make()` (which creates the storage's tables when missing), safe against other
    processes doing the same at the same moment: under a lock file beside a SQLite database,
    and for any database retried when it loses the creation race (PostgreSQL across
    machines has no common lock file)."""
    for attempt in range(CREATION_TRIES):
        try:
            with _creation_lock(url):
                return make()
        except Exception as exc:
            text = str(getattr(exc, "orig", None) or exc).lower()
            if attempt == CREATION_TRIES - 1 or not any(r in text for r in CREATION_RACE):
                raise
            time.sleep(0.1 * (attempt + 1))  # the winner is committing its tables
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _creation_lock(url: str) -> Iterator[None]:
    """An exclusive lock on `DB.lock` beside a SQLite file; nothing for other databases."""
    database = _sqlite_file(url)
    if database is None:
        yield
        return
    with open(database.with_name(database.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        yield


def _sqlite_file(url: str) -> Path | None:
    try:
        parsed = sa.engine.make_url(url)
    except Exception:  # connect() has already named a malformed URL
        return None
    if not parsed.drivername.startswith("sqlite") or parsed.database in (None, "", ":memory:"):
        return None
    path = Path(parsed.database)
    return path if path.parent.is_dir() else None


CLAIMS = sa.Table("kiln_claims", sa.MetaData(), sa.Column("key", sa.String(200), primary_key=True))


def claim(url: str, key: str) -> bool:
    """True for exactly one of the processes (on any machine) that claim `key` on the
    database at `url`: the insert of a primary key is atomic where a check-then-write is not."""
    engine = connect(url)
    create_once(url, lambda: CLAIMS.metadata.create_all(engine))
    try:
        with engine.begin() as connection:
            connection.execute(CLAIMS.insert().values(key=key))
        return True
    except sa.exc.IntegrityError:
        return False


def quiet_optuna() -> None:
    """Optuna flags heartbeats and multivariate TPE as experimental on every use: Kiln pins
    the version it tested, so the warnings tell the user nothing."""
    import warnings

    import optuna

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def safe_url(url: str) -> str:
    """The URL without its password."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # not even a URL: say it as given
        return url
