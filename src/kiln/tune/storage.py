"""Where studies and the strategy library live: one database URL. The default is a SQLite
file under KILN_HOME; a PostgreSQL URL (`postgresql://user@host/db`) shares one study and one
library between machines. Unreachable or malformed URLs are one clear error."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from kiln.errors import KilnError
from kiln.home import kiln_home

# A worker's heartbeat; a trial whose worker is silent for the grace period is failed and
# retried by the others (heartbeats need study.optimize, not ask/tell).
HEARTBEAT_S = 10
GRACE_S = 60
SQLITE_TIMEOUT_S = 120  # simultaneous writers wait instead of "database is locked"


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
        raise KilnError(f"--storage {_safe(url)}: not a database URL Kiln can use ({exc}).") from (
            None
        )
    except ModuleNotFoundError as exc:
        raise KilnError(
            f"--storage {_safe(url)}: its driver is not installed ({exc.name}); for PostgreSQL "
            "pip install 'psycopg[binary]' and use postgresql+psycopg://..."
        ) from None
    except sa.exc.SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        raise KilnError(f"--storage {_safe(url)}: cannot connect ({reason}).") from None


def optuna_storage(url: str, heartbeat_s: int = HEARTBEAT_S, grace_s: int = GRACE_S) -> Any:
    """Optuna's RDB storage on `url`, with heartbeats and retry of a dead worker's trial."""
    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    connect(url)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    quiet_optuna()
    try:
        return RDBStorage(
            url,
            engine_kwargs=engine_kwargs(url),
            heartbeat_interval=heartbeat_s,
            grace_period=grace_s,
            heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=2),
        )
    except Exception as exc:  # optuna wraps the database's errors in its own and others
        raise KilnError(f"--storage {_safe(url)}: cannot open the study storage ({exc}).") from None


def quiet_optuna() -> None:
    """Optuna flags heartbeats and multivariate TPE as experimental on every use: Kiln pins
    the version it tested, so the warnings tell the user nothing."""
    import warnings

    import optuna

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def _safe(url: str) -> str:
    """The URL without its password."""
    try:
        return sa.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # not even a URL: say it as given
        return url
