"""Scripts that run *inside* the sandbox with the system Python (stdlib only).

They are bound read-only into every sandbox at ``/.tandem`` and executed by the sandbox's own
interpreter, so they must not import tandem or any third-party package.
"""
