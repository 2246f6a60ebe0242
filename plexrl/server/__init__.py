"""`plexrl serve`: the long-running controller (one `Runner` that never returns until stopped) behind an HTTP
API, with a durable journal (`journal.py`). Modules: `journal` (sqlite, WAL), `controller` (runner thread,
preparation thread, journal hook), `config` (the server YAML), `api` (FastAPI app, submission checks),
`client` (the thin urllib client the CLI uses), `signals` (SIGTERM as a graceful stop)."""
