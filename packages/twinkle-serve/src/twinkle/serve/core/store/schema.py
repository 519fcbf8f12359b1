"""The store's schema as numbered migrations; `PRAGMA user_version` says how many have run.

Migration 1 is the schema the first release wrote without a version number (so a database from that
release, at user_version 0, passes through it unchanged: every statement is IF NOT EXISTS). Append
new migrations; never edit one that has shipped.
"""

from __future__ import annotations

import sqlite3

V1 = """
CREATE TABLE IF NOT EXISTS api_keys (name TEXT PRIMARY KEY, key_hash TEXT UNIQUE NOT NULL,
    created_at REAL NOT NULL, revoked_at REAL);
CREATE TABLE IF NOT EXISTS sessions (session_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at REAL,
    last_heartbeat REAL, finished_at REAL, finish_reason TEXT, tags TEXT, user_metadata TEXT);
CREATE TABLE IF NOT EXISTS models (model_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session_id TEXT,
    base_model TEXT, lora TEXT, created_at REAL, last_request_time REAL, user_metadata TEXT);
CREATE TABLE IF NOT EXISTS samplers (sampler_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session_id TEXT,
    base_model TEXT, model_path TEXT, created_at REAL, ephemeral INTEGER DEFAULT 0);
CREATE TABLE IF NOT EXISTS checkpoints (tinker_path TEXT PRIMARY KEY, tenant TEXT NOT NULL, model_id TEXT,
    kind TEXT, name TEXT, created_at REAL, size_bytes INTEGER, public INTEGER DEFAULT 0, expires_at REAL,
    dir TEXT, user_metadata TEXT);
CREATE TABLE IF NOT EXISTS futures (request_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, status TEXT,
    content_type TEXT, payload BLOB, created_at REAL, completed_at REAL);
CREATE TABLE IF NOT EXISTS idempotency (tenant TEXT NOT NULL, key TEXT NOT NULL, fingerprint TEXT NOT NULL,
    status INTEGER, content_type TEXT, body BLOB, created_at REAL, PRIMARY KEY (tenant, key));
CREATE TABLE IF NOT EXISTS run_curves (model_id TEXT NOT NULL, tenant TEXT NOT NULL, step INTEGER,
    name TEXT NOT NULL, value REAL, t REAL);
CREATE INDEX IF NOT EXISTS run_curves_model ON run_curves (model_id, name, step);
"""

# 2: which API made a run is a column (it was a flag inside the `lora` JSON), and checkpoint folders
# are recorded relative to the data dir, so a data dir can be moved or restored elsewhere.
V2 = """
ALTER TABLE models ADD COLUMN api TEXT NOT NULL DEFAULT 'tinker';
UPDATE models SET api = 'native' WHERE json_extract(lora, '$.native') = 1;
UPDATE checkpoints SET dir = substr(dir, instr(dir, '/tenants/') + 1) WHERE instr(dir, '/tenants/') > 0;
CREATE INDEX IF NOT EXISTS models_tenant ON models (tenant, created_at);
CREATE INDEX IF NOT EXISTS checkpoints_model ON checkpoints (model_id, kind, created_at);
CREATE INDEX IF NOT EXISTS futures_status ON futures (status, completed_at);
"""

# 3: the tables of the SDK 0.38 routes (tinker/routes_services.py): server-side custom losses, the sampling
# completion queue and its clones, session projects, and token usage per hour (both APIs count training).
V3 = """
CREATE TABLE IF NOT EXISTS custom_losses (loss_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session_id TEXT,
    name TEXT, inputs TEXT, graph TEXT, created_at REAL);
CREATE TABLE IF NOT EXISTS sample_requests (request_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, sampler_id TEXT,
    clone INTEGER, completion INTEGER);
CREATE TABLE IF NOT EXISTS sampler_clients (sampler_id TEXT PRIMARY KEY, clients INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS session_projects (session_id TEXT PRIMARY KEY, project_id TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS usage (tenant TEXT NOT NULL, hour INTEGER NOT NULL, session_id TEXT NOT NULL,
    base_model TEXT NOT NULL, kind TEXT NOT NULL, tokens INTEGER NOT NULL,
    PRIMARY KEY (tenant, hour, session_id, base_model, kind));
CREATE INDEX IF NOT EXISTS sample_requests_sampler ON sample_requests (tenant, sampler_id, clone);
"""

# 4: usage per training run (the `usage` table counts per key, hour and session), and per-key quotas
# (NULL: no limit), set with `twinkle-server keys set-quota`.
V4 = """
CREATE TABLE IF NOT EXISTS run_usage (model_id TEXT NOT NULL, tenant TEXT NOT NULL, kind TEXT NOT NULL,
    tokens INTEGER NOT NULL, PRIMARY KEY (model_id, kind));
CREATE INDEX IF NOT EXISTS run_usage_tenant ON run_usage (tenant);
CREATE TABLE IF NOT EXISTS quotas (tenant TEXT PRIMARY KEY, tokens_per_day INTEGER, storage_bytes INTEGER,
    adapters INTEGER);
CREATE INDEX IF NOT EXISTS usage_tenant_hour ON usage (tenant, hour);
"""

# 5: the dashboard's: a key's role ('operator' keys also open the operator page, `keys create --operator`),
# and the last few sampled completions a run's owner chose to show on its run page (bounded per run).
V5 = """
ALTER TABLE api_keys ADD COLUMN role TEXT NOT NULL DEFAULT 'tenant';
CREATE TABLE IF NOT EXISTS run_samples (model_id TEXT NOT NULL, tenant TEXT NOT NULL, t REAL NOT NULL,
    step INTEGER, prompt TEXT NOT NULL, completion TEXT NOT NULL, reward REAL);
CREATE INDEX IF NOT EXISTS run_samples_model ON run_samples (model_id, t);
"""
# 6: stable_reinforce (tinker/provenance.py): per sampled sequence what the loss needs (its request's prompt,
# its tokens and the sampler's log-probs, int32/float32 bytes) and the policy version that sampled it;
# and the policy version each sampler serves (a run's optimizer step count when its weights were taken).
V6 = """
CREATE TABLE IF NOT EXISTS stability_records (sequence_id TEXT PRIMARY KEY, tenant TEXT NOT NULL,
    session_id TEXT NOT NULL, sampler_id TEXT, model_id TEXT, policy_version INTEGER, prompt BLOB NOT NULL,
    tokens BLOB NOT NULL, logprobs BLOB NOT NULL, n_tokens INTEGER NOT NULL, created_at REAL NOT NULL,
    last_used REAL NOT NULL);
CREATE INDEX IF NOT EXISTS stability_records_tenant ON stability_records (tenant, last_used);
CREATE INDEX IF NOT EXISTS stability_records_session ON stability_records (session_id);
CREATE TABLE IF NOT EXISTS stability_policies (sampler_id TEXT PRIMARY KEY, model_id TEXT,
    policy_version INTEGER NOT NULL);
"""

# 7: one row per server start. A future's id begins with its boot's id, so a future whose row a kill -9
# lost (rows are journaled, db.py) is recognised after the restart and answered with the restart error.
V7 = """
CREATE TABLE IF NOT EXISTS boots (boot_id TEXT PRIMARY KEY, started_at REAL NOT NULL);
"""

# 8: the audit log (Tinker's get_audit_log): what each key's checkpoints and projects saw, and when.
V8 = """
CREATE TABLE IF NOT EXISTS audit_events (tenant TEXT NOT NULL, t REAL NOT NULL, event TEXT NOT NULL,
    details TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS audit_events_tenant ON audit_events (tenant, t);
"""

MIGRATIONS = [V1, V2, V3, V4, V5, V6, V7, V8]
VERSION = len(MIGRATIONS)


def migrate(db: sqlite3.Connection) -> int:
    """Run the migrations this database has not seen, each in one transaction; the version reached."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > VERSION:
        raise RuntimeError(
            f"the data dir's database is at schema version {version}, newer than this server's "
            f"{VERSION}: run the newer twinkle-server (downgrades are not supported)"
        )
    for number in range(version + 1, VERSION + 1):
        try:
            db.executescript(f"BEGIN;\n{MIGRATIONS[number - 1]}\nPRAGMA user_version = {number};\nCOMMIT;")
        except sqlite3.Error:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
    return VERSION
