"""`plexrl serve`: the long-running controller (one `Runner` that never returns until stopped) behind an HTTP
API, with a durable journal and checkpoints. Modules: `journal` (sqlite, WAL), `controller` (runner thread,
preparation threads, journal and checkpoint hook; per-user admission is the planner's), `submissions`
(what a job may name), `config` (the server YAML), `api` (FastAPI app, `start_server`), `client` (the thin
urllib client the CLI uses), `signals` (SIGTERM as a graceful stop). Operations: docs/operations.md."""
