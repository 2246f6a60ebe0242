"""Sessions: jobs driven by the user's own program (docs/architecture.md, "Names"). Each remote call (forward_backward,
optim_step, sample, save, load, ...) is one node of the session's open plan; this package holds what runs on the
service: the calls' records (`calls.py`), the built-in losses (`losses.py`), the session's engine wrapper
(`engine.py`) and the node operators (`operators.py`). The HTTP protocol that brings the calls is the server's
(`plexrl/server/tinker/`)."""
