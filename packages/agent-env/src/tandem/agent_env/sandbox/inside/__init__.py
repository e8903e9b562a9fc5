"""Programs that run *inside* the sandbox with the sandbox's Python (stdlib only).

This directory is bound read-only into every sandbox at ``/.tandem`` and its modules are
imported from there by name (``bwrap.tool_argv``), so they must not import tandem or any
third-party package. ``supervisor.py`` serves one episode's tools (with ``shell.py``, its
persistent bash, ``files.py``, the file tools, and ``capture.py``, the kept head and tail of
a command's output), ``runner.py`` runs the hidden tests (``integrity.py`` checks that the
test framework was left alone, ``canon.py`` writes results as canonical text),
``forkserver_server.py`` is the fork server (``privileges.py`` drops its jobs' capabilities),
``lockdown.py`` takes the last steps before untrusted code runs, and ``jsonlite.py`` is their
small JSON codec.
"""
