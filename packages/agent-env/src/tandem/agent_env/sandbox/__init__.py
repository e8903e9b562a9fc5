"""The sandbox, host side: how an episode's commands and its grading get isolated.

Each episode runs in its own sandbox (bubblewrap's namespaces, or a fork of the fork server
that builds the same ones), with its workspace as an overlay over the task's read-only base,
limited by a memory and pids cgroup, rlimits and size-capped tmpfs mounts.

- ``runtime.py``: process-wide resources (scratch directory, per-task base layers, cgroups,
  the mount helper, a fork server per event loop), shared by every episode of one config.
- ``session.py``: one episode's sandbox and the supervisor in it; tool requests go through it.
- ``forkserver_client.py``: starts the fork server and launches jobs (sessions, gradings) in it.
- ``bwrap.py``: finding, probing and invoking bubblewrap with the strict profile.
- ``cgroups.py``: per-sandbox memory and pids cgroups (v1 or v2), recycled once empty.
- ``mounts.py``: the helper that mounts each episode's size-capped workspace tmpfs.
- ``proc.py``: child processes watched by pidfd on the event loop, started in a cgroup.
- ``seccomp.py``: the seccomp filter (classic BPF) every sandbox runs under.
- ``answers.py``: the schemas every supervisor answer is checked against.
- ``rootless.py``: limits for a user who is not root: a delegated cgroup v2 subtree when
  systemd gives one, rlimits standing in for cgroups otherwise.
- ``locales.py``: a locale archive for sandboxes; ``deadlines.py``: per-loop request
  timeouts; ``jsonwire.py``: encoding of requests and jobs sent into the sandbox.
- ``inside/``: the stdlib-only programs that run *inside* the sandbox (supervisor, shell, test
  runner, the fork server itself), bound read-only at ``/.tandem``; the modules above start
  them by name and never import them.
"""
