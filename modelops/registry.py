"""The registry: models, versions, serving instances and traffic weights (SQLAlchemy).

Every lifecycle step writes here *before* its side effect, so a retried or re-run flow finds
what an earlier attempt started instead of starting a second copy.

Version states: provisioning → serving → draining → retired, or failed from any of them.
Weights are integers 0..100 (percent of the model's traffic at the router).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import ForeignKey, String, Text, UniqueConstraint, create_engine, delete, event, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, relationship, sessionmaker

from modelops.errors import RegistryError
from modelops.experiments import Arm, ExperimentSpec
from modelops.manifest import Manifest
from modelops.shadow import ShadowSpec
from modelops.scaling import Scaling
from modelops.tenancy import KeyGrant

__all__ = ["LIVE_INSTANCE_STATES", "USAGE_BUCKET_S", "ApiKey", "Experiment", "Instance", "KeyUsage", "ModelVersion",
           "Registry", "ScaleDecision", "Shadow", "VersionState", "database_problem", "revoked_key_refusal",
           "sqlite_problem"]

# Instance states that hold a place in the router and the counts: running, or restarting (its
# supervisor brings it back on the same ports: modelops/supervisor.py).
LIVE_INSTANCE_STATES = ("running", "restarting")

# stopped: was serving when the local stack went down (`modelops down`); `modelops up` serves it again.
VersionState = Literal["provisioning", "serving", "draining", "stopped", "retired", "failed"]
VERSION_STATES: tuple[str, ...] = ("provisioning", "serving", "draining", "stopped", "retired", "failed")


def _now() -> datetime:
    return datetime.now(UTC)


class _Base(DeclarativeBase):
    pass


class ModelVersion(_Base):
    """One announced (model_id, version)."""

    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("model_id", "version"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[str] = mapped_column(String(63), index=True)
    version: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16), default="provisioning")
    weight: Mapped[int] = mapped_column(default=0)
    strategy: Mapped[str] = mapped_column(String(16), default="auto")
    io_schema_hash: Mapped[str] = mapped_column(String(64), default="")
    manifest_json: Mapped[str] = mapped_column(Text)
    reason: Mapped[str] = mapped_column(Text, default="")
    flow_run_id: Mapped[str] = mapped_column(String(64), default="")
    created_at: Mapped[datetime] = mapped_column(default=_now)
    updated_at: Mapped[datetime] = mapped_column(default=_now, onupdate=_now)
    instances: Mapped[list[Instance]] = relationship(back_populates="model_version", order_by="Instance.id")

    @property
    def manifest(self) -> Manifest:
        return Manifest.model_validate_json(self.manifest_json)


class Instance(_Base):
    """One serving instance (a Triton + OpenAI frontend process group) of a version."""

    __tablename__ = "instances"

    id: Mapped[int] = mapped_column(primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("model_versions.id"), index=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    # starting|running|restarting|draining (leaving: out of the router, finishing its requests)|failed|stopped
    state: Mapped[str] = mapped_column(String(16), default="starting")
    pid: Mapped[int | None] = mapped_column(default=None)
    endpoints_json: Mapped[str] = mapped_column(Text, default="{}")
    log_path: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=_now)
    # Deaths after serving that its supervisor restarted (modelops/supervisor.py), and the last one's cause.
    restarts: Mapped[int] = mapped_column(default=0, server_default="0")
    last_exit: Mapped[str] = mapped_column(Text, default="", server_default="")
    model_version: Mapped[ModelVersion] = relationship(back_populates="instances")

    @property
    def endpoints(self) -> dict[str, str]:
        return json.loads(self.endpoints_json)


class RolloutLock(_Base):
    """The rollout in progress for a model: one row per model while a rollout holds it.

    ``host`` and ``pid`` name the holding process; ``renewed_at`` (Unix seconds) is the holder's
    last heartbeat, which is how a holder on another host (a flow run in another pod) is judged.
    """

    __tablename__ = "rollout_locks"

    model_id: Mapped[str] = mapped_column(String(63), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))
    pid: Mapped[int] = mapped_column(default=0)
    host: Mapped[str] = mapped_column(String(253), default="", server_default="")
    acquired_at: Mapped[datetime] = mapped_column(default=_now)
    renewed_at: Mapped[float] = mapped_column(default=0.0, server_default="0")


class ScaleDecision(_Base):
    """One decision of the autoscaler (:mod:`tasks.autoscale`) for a version: from ``before`` to
    ``after`` instances on ``signal`` (its per-instance ``value``), and how it ended
    (``outcome``: started, done, failed; ``detail`` says why or what failed)."""

    __tablename__ = "scale_decisions"

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[str] = mapped_column(String(63), index=True)
    version: Mapped[str] = mapped_column(String(64))
    at: Mapped[datetime] = mapped_column(default=_now)
    before: Mapped[int] = mapped_column()
    after: Mapped[int] = mapped_column()
    signal: Mapped[str] = mapped_column(String(32), default="")
    value: Mapped[float | None] = mapped_column(default=None)
    outcome: Mapped[str] = mapped_column(String(16), default="started")
    detail: Mapped[str] = mapped_column(Text, default="")
    seconds: Mapped[float | None] = mapped_column(default=None)


class ApiKey(_Base):
    """One tenant's API key (:mod:`modelops.tenancy`): never the key itself, only its SHA-256
    (``key_hash``); ``models_json`` the scope (model ids or ``["*"]``); limits (None: none);
    ``revoked_at`` set once revoked (the row stays, so a revoked name is not reused by mistake
    and the router stays closed once any key was made)."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    models_json: Mapped[str] = mapped_column(Text)
    rpm: Mapped[int | None] = mapped_column(default=None)
    max_concurrency: Mapped[int | None] = mapped_column(default=None)
    tpm: Mapped[int | None] = mapped_column(default=None)
    throttled_until: Mapped[float] = mapped_column(default=0.0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(default=_now)
    rotated_at: Mapped[datetime | None] = mapped_column(default=None)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(json.loads(self.models_json))

    def grant(self) -> KeyGrant:
        """What the router enforces for this key."""
        return KeyGrant(self.name, self.key_hash, self.models, rpm=self.rpm, max_concurrency=self.max_concurrency,
                        tpm=self.tpm, throttled_until=self.throttled_until)


class KeyUsage(_Base):
    """What the instances counted for one key and model in one ``bucket`` (Unix seconds, a
    multiple of :data:`USAGE_BUCKET_S`), from their ``modelops_key_*_total`` counters
    (runtime/frontend/usage.py) as the autoscaler daemon reads them (tasks/autoscale/usage.py)."""

    __tablename__ = "key_usage"
    __table_args__ = (UniqueConstraint("key_name", "model_id", "bucket"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    key_name: Mapped[str] = mapped_column(String(63), index=True)
    model_id: Mapped[str] = mapped_column(String(63))
    bucket: Mapped[int] = mapped_column(index=True)
    requests: Mapped[int] = mapped_column(default=0)
    prompt_tokens: Mapped[int] = mapped_column(default=0)
    completion_tokens: Mapped[int] = mapped_column(default=0)


USAGE_BUCKET_S = 10  # seconds of usage one KeyUsage row holds


class Experiment(_Base):
    """An experiment on a model (:mod:`modelops.experiments`): its arms, the key requests are
    split by, the default arm; ``stopped_at`` is None while it runs, ``kept`` the version it
    ended with. One runs per model at a time; the rows stay as its history."""

    __tablename__ = "experiments"

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[str] = mapped_column(String(63), index=True)
    arms_json: Mapped[str] = mapped_column(Text)
    key: Mapped[str] = mapped_column(String(80))
    default_version: Mapped[str] = mapped_column(String(64))
    started_at: Mapped[datetime] = mapped_column(default=_now)
    stopped_at: Mapped[datetime | None] = mapped_column(default=None)
    kept: Mapped[str] = mapped_column(String(64), default="")
    # Each arm's instance counters when it started ({version: {...}}), so its figures count from then.
    baseline_json: Mapped[str] = mapped_column(Text, default="{}")

    def spec(self) -> ExperimentSpec:
        """What the router renders."""
        return ExperimentSpec(tuple(Arm(v, p) for v, p in json.loads(self.arms_json)), self.key, self.default_version)


class Shadow(_Base):
    """A shadow on a model (:mod:`modelops.shadow`): ``version`` gets a copy of ``percent`` of its
    unpinned requests; ``origin`` says who started it (``cli``, or ``red-black`` for a rollout's
    shadow phase). ``stopped_at`` is None while it runs; one runs per model; the rows stay as
    its history (the comparison's metrics are labelled by ``id``)."""

    __tablename__ = "shadows"

    id: Mapped[int] = mapped_column(primary_key=True)
    model_id: Mapped[str] = mapped_column(String(63), index=True)
    version: Mapped[str] = mapped_column(String(64))
    percent: Mapped[int] = mapped_column()
    origin: Mapped[str] = mapped_column(String(32), default="cli")
    started_at: Mapped[datetime] = mapped_column(default=_now)
    stopped_at: Mapped[datetime | None] = mapped_column(default=None)

    def spec(self) -> ShadowSpec:
        """What the router renders."""
        return ShadowSpec(self.id, self.version, self.percent)


_MIGRATED: set[str] = set()  # registry URLs whose schema this process has brought up to date
_SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite 3 database (sqlite.org/fileformat.html)
_START_AFRESH = ("restore it from a backup, or move it away and modelops starts an empty one (every model, version and "
                 "key it held is then forgotten)")


def sqlite_problem(url: str) -> str | None:
    """Why the SQLite registry at ``url`` cannot be opened, naming the file and the way out, or
    None: another database, a file not made yet, an empty one (SQLite makes a database in it), or
    a modelops registry in SQLite. Reads a regular file's first 16 bytes, then lists its tables
    over a read-only connection (never opens a FIFO or a device, which could block); changes
    nothing."""
    from pathlib import Path

    if not url.startswith("sqlite:///"):
        return None
    path = Path(url.removeprefix("sqlite:///"))
    if path.is_symlink() and not path.exists():
        return f"the registry {path} is a link to {path.readlink()}, which does not exist: fix the link or remove it"
    if not path.exists():
        return None
    if not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file"
        return f"the registry {path} is {kind}: remove or rename it, or set MODELOPS_HOME to another folder"
    try:
        with path.open("rb") as f:
            head = f.read(len(_SQLITE_HEADER))
    except OSError as e:
        return f"the registry {path} cannot be read ({e.strerror or e}): fix its permissions, or set MODELOPS_HOME"
    if not head:
        return None
    if head != _SQLITE_HEADER:
        return f"the registry {path} is not a SQLite database (it begins {head[:8]!r}): {_START_AFRESH}"
    import sqlite3

    try:  # read-only: the engine's first connection would switch the file to WAL
        with contextlib.closing(sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)) as db:
            tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as e:
        return f"the registry {path} cannot be read as a database ({e}): {_START_AFRESH}"
    if tables and not tables & set(_Base.metadata.tables):
        # Another program's database: adding the registry's tables would change a file never given to modelops.
        return (f"the registry {path} is another program's database (tables: {', '.join(sorted(tables)[:5])}), not "
                "a modelops registry: point MODELOPS_HOME or MODELOPS_REGISTRY_URL elsewhere; nothing was changed")
    return None


def database_problem(url: str, e: Exception) -> str:
    """One line for a database error ``e`` (SQLAlchemy's ``DBAPIError``) raised while using the
    registry at ``url``: what SQLite or the server said and what to do about it."""
    said = str(getattr(e, "orig", None) or e).splitlines()[0]
    where = url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else "at MODELOPS_REGISTRY_URL"
    if "readonly database" in said or "unable to open database" in said:
        fix = "modelops writes to it and to its folder (SQLite's journal): fix their permissions, or set MODELOPS_HOME"
    elif "malformed" in said or "not a database" in said or "no such column" in said or "no such table" in said:
        fix = _START_AFRESH
    else:
        fix = "check the database, then run the command again"
    return f"the registry {where} failed: {said}: {fix}"


def revoked_key_refusal(name: str) -> str:
    """What a command that would give revoked key ``name`` a new secret says instead."""
    return f"key {name!r} is revoked; create a new one under another name (`modelops keys create`)"


def _name_taken(row: "ApiKey | None") -> str | None:
    """Why a new key cannot have ``row``'s name (None: no such key)."""
    if row is None:
        return None
    if row.revoked_at is not None:  # its usage history keeps the name: never handed out again
        return (f"the name {row.name!r} belongs to a revoked key, and a revoked key's name is not used again (its "
                "usage stays under it): pick another name")
    return (f"a key named {row.name!r} exists already (`modelops keys ls`); pick another name, or "
            f"`modelops keys rotate {row.name}` for a new secret")


class Registry:
    """Access to the registry database.

    Args:
        url: SQLAlchemy URL, e.g. ``sqlite:///.modelops/registry.db`` or a Postgres URL.
    """

    def __init__(self, url: str) -> None:
        """Raises:
            RegistryError: a SQLite registry that cannot be used as one: not a database, damaged,
                another program's, not a regular file (:func:`sqlite_problem`; checked on this
                process's first Registry of ``url``, as the schema is migrated)."""
        if url not in _MIGRATED and (problem := sqlite_problem(url)):
            raise RegistryError(problem)
        self.url = url
        if url.startswith("sqlite:///"):
            from pathlib import Path

            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self._engine = create_engine(url, connect_args={"timeout": 30} if url.startswith("sqlite") else {})
        if url.startswith("sqlite"):
            # WAL lets the CLI read while a flow writes in another process.
            event.listen(self._engine, "connect", lambda conn, _: conn.execute("PRAGMA journal_mode=WAL"))
        if url not in _MIGRATED:  # once per process and database: Registry() is made in every task
            self._migrate()
            _MIGRATED.add(url)
        _Base.metadata.create_all(self._engine)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)

    def _migrate(self) -> None:
        """Bring a registry written by an older modelops up to this schema: rollout_locks gained
        ``host`` and ``renewed_at``, instances ``restarts`` and ``last_exit``, added in place with
        defaults (SQLite and Postgres both take ``ADD COLUMN ... DEFAULT``), so a lock held during
        the upgrade is kept and older writers, which do not set them, still insert."""
        from sqlalchemy import inspect, text
        from sqlalchemy.exc import OperationalError, ProgrammingError

        added = {"rollout_locks": (("host", "VARCHAR(253) NOT NULL DEFAULT ''"),
                                   ("renewed_at", "FLOAT NOT NULL DEFAULT 0")),
                 "instances": (("restarts", "INTEGER NOT NULL DEFAULT 0"), ("last_exit", "TEXT NOT NULL DEFAULT ''"))}
        tables = inspect(self._engine).get_table_names()
        for table, new_columns in added.items():
            if table not in tables:
                continue
            columns = {c["name"] for c in inspect(self._engine).get_columns(table)}
            for name, ddl in new_columns:
                if name in columns:
                    continue
                try:
                    with self._engine.begin() as conn:
                        conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {name} {ddl}"))
                except (OperationalError, ProgrammingError):  # another process added it meanwhile
                    if name not in {c["name"] for c in inspect(self._engine).get_columns(table)}:
                        raise

    @property
    def engine(self):
        """The SQLAlchemy engine: for stores of other concerns that keep their tables in the
        same database (modelops/batch_store.py)."""
        return self._engine

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A transaction: commits on success, rolls back on error."""
        with self._sessions.begin() as s:
            yield s

    # -- versions --------------------------------------------------------------------------
    def get_version(self, model_id: str, version: str) -> ModelVersion | None:
        with self.session() as s:
            return s.scalar(
                select(ModelVersion).where(ModelVersion.model_id == model_id, ModelVersion.version == version)
            )

    def versions(self, model_id: str | None = None) -> list[ModelVersion]:
        """All versions (of one model), oldest first."""
        with self.session() as s:
            q = select(ModelVersion).order_by(ModelVersion.model_id, ModelVersion.id)
            if model_id is not None:
                q = q.where(ModelVersion.model_id == model_id)
            return list(s.scalars(q))

    def default_version(self, model_id: str) -> str | None:
        """The one version that takes ``model_id``'s unpinned traffic (serving, weight > 0); None
        when there is none or a red-black shift splits it between two."""
        weighted = [v.version for v in self.versions(model_id) if v.state == "serving" and v.weight > 0]
        return weighted[0] if len(weighted) == 1 else None

    def record_announcement(self, manifest: Manifest, flow_run_id: str = "") -> tuple[ModelVersion, bool]:
        """Insert (model_id, version) in state provisioning unless it exists.

        Returns:
            (the row, created). An existing row is returned unchanged, except that a retired,
            failed or stopped version is moved back to provisioning (it is being announced again).

        Raises:
            ManifestError: the version exists with a different manifest (versions are immutable).
        """
        from modelops.errors import ManifestError

        with self.session() as s:
            row = s.scalar(
                select(ModelVersion).where(
                    ModelVersion.model_id == manifest.model_id, ModelVersion.version == manifest.version
                )
            )
            if row is None:
                row = ModelVersion(
                    model_id=manifest.model_id,
                    version=manifest.version,
                    strategy=manifest.strategy,
                    io_schema_hash=manifest.io_schema_hash(),
                    manifest_json=manifest.model_dump_json(),
                    flow_run_id=flow_run_id,
                )
                s.add(row)
                return row, True
            if Manifest.model_validate_json(row.manifest_json) != manifest:
                raise ManifestError(
                    f"version: {manifest.model_id} version {manifest.version} was already announced "
                    "with a different manifest; versions are immutable, announce a new version"
                )
            if row.state in ("retired", "failed", "stopped"):
                row.state, row.reason = "provisioning", ""
            if flow_run_id:
                row.flow_run_id = flow_run_id
            return row, False

    def set_state(self, model_id: str, version: str, state: VersionState, reason: str = "") -> None:
        """Set a version's state and why; a shadow copying to it ends when it leaves ``serving``."""
        if state not in VERSION_STATES:
            raise ValueError(f"state must be one of {VERSION_STATES}, got {state!r}")
        with self.session() as s:
            row = self._require(s, model_id, version)
            row.state, row.reason = state, reason
            if state != "serving":
                for shadow in s.scalars(select(Shadow).where(Shadow.model_id == model_id, Shadow.version == version,
                                                             Shadow.stopped_at.is_(None))):
                    shadow.stopped_at = _now()

    def set_weights(self, model_id: str, weights: dict[str, int]) -> None:
        """Set the traffic weight (0..100) of each named version of a model in one transaction."""
        with self.session() as s:
            for version, weight in weights.items():
                if not 0 <= weight <= 100:
                    raise ValueError(f"weight of {model_id}/{version} must be 0..100, got {weight}")
                self._require(s, model_id, version).weight = weight

    def try_lock_rollout(self, model_id: str, holder: str, pid: int, host: str | None = None,
                         lease_s: float = 60.0) -> str:
        """Take the model's rollout lock for ``holder`` (a flow run, process ``pid`` on ``host``,
        default this machine's name); the same (holder, host, pid) taking it again is a no-op.

        A lock whose holder is gone is taken over: on the same host, when its process is dead; on
        another host (another pod: pids mean nothing across PID namespaces), when it has not been
        renewed (:meth:`renew_rollout_lock`) for ``lease_s`` seconds by this host's clock, so
        clocks must agree to well within the lease. The takeover is a compare-and-swap on the
        stale row: of two contenders, one wins.

        Returns:
            ``""`` when the lock is ours now, else a description of who holds it.
        """
        import socket
        import time

        from sqlalchemy import update
        from sqlalchemy.exc import IntegrityError

        from modelops.process import pid_alive

        host = host if host is not None else socket.gethostname()
        now = time.time()
        try:
            with self.session() as s:
                row = s.get(RolloutLock, model_id)
                if row is None:
                    s.add(RolloutLock(model_id=model_id, holder=holder, pid=pid, host=host, renewed_at=now))
                    return ""
                if (row.holder, row.host, row.pid) == (holder, host, pid):
                    return ""
                # host "" is a row of an older modelops, which judged holders by pid alone
                alive = pid_alive(row.pid) if row.host in ("", host) else now - row.renewed_at < lease_s
                if alive:
                    return f"{row.holder} (pid {row.pid} on {row.host or '?'}, since {row.acquired_at:%H:%M:%S} UTC)"
                swapped = s.execute(
                    update(RolloutLock)
                    .where(RolloutLock.model_id == model_id, RolloutLock.holder == row.holder,
                           RolloutLock.host == row.host, RolloutLock.pid == row.pid,
                           RolloutLock.renewed_at == row.renewed_at)
                    .values(holder=holder, pid=pid, host=host, acquired_at=_now(), renewed_at=now)
                    .execution_options(synchronize_session=False))
                if swapped.rowcount != 1:
                    return "another rollout (it took over the stale lock first)"
        except IntegrityError:  # another process inserted it between our read and write
            return "another rollout (just started)"
        return ""

    def _owned(self, s: Session, model_id: str, holder: str, host: str | None, pid: int | None):
        import os
        import socket

        row = s.get(RolloutLock, model_id)
        mine = (holder, socket.gethostname() if host is None else host, os.getpid() if pid is None else pid)
        return row if row is not None and (row.holder, row.host, row.pid) == mine else None

    def renew_rollout_lock(self, model_id: str, holder: str, host: str | None = None, pid: int | None = None) -> bool:
        """The holder's heartbeat (``host``/``pid`` default to this process): refresh
        ``renewed_at``. False when it no longer has the lock (taken over after a missed lease)."""
        import time

        with self.session() as s:
            if (row := self._owned(s, model_id, holder, host, pid)) is None:
                return False
            row.renewed_at = time.time()
            return True

    def unlock_rollout(self, model_id: str, holder: str, host: str | None = None, pid: int | None = None) -> None:
        """Release the model's rollout lock if ``holder`` (on ``host``, process ``pid``: default
        this process) has it."""
        with self.session() as s:
            if (row := self._owned(s, model_id, holder, host, pid)) is not None:
                s.delete(row)

    def set_strategy(self, model_id: str, version: str, strategy: str) -> None:
        with self.session() as s:
            self._require(s, model_id, version).strategy = strategy

    # -- instances -------------------------------------------------------------------------
    def add_instance(self, model_id: str, version: str, name: str, log_path: str) -> Instance:
        """Record an instance about to be started (state starting)."""
        with self.session() as s:
            row = self._require(s, model_id, version)
            inst = Instance(version_id=row.id, name=name, log_path=log_path)
            s.add(inst)
            return inst

    def update_instance(self, name: str, **fields: Any) -> None:
        """Update an instance's state, pid or endpoints (``endpoints=dict``)."""
        with self.session() as s:
            inst = s.scalar(select(Instance).where(Instance.name == name))
            if inst is None:
                raise KeyError(f"no instance named {name!r}")
            if "endpoints" in fields:
                fields["endpoints_json"] = json.dumps(fields.pop("endpoints"), sort_keys=True)
            for k, v in fields.items():
                setattr(inst, k, v)

    def instances(self, model_id: str | None = None, version: str | None = None, *, live: bool = True) -> list[Instance]:
        """Instances (not stopped, unless ``live=False``), oldest first, with their version loaded."""
        with self.session() as s:
            q = select(Instance).join(ModelVersion).order_by(Instance.id)
            if model_id is not None:
                q = q.where(ModelVersion.model_id == model_id)
            if version is not None:
                q = q.where(ModelVersion.version == version)
            if live:
                q = q.where(Instance.state != "stopped")
            rows = list(s.scalars(q))
            for r in rows:
                _ = r.model_version  # load before the session closes
            return rows

    # -- scaling ---------------------------------------------------------------------------
    def record_scale(self, model_id: str, version: str, before: int, after: int, signal: str, value: float | None,
                     detail: str) -> int:
        """Record a scaling decision as it starts (outcome ``started``); returns its id for
        :meth:`finish_scale`."""
        with self.session() as s:
            row = ScaleDecision(model_id=model_id, version=version, before=before, after=after, signal=signal,
                                value=value, detail=detail)
            s.add(row)
            s.flush()
            return row.id

    def finish_scale(self, decision_id: int, outcome: str, seconds: float, detail: str = "") -> None:
        """How decision ``decision_id`` ended: ``done`` or ``failed`` (``detail`` says why),
        after ``seconds``."""
        with self.session() as s:
            row = s.get(ScaleDecision, decision_id)
            if row is None:
                raise KeyError(f"no scale decision {decision_id}")
            row.outcome, row.seconds = outcome, seconds
            if detail:
                row.detail = detail

    def scale_decisions(self, model_id: str | None = None, version: str | None = None,
                        limit: int = 20) -> list[ScaleDecision]:
        """The latest ``limit`` scaling decisions (of one model, or version), newest first."""
        with self.session() as s:
            q = select(ScaleDecision).order_by(ScaleDecision.id.desc()).limit(limit)
            if model_id is not None:
                q = q.where(ScaleDecision.model_id == model_id)
            if version is not None:
                q = q.where(ScaleDecision.version == version)
            return list(s.scalars(q))

    # -- API keys ----------------------------------------------------------------------------
    # -- experiments -----------------------------------------------------------------------
    def experiment(self, model_id: str) -> Experiment | None:
        """The experiment running on ``model_id``, or None."""
        with self.session() as s:
            return s.scalar(select(Experiment).where(Experiment.model_id == model_id, Experiment.stopped_at.is_(None)))

    def experiments(self, model_id: str | None = None, *, running: bool = True) -> list[Experiment]:
        """Experiments (of one model; only running ones unless ``running`` is False), newest first."""
        with self.session() as s:
            q = select(Experiment).order_by(Experiment.id.desc())
            if model_id is not None:
                q = q.where(Experiment.model_id == model_id)
            if running:
                q = q.where(Experiment.stopped_at.is_(None))
            return list(s.scalars(q))

    def start_experiment(self, model_id: str, spec: ExperimentSpec, baseline_json: str = "{}") -> Experiment:
        """Record a running experiment.

        Raises:
            ValueError: one runs on the model already.
        """
        with self.session() as s:
            if running := s.scalar(select(Experiment).where(Experiment.model_id == model_id,
                                                             Experiment.stopped_at.is_(None))):
                since = running.started_at.strftime("%Y-%m-%d %H:%M")
                raise ValueError(f"an experiment runs on {model_id} already (since {since} UTC); "
                                 f"`modelops experiment stop {model_id} --keep VERSION` ends it")
            row = Experiment(model_id=model_id, arms_json=json.dumps([[a.version, a.percent] for a in spec.arms]),
                             key=spec.key, default_version=spec.default, baseline_json=baseline_json)
            s.add(row)
        return row

    def discard_experiment(self, experiment_id: int) -> None:
        """Forget an experiment that never took effect (the router refused its routes)."""
        with self.session() as s:
            s.execute(delete(Experiment).where(Experiment.id == experiment_id))

    def stop_experiment(self, model_id: str, kept: str) -> Experiment:
        """End the model's experiment, recording the version kept.

        Raises:
            KeyError: none runs on the model.
        """
        with self.session() as s:
            row = s.scalar(select(Experiment).where(Experiment.model_id == model_id, Experiment.stopped_at.is_(None)))
            if row is None:
                raise KeyError(f"no experiment runs on {model_id} (`modelops experiment status`)")
            row.stopped_at, row.kept = _now(), kept
        return row

    def shadow(self, model_id: str) -> Shadow | None:
        """The shadow running on ``model_id``, or None."""
        with self.session() as s:
            return s.scalar(select(Shadow).where(Shadow.model_id == model_id, Shadow.stopped_at.is_(None)))

    def shadows(self, model_id: str | None = None, *, running: bool = True) -> list[Shadow]:
        """Shadows (of one model; only running ones unless ``running`` is False), newest first."""
        with self.session() as s:
            q = select(Shadow).order_by(Shadow.id.desc())
            if model_id is not None:
                q = q.where(Shadow.model_id == model_id)
            if running:
                q = q.where(Shadow.stopped_at.is_(None))
            return list(s.scalars(q))

    def start_shadow(self, model_id: str, version: str, percent: int, origin: str = "cli") -> Shadow:
        """Record a running shadow.

        Raises:
            ValueError: one runs on the model already.
        """
        with self.session() as s:
            if running := s.scalar(select(Shadow).where(Shadow.model_id == model_id, Shadow.stopped_at.is_(None))):
                raise ValueError(f"a shadow of {model_id} runs already (version {running.version}, "
                                 f"{running.percent} %, started by {running.origin}); "
                                 f"`modelops shadow stop {model_id}` ends it")
            row = Shadow(model_id=model_id, version=version, percent=percent, origin=origin)
            s.add(row)
        return row

    def stop_shadow(self, model_id: str) -> Shadow:
        """End the model's shadow.

        Raises:
            KeyError: none runs on the model.
        """
        with self.session() as s:
            row = s.scalar(select(Shadow).where(Shadow.model_id == model_id, Shadow.stopped_at.is_(None)))
            if row is None:
                raise KeyError(f"no shadow runs on {model_id} (`modelops shadow status`)")
            row.stopped_at = _now()
        return row

    def key_name_taken(self, name: str) -> str | None:
        """Why no new key may be named ``name`` (a key, live or revoked, has it), or None."""
        with self.session() as s:
            return _name_taken(s.scalar(select(ApiKey).where(ApiKey.name == name)))

    def create_key(self, name: str, key_hash: str, models: tuple[str, ...], rpm: int | None = None,
                   max_concurrency: int | None = None, tpm: int | None = None) -> ApiKey:
        """Store a new key (its hash only).

        Raises:
            ValueError: a key of that name exists (revoked ones included).
        """
        with self.session() as s:
            if taken := _name_taken(s.scalar(select(ApiKey).where(ApiKey.name == name))):
                raise ValueError(taken)
            row = ApiKey(name=name, key_hash=key_hash, models_json=json.dumps(list(models)), rpm=rpm,
                         max_concurrency=max_concurrency, tpm=tpm)
            s.add(row)
        return row

    def api_keys(self, *, include_revoked: bool = True) -> list[ApiKey]:
        """Every key, oldest first."""
        with self.session() as s:
            q = select(ApiKey).order_by(ApiKey.id)
            if not include_revoked:
                q = q.where(ApiKey.revoked_at.is_(None))
            return list(s.scalars(q))

    def grants(self) -> list[KeyGrant]:
        """What the router enforces: the active keys' grants."""
        return [k.grant() for k in self.api_keys(include_revoked=False)]

    def revoke_key(self, name: str) -> ApiKey:
        """Revoke ``name`` (idempotent: a revoked key stays revoked at its first time).

        Raises:
            KeyError: no key of that name.
        """
        with self.session() as s:
            row = self._key(s, name)
            row.revoked_at = row.revoked_at or _now()
        return row

    def rotate_key(self, name: str, key_hash: str) -> ApiKey:
        """Give active key ``name`` a new secret (its hash); scope and limits are kept.

        Raises:
            KeyError: no key of that name. ValueError: the key is revoked.
        """
        with self.session() as s:
            row = self._key(s, name)
            if row.revoked_at is not None:
                raise ValueError(revoked_key_refusal(name))
            row.key_hash, row.rotated_at = key_hash, _now()
        return row

    def set_throttled(self, until: dict[str, float]) -> bool:
        """Set ``throttled_until`` of the keys named (Unix seconds; 0: not throttled); whether
        any changed."""
        changed = False
        with self.session() as s:
            for row in s.scalars(select(ApiKey).where(ApiKey.name.in_(list(until)))):
                if row.throttled_until != until[row.name]:
                    row.throttled_until, changed = until[row.name], True
        return changed

    def add_usage(self, counted: dict[tuple[str, str], tuple[int, int, int]], at: float) -> None:
        """Add ``{(key name, model_id): (requests, prompt tokens, completion tokens)}`` counted
        at ``at`` (Unix seconds) to its bucket."""
        bucket = int(at) // USAGE_BUCKET_S * USAGE_BUCKET_S
        with self.session() as s:
            for (key_name, model_id), (requests, prompt, completion) in counted.items():
                row = s.scalar(select(KeyUsage).where(KeyUsage.key_name == key_name, KeyUsage.model_id == model_id,
                                                      KeyUsage.bucket == bucket))
                if row is None:
                    row = KeyUsage(key_name=key_name, model_id=model_id, bucket=bucket)
                    s.add(row)
                row.requests = (row.requests or 0) + requests
                row.prompt_tokens = (row.prompt_tokens or 0) + prompt
                row.completion_tokens = (row.completion_tokens or 0) + completion

    def usage(self, since: float, key_name: str | None = None) -> list[dict[str, Any]]:
        """Usage per key and model in the buckets from ``since`` (Unix seconds) on:
        ``[{"key", "model_id", "requests", "prompt_tokens", "completion_tokens"}]``, by key."""
        from sqlalchemy import func

        with self.session() as s:
            q = (select(KeyUsage.key_name, KeyUsage.model_id, func.sum(KeyUsage.requests),
                        func.sum(KeyUsage.prompt_tokens), func.sum(KeyUsage.completion_tokens))
                 .where(KeyUsage.bucket >= int(since) // USAGE_BUCKET_S * USAGE_BUCKET_S)
                 .group_by(KeyUsage.key_name, KeyUsage.model_id).order_by(KeyUsage.key_name, KeyUsage.model_id))
            if key_name is not None:
                q = q.where(KeyUsage.key_name == key_name)
            return [{"key": k, "model_id": m, "requests": int(r), "prompt_tokens": int(p), "completion_tokens": int(c)}
                    for k, m, r, p, c in s.execute(q)]

    def token_buckets(self, key_name: str, since: float) -> list[tuple[int, int]]:
        """``[(bucket, prompt + completion tokens)]`` of ``key_name`` from ``since`` on, oldest first."""
        from sqlalchemy import func

        with self.session() as s:
            q = (select(KeyUsage.bucket, func.sum(KeyUsage.prompt_tokens + KeyUsage.completion_tokens))
                 .where(KeyUsage.key_name == key_name, KeyUsage.bucket >= int(since) // USAGE_BUCKET_S * USAGE_BUCKET_S)
                 .group_by(KeyUsage.bucket).order_by(KeyUsage.bucket))
            return [(int(b), int(t)) for b, t in s.execute(q)]

    @staticmethod
    def _key(s: Session, name: str) -> ApiKey:
        row = s.scalar(select(ApiKey).where(ApiKey.name == name))
        if row is None:
            raise KeyError(f"no key named {name!r} (`modelops keys ls` lists them)")
        return row

    # -- views -----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The shape printed by ``modelops status --json``::

        {"models": [{"model_id", "versions": [{"version", "state", "weight", "strategy",
                     "framework", "execution_mode" (embedded | separate),
                     "reason", "endpoints": {instance name: {openai, kserve_http, ...}},
                     "pids": {instance name: pid},
                     "instances": {instance name: {state, restarts, last_exit}},
                     "scaling": the manifest's policy {min, max, target, ...},
                     "last_scale": the autoscaler's latest decision {at, before, after, signal,
                                   value, outcome, detail, seconds} or None}]}]}
        """
        models: dict[str, list[dict[str, Any]]] = {}
        with self.session() as s:
            for v in s.scalars(select(ModelVersion).order_by(ModelVersion.model_id, ModelVersion.id)):
                announced = json.loads(v.manifest_json)  # as stored: rows from before a field have its default
                models.setdefault(v.model_id, []).append(
                    {
                        "version": v.version,
                        "state": v.state,
                        "weight": v.weight,
                        "strategy": v.strategy,
                        "framework": announced.get("framework", "vllm"),
                        "execution_mode": announced.get("execution_mode", "embedded"),
                        "reason": v.reason,
                        "endpoints": {i.name: i.endpoints for i in v.instances if i.state != "stopped"},
                        "pids": {i.name: i.pid for i in v.instances if i.state != "stopped"},
                        "instances": {i.name: {"state": i.state, "restarts": i.restarts, "last_exit": i.last_exit}
                                      for i in v.instances if i.state != "stopped"},
                        "scaling": Scaling.model_validate(announced.get("scaling") or {}).model_dump(),
                        "last_scale": _decision(s.scalar(select(ScaleDecision).where(
                            ScaleDecision.model_id == v.model_id, ScaleDecision.version == v.version)
                            .order_by(ScaleDecision.id.desc()).limit(1))),
                    }
                )
        return {"models": [{"model_id": m, "versions": vs} for m, vs in models.items()]}

    @staticmethod
    def _require(s: Session, model_id: str, version: str) -> ModelVersion:
        row = s.scalar(select(ModelVersion).where(ModelVersion.model_id == model_id, ModelVersion.version == version))
        if row is None:
            raise KeyError(f"{model_id} version {version} is not in the registry")
        return row


def _decision(row: ScaleDecision | None) -> dict[str, Any] | None:
    if row is None:
        return None
    return {"at": row.at.isoformat(timespec="seconds"), "before": row.before, "after": row.after, "signal": row.signal,
            "value": row.value, "outcome": row.outcome, "detail": row.detail, "seconds": row.seconds}
